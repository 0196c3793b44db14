"""TSV and STAR merges (not in mergekit), with the same interface and outputs as `merge`.

Notation: theta_0 is the merge's anchor (the base LLM, or `root` when given), tau_i = theta_i -
theta_0 the task vectors (one: vlm - base; with `root`: base - root and vlm - root), T their
number. Both methods work matrix by matrix on every 2-D tensor; other tensors (norms, biases)
follow the rule given below.

TSV-Merge (Gargiulo et al., CVPR 2025, "Task Singular Vectors"): for each matrix, the SVD
tau_i = U_i S_i V_i^T is cut to its top k = max(1, floor(k_fraction * min(m, n))) singular
triplets (k_fraction defaults to 1/T). The kept factors are concatenated, U = [U_1k .. U_Tk],
S = diag(S_1k .. S_Tk), V = [V_1k .. V_Tk], and U, V are replaced by their nearest orthonormal
matrices (polar factor: P Q^T from the SVD P D Q^T), removing inter-task interference:
    theta = theta_0 + alpha * U_perp S V_perp^T;     1-D tensors: theta_0 + alpha * mean_i tau_i.
With one task vector k = rank, U and V are already orthonormal, and TSV reduces exactly to task
arithmetic: theta = base + alpha * (vlm - base) (alpha = 1: the VLM LM itself).

STAR (Lee et al., NAACL 2025, "Spectral Truncation and Rescale"): for each matrix of each task
vector, keep the smallest r with sum_{j<=r} s_j >= eta * sum_j s_j (eta given in percent), and
rescale the kept singular values by sum_j s_j / sum_{j<=r} s_j so the nuclear norm is unchanged:
    tau_i' = U_r diag(s_r * ||tau_i||_* / sum_{j<=r} s_j) V_r^T;
    theta = theta_0 + lambda * sum_i tau_i'   (lambda defaults to 1/T: the paper's averaging);
1-D tensors keep tau_i unchanged. With one task vector: base + lambda * STAR(vlm - base), a
low-rank, norm-preserving version of the VLM's change (lambda = 1 by default).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from interventions.outputs import (MergeError, check_disk_space, check_pair, checkpoint_weights, copy_side_files,
                                   estimate_output_bytes, language_model_of, write_result)
from interventions.params import Selection, check_number
from sinkstudy.checkpoint import TensorReader, local_checkpoint
from sinkstudy.io import atomic_output_dir, check_output_dir

SPECTRAL_METHODS = ("tsv", "star")
SHARD_BYTES = 4 * 1024**3


# --------------------------------------------------------------------------- arithmetic

def polar(m):
    """Nearest matrix with orthonormal columns (or rows) to `m`: P Q^T from m = P D Q^T."""
    # lazy: loads torch, numpy
    import torch

    p, _, qh = torch.linalg.svd(m, full_matrices=False)
    return p @ qh


def tsv_merge(deltas: list, alpha: float = 1.0, k_fraction: float | None = None):
    """TSV-Merge of T task matrices (same shape, 2-D), scaled by alpha; see the module doc."""
    # lazy: loads torch, numpy
    import torch

    t = len(deltas)
    rank = min(deltas[0].shape)
    k = max(1, int(rank * (k_fraction if k_fraction is not None else 1.0 / t)))
    us, ss, vs = [], [], []
    for d in deltas:
        u, s, vh = torch.linalg.svd(d.float(), full_matrices=False)
        us.append(u[:, :k])
        ss.append(s[:k])
        vs.append(vh[:k, :])
    u_cat, s_cat, v_cat = torch.cat(us, 1), torch.cat(ss), torch.cat(vs, 0)
    return alpha * (polar(u_cat) * s_cat) @ polar(v_cat)


def star_truncate(delta, eta: float):
    """STAR on one matrix: keep eta percent of the nuclear norm, rescale to the full norm."""
    # lazy: loads torch, numpy
    import torch

    if not 0 < eta <= 100:
        raise MergeError(f"STAR eta is a percentage in (0, 100], got {eta}")
    u, s, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    total = s.sum()
    if total == 0:
        return torch.zeros_like(delta, dtype=torch.float32)
    r = int(torch.searchsorted(torch.cumsum(s, 0), total * eta / 100).item()) + 1
    r = min(r, s.numel())
    kept = s[:r] * (total / s[:r].sum())
    return (u[:, :r] * kept) @ vh[:r, :]


def star_merge(deltas: list, eta: float = 40.0, lam: float | None = None):
    lam = 1.0 / len(deltas) if lam is None else lam
    return lam * sum(star_truncate(d, eta) for d in deltas)


def merge_tensor(method: str, deltas: list, **p):
    """The merged delta of one tensor for `method` (2-D: spectral rule; else the 1-D rule)."""
    # lazy: loads torch, numpy
    import torch

    if deltas[0].ndim == 2 and min(deltas[0].shape) > 1:
        if method == "tsv":
            return tsv_merge(deltas, p.get("alpha", 1.0), p.get("k_fraction"))
        return star_merge(deltas, p.get("eta", 40.0), p.get("lam"))
    if method == "tsv":
        return p.get("alpha", 1.0) * torch.stack([d.float() for d in deltas]).mean(0)
    lam = 1.0 / len(deltas) if p.get("lam") is None else p["lam"]
    return lam * torch.stack([d.float() for d in deltas]).sum(0)


# --------------------------------------------------------------------------- on disk

class _Tensors:
    """Lazy access to the tensors of a validated (possibly sharded) safetensors checkpoint."""

    def __init__(self, path: str | os.PathLike):
        self._reader = TensorReader(checkpoint_weights(path))

    def names(self) -> list[str]:
        return list(self._reader.files.tensors)

    def __getitem__(self, name: str):
        return self._reader.get(name)


class _ShardWriter:
    """Write tensors into ~4 GB safetensors shards plus the standard index, like save_pretrained."""

    def __init__(self, out: Path, max_bytes: int = SHARD_BYTES):
        self.out, self.max_bytes = out, max_bytes
        self.current: dict = {}
        self.size = 0
        self.shards: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor) -> None:
        # lazy: loads torch, numpy
        import torch

        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise MergeError(f"the merge produced non-finite values in {name}; nothing was written")
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.max_bytes:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.size += nbytes

    def _flush(self) -> None:
        # lazy: loads torch, numpy
        from safetensors.torch import save_file

        tmp_name = f"shard-{len(self.shards):05d}.safetensors"
        save_file(self.current, str(self.out / tmp_name), metadata={"format": "pt"})
        self.shards.append((tmp_name, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> None:
        if self.current:
            self._flush()
        if len(self.shards) == 1:
            os.replace(self.out / self.shards[0][0], self.out / "model.safetensors")
            return
        n = len(self.shards)
        weight_map, total = {}, 0
        for i, (tmp_name, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / tmp_name, self.out / final)
            total += (self.out / final).stat().st_size
            weight_map.update({k: final for k in names})
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def validate_spectral_args(method: str, weight: float | None = None, eta: float = 40.0, k_fraction: float | None = None,
                           select=None, device: str = "cpu") -> Selection | None:
    """Method and every setting's range, before anything is read; returns the parsed selection."""
    if method not in SPECTRAL_METHODS:
        raise MergeError(f"unknown spectral method {method!r}; choose from {', '.join(SPECTRAL_METHODS)}")
    if weight is not None:
        check_number(f"{method} {'alpha' if method == 'tsv' else 'lambda'} (weight)", weight, lo=0.0, hi=10.0)
    if method == "star":
        check_number("STAR eta (percent of the nuclear norm)", eta, lo=0.0, hi=100.0, lo_open=True)
    if k_fraction is not None:
        check_number("k_fraction", k_fraction, lo=0.0, hi=1.0, lo_open=True)
    if not isinstance(device, str) or not (device in ("cpu", "auto") or device.startswith("cuda")):
        raise MergeError(f"device must be cpu, cuda[:N] or auto, got {device!r}")
    return Selection.parse(select) if isinstance(select, str) or select is None else select


