"""Training records as model inputs: chat-template encoding with assistant-only labels (`Encoder`), the datasets a
stage trains on (`EncodedDataset`, `MixedDataset` with its own order) and the batches (`collate`).

Encoding (`Encoder`): the base's chat template renders the conversation; each assistant turn's
characters are found by rendering the conversation up to that turn with and without it (the
template must be prefix-stable, checked); labels are the tokens inside those spans (the assistant's
content and its end-of-turn token), -100 elsewhere. Images go through the VLM processor's image
processor one by one, and each `<image>` is expanded to the number of image tokens the processor
asks for (`replace_image_token`), wrapped as the VLM's own template wraps it. The records come from
`interventions.adapt.sources`.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

import numpy as np
import torch

from interventions.adapt.sources import IMAGE, DataError, Records
from sinkstudy import SinkstudyError


def open_image(image):
    """A PIL RGB image from a path, PIL image, HWC uint8 array or datasets' {"bytes", "path"}."""
    # lazy: loads PIL
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        try:
            return Image.open(image).convert("RGB")
        except OSError as exc:
            raise DataError(f"cannot open image {image}: {exc}") from None
    if isinstance(image, dict) and (image.get("bytes") or image.get("path")):
        return Image.open(io.BytesIO(image["bytes"]) if image.get("bytes") else image["path"]).convert("RGB")
    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert("RGB")
    if hasattr(image, "convert"):
        return image.convert("RGB")
    raise DataError(f"unsupported image object {type(image).__name__}")


@dataclass
class Encoder:
    """Record -> {"input_ids", "labels", "images"} for one model (VLM processor or text-only)."""

    tokenizer: Any
    processor: Any = None  # None: text-only model (records with images are refused)
    image_token: str | None = None
    image_wrap: tuple[str, str] = ("", "")
    max_length: int = 2048
    loss_on: str = "assistant"  # or "all": every token of a chat is a target

    def __post_init__(self):
        if not getattr(self.tokenizer, "is_fast", False):
            raise SinkstudyError("the adaptation engine needs a fast tokenizer (offsets map assistant turns to tokens)")
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token) if self.image_token else None
        self._last_image = (None, None)  # (image object, its processed tensors): probes re-encode one image many times

    def __call__(self, record: dict) -> dict:
        if "text" in record:
            ids = self.tokenizer(record["text"], add_special_tokens=True, truncation=True, max_length=self.max_length)["input_ids"]
            return {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids), "images": []}
        images = record.get("images") or []
        if images and self.processor is None:
            raise DataError("an image record reached a text-only model (no vision tower)")
        processed = [self._image(im) for im in images]
        expansions = [self.image_wrap[0] + self.processor.replace_image_token(p, 0) + self.image_wrap[1] for p in processed]
        messages = record["messages"]
        full = self._expand(self._render(messages), expansions)
        spans = self._assistant_spans(messages, full, expansions) if self.loss_on == "assistant" else [(0, len(full))]
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        labels = [t if any(a <= start < b for a, b in spans) else -100 for t, (start, _) in zip(ids, offsets)]
        counts = [e.count(self.image_token) for e in expansions]
        ids, labels, kept = self._truncate(ids, labels, counts)
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "images": processed[:kept]}

    def _image(self, image) -> dict:
        # Identity, not id(): the reference held here keeps the object alive, so it cannot be mistaken.
        if self._last_image[0] is image and not isinstance(image, (str, os.PathLike)):
            return self._last_image[1]
        out = self.processor.image_processor(images=[open_image(image)], return_tensors="pt")
        processed = {k: v for k, v in out.items() if torch.is_tensor(v)}
        self._last_image = (image, processed)
        return processed

    def _render(self, messages, **kw) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kw)

    @staticmethod
    def _expand(text: str, expansions: list[str]) -> str:
        parts = text.split(IMAGE)
        if len(parts) - 1 > len(expansions):
            raise DataError(f"the rendered chat holds {len(parts) - 1} {IMAGE} markers for {len(expansions)} image(s) "
                            "(does the chat template or a system prompt contain the marker?)")
        return "".join(p + (expansions[i] if i < len(parts) - 1 else "") for i, p in enumerate(parts))

    def _assistant_spans(self, messages, full: str, expansions: list[str]) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._expand(self._render(messages[:i], add_generation_prompt=True), expansions)
            upto = full if i == len(messages) - 1 else self._expand(self._render(messages[: i + 1]), expansions)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise DataError("the chat template is not prefix-stable (a later turn changes how an earlier one renders), "
                                "so assistant turns cannot be located; use loss_on: all or another template")
            spans.append((len(before), len(upto)))
        return spans

    def _truncate(self, ids: list[int], labels: list[int], counts: list[int]) -> tuple[list[int], list[int], int]:
        """Cut to max_length; an image whose tokens would be cut is dropped with everything after it.

        Returns (ids, labels, number of images kept). `counts`: image tokens of each image, in order.
        """
        if len(ids) <= self.max_length:
            return ids, labels, len(counts)
        cut, kept = self.max_length, len(counts)
        positions = [p for p, t in enumerate(ids) if t == self.image_token_id] if counts else []
        start = 0
        for k, n in enumerate(counts):
            block = positions[start:start + n]
            start += n
            if block and block[-1] >= cut:
                cut, kept = block[0], k
                break
        return ids[:cut], labels[:cut], kept


