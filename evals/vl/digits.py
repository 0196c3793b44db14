"""scikit-learn's 1,797 bundled 8x8 digits (offline) and their seeded train / held-out split.

The split is a permutation by `seed`: its first `n_heldout` images are held out, the rest train. Pixels
0..16 become 8-bit greys (v * 255 / 16); `upscale` enlarges them (nearest neighbour) for a tower whose
input is larger than 8x8."""

from __future__ import annotations

import functools

from sinkstudy import SinkstudyError

SPLITS = ("train", "heldout")


def split_indices(split: str, *, n_heldout: int = 200, seed: int = 0) -> list[int]:
    """Indices of the bundled digits in `split` (the seeded permutation's head is held out)."""
    # lazy: loads numpy
    import numpy as np

    if split not in SPLITS:
        raise SinkstudyError(f"digits split must be train or heldout, got {split!r}")
    order = np.random.default_rng(seed).permutation(len(images_and_labels()[1]))
    return [int(i) for i in (order[n_heldout:] if split == "train" else order[:n_heldout])]


def rgb(index: int, upscale: int = 1):
    """Digit `index` as an HxWx3 uint8 array (greys), enlarged `upscale` times."""
    # lazy: loads numpy
    import numpy as np

    pixels = images_and_labels()[0][index]
    if upscale > 1:
        pixels = np.kron(pixels, np.ones((upscale, upscale), dtype=np.uint8))
    return np.repeat(pixels[:, :, None], 3, axis=2)


def label(index: int) -> int:
    return int(images_and_labels()[1][index])


@functools.lru_cache(maxsize=1)
def images_and_labels():
    """The bundled digits as 8-bit greys and labels, read-only: parsed once per process (about 0.3 s a time)."""
    # lazy: loads sklearn, scipy, numpy
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    images, targets = np.uint8(np.round(data.images * 255 / 16)), data.target.copy()
    images.flags.writeable = targets.flags.writeable = False
    return images, targets