def run_spectral_merge(
    method: str,
    base: str | os.PathLike,
    vlm: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    weight: float | None = None,
    eta: float = 40.0,
    k_fraction: float | None = None,
    select: Selection | str | None = None,
    root: str | os.PathLike | None = None,
    seed: int = 0,
    replace: bool = False,
    progress: bool = True,
    device: str = "cpu",
    request: dict[str, Any] | None = None,
) -> Path:
    """TSV (`weight` = alpha, default 1) or STAR (`weight` = lambda, default 1/T) into `out_dir`.

    Same checks, outputs and `intervention.json` as the mergekit merges; tensors outside `select`
    are copied from the base unchanged; config and tokenizer files are the base LLM's. A
    non-finite merged tensor stops the merge before anything is moved into place.
    `device="cuda"` runs the SVDs on a GPU.
    """
    # lazy: loads torch, numpy
    import torch

    selection = validate_spectral_args(method, weight, eta, k_fraction, select, device)
    out_dir = check_output_dir(out_dir, replace)
    base_in = base
    base, root = local_checkpoint(base), (local_checkpoint(root) if root is not None else None)
    with language_model_of(base, vlm, out_dir) as vlm_lm:
        check_pair(base, vlm_lm, root)
        check_disk_space(out_dir, estimate_output_bytes(base))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"

        base_t, vlm_t = _Tensors(base), _Tensors(vlm_lm)
        root_t = _Tensors(root) if root is not None else None
        params: dict[str, Any] = {"alpha": 1.0 if weight is None else weight} if method == "tsv" else {"eta": eta, "lam": weight}
        if method == "tsv":
            params["k_fraction"] = k_fraction
        with atomic_output_dir(out_dir, replace) as tmp, torch.no_grad():
            writer = _ShardWriter(tmp)
            for name in tqdm(base_t.names(), desc=f"{method} merge", disable=not progress):
                b = base_t[name]
                if not b.is_floating_point() or (selection is not None and not selection.matches(name)):
                    writer.add(name, b)
                    continue
                anchor = (root_t[name] if root_t else b).to(device, torch.float32)
                models = [b, vlm_t[name]] if root_t else [vlm_t[name]]
                deltas = [m.to(device, torch.float32) - anchor for m in models]
                merged = anchor + merge_tensor(method, deltas, **params)
                writer.add(name, merged.to("cpu", b.dtype))
            writer.close()
            files = {f: "base LLM" for f in copy_side_files(base, tmp)}
            write_result(tmp, method=method, base=base_in, vlm=vlm, vlm_lm=vlm_lm, root=root, seed=seed,
                         settings={"weight": weight, "eta": eta if method == "star" else None,
                                   "k_fraction": k_fraction if method == "tsv" else None,
                                   "select": str(selection) if selection else None, "device": device},
                         extra={"files": {"weights": f"sinkstudy {method}", **files}, **({"request": request} if request else {})})
    return out_dir