class EncodedDataset(torch.utils.data.Dataset):
    """Records of one or more sources, encoded on access (in DataLoader workers when there are any)."""

    def __init__(self, sources: Sequence[Records], encoder: Encoder):
        self.sources = list(sources)
        self.encoder = encoder
        self.offsets = []
        total = 0
        for s in self.sources:
            self.offsets.append(total)
            total += len(s)
        self.total = total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> dict:
        for s, off in zip(reversed(self.sources), reversed(self.offsets)):
            if i >= off:
                return self.encoder(s[i - off])
        raise IndexError(i)


class MixedDataset(torch.utils.data.Dataset):
    """`main` with a fixed share of `extra` items (e.g. text-only chats replayed during VL training).

    The order comes from `sampler(seed)` (the adaptation trainer uses it): per epoch each `main` item
    appears once and item k of the epoch is an `extra` item exactly when floor((k+1) r) > floor(k r)
    for r = `share` (exact fractions), so any n consecutive items from the start of an epoch hold
    floor(n r) extra ones, and every micro-batch of b items holds r b of them when r b is whole.
    Both parts are shuffled by (seed, epoch); `extra` items are cycled when more slots than items.
    Indices: 0..len(main)-1 are `main`'s, the rest `extra`'s.
    """

    def __init__(self, main, extra, share: float, *, seed: int = 0):
        if not 0 < share < 1:
            raise SinkstudyError(f"mixing share must be in (0, 1), got {share!r}")
        if len(main) == 0 or len(extra) == 0:
            raise SinkstudyError("mixing needs a non-empty main and extra dataset")
        self.main, self.extra, self.seed = main, extra, seed
        self.share = Fraction(share).limit_denominator(10**6)
        self.encoder = getattr(main, "encoder", None)
        n = len(main)
        while n - self._extra_before(n) < len(main):  # the epoch: every main item once
            n += 1
        self.epoch_length = n

    def _extra_before(self, n: int) -> int:
        return (n * self.share.numerator) // self.share.denominator

    def is_extra_slot(self, k: int) -> bool:
        return self._extra_before(k + 1) > self._extra_before(k)

    def __len__(self) -> int:
        return len(self.main) + len(self.extra)

    def __getitem__(self, i: int) -> dict:
        return self.main[i] if i < len(self.main) else self.extra[i - len(self.main)]

    def order(self, seed: int, epoch: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        main = torch.randperm(len(self.main), generator=g).tolist()
        n_extra = self.epoch_length - len(self.main)
        cycles = -(-n_extra // len(self.extra))
        extra = [len(self.main) + j for _ in range(cycles) for j in torch.randperm(len(self.extra), generator=g).tolist()]
        it_main, it_extra = iter(main), iter(extra)
        return [next(it_extra) if self.is_extra_slot(k) else next(it_main) for k in range(self.epoch_length)]

    def sampler(self, seed: int) -> "_OrderSampler":
        return _OrderSampler(self, seed)


class _OrderSampler(torch.utils.data.Sampler):
    """A dataset's own order for the current epoch (set_epoch is called by the Trainer / accelerate)."""

    def __init__(self, dataset: MixedDataset, seed: int):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(self.dataset.order(self.seed, self.epoch))

    def __len__(self) -> int:
        return self.dataset.epoch_length


def collate(features: list[dict], pad_id: int) -> dict:
    """Right-padded input_ids / attention_mask / labels, and the batch's image tensors concatenated."""
    width = max(len(f["input_ids"]) for f in features)
    input_ids = torch.full((len(features), width), pad_id, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        input_ids[row, :n], labels[row, :n], mask[row, :n] = f["input_ids"], f["labels"], 1
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    images = [im for f in features for im in f["images"]]
    for key in images[0] if images else ():
        batch[key] = torch.cat([im[key] for im in images])
    return batch
