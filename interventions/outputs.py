"""What every weight intervention's output checkpoint shares (mergekit and spectral merges, mitigations, the
sink dose): the checks before anything is written (pair layout, disk space, finite weights), the VLM's
language model extracted for the length of one intervention (`language_model_of`), and the files beside the weights
(`intervention.json` and the model card, `write_result`; config and tokenizer side files)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Iterator

import yaml
from safetensors import safe_open

from interventions.pairs import check_same_layout, load_tokenizer, plan_extraction, write_language_model
from interventions.pairs.resolve import load_config
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import WeightFiles, local_checkpoint, weight_files
from sinkstudy.io import scratch_dir, write_json_atomic, write_text_atomic
from sinkstudy.provenance import fingerprinted_files, model_fingerprint, provenance

LOG = logging.getLogger(__name__)

_NAME_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

DISK_MARGIN = 1.10  # shard padding, tokenizer and temp files on top of the raw tensor bytes

RESULT_JSON = "intervention.json"

class MergeError(SinkstudyError):
    pass

def checkpoint_weights(path: str | os.PathLike) -> WeightFiles:
    """The validated safetensors files of a checkpoint dir (`sinkstudy.checkpoint.weight_files`: every
    shard, index and header checked); merges refuse `.bin`-only checkpoints in one line."""
    files = weight_files(path)
    if files is None:
        raise MergeError(f"{path}: only pytorch_model.bin weights; merges need safetensors checkpoints")
    return files

def tensor_layout(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype, shape) over all shards of a checkpoint."""
    return {name: (t.dtype, t.shape) for name, t in checkpoint_weights(path).tensors.items()}

def checkpoint_dtype(path: str | os.PathLike) -> str:
    """The float dtype a checkpoint stores its weights in (e.g. "bfloat16"): the one holding most bytes."""
    dtype = checkpoint_weights(path).float_dtype()
    if dtype is None:
        raise MergeError(f"{path}: no floating-point tensors")
    return dtype

def estimate_output_bytes(path: str | os.PathLike, out_dtype: str | None = None) -> int:
    """Bytes of the merged weights: the base's tensors, floating ones at `out_dtype` (default: as stored)."""
    total = 0
    for t in checkpoint_weights(path).tensors.values():
        float_out = out_dtype is not None and t.torch_dtype is not None
        total += math.prod(t.shape) * _NAME_BYTES[out_dtype] if float_out else t.nbytes
    return total

def check_disk_space(out_dir: str | os.PathLike, need_bytes: int) -> None:
    """Refuse before any work when the output's filesystem lacks room for the merge."""
    probe = Path(out_dir).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = int(need_bytes * DISK_MARGIN)
    if need > free:
        raise MergeError(f"not enough disk for the merge in {probe}: need ~{need / 1e9:.2f} GB, {free / 1e9:.2f} GB free")

def is_vlm_checkpoint(path: str | os.PathLike) -> bool:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return False
    cfg = json.loads(cfg_file.read_text())
    return "vision_config" in cfg or any("ConditionalGeneration" in a for a in cfg.get("architectures") or [])

@contextlib.contextmanager
def language_model_of(base: str | os.PathLike, vlm: str | os.PathLike, out_dir: str | os.PathLike) -> Iterator[Path]:
    """The VLM's language model as a causal-LM checkpoint while one intervention writes `out_dir`: `vlm` itself when it
    is one, else extracted by the pair loader (the base's class, vocabulary and tokenizer), streamed disk to disk in the
    VLM's stored dtype (about one shard in memory, never the vision tower) into a temporary folder beside `out_dir`,
    removed after. Nothing is kept: a command extracts once, as a step of its plan
    (`experiments.study.pair_steps.Extract`), and hands the extracted model to every intervention."""
    vlm = local_checkpoint(vlm)
    if not is_vlm_checkpoint(vlm):
        yield Path(vlm)
        return
    with scratch_dir(out_dir, "vlm-lm") as tmp:
        LOG.info("extracting the language model of %s for this intervention", vlm)
        plan = plan_extraction(vlm, base)
        target = tmp / "lm"
        write_language_model(plan, target, tokenizer=load_tokenizer(base), extra={"source": str(vlm), "extraction": plan.report.to_dict()})
        yield target


def check_pair(base: str | os.PathLike, vlm_lm: str | os.PathLike, root: str | os.PathLike | None = None) -> None:
    """Same architecture, head layout, tensor names and shapes, before mergekit runs: configs
    (heads split out) and then the on-disk tensors, with the pair loader's one-line error."""
    pairs = [(base, vlm_lm, ("base", "vlm"))] + ([(root, base, ("root", "base"))] if root is not None else [])
    for a, b, names in pairs:
        check_same_layout(load_config(a), load_config(b), names=names)
        check_same_layout({k: v[1] for k, v in tensor_layout(a).items()}, {k: v[1] for k, v in tensor_layout(b).items()}, names=names)

def write_result(out: Path, *, method: str, base, vlm, vlm_lm, root, seed, settings: dict, extra: dict | None = None,
                 config_file: str | None = None) -> None:
    """`intervention.json`: what was done to which checkpoints, with provenance; and the model card
    `README.md` (`model_card`), in place of mergekit's (titled with its temporary folder's name)."""
    models = {"base": str(base), "vlm": str(vlm), "vlm_lm": str(vlm_lm)} | ({"root": str(root)} if root else {})
    write_text_atomic(out / "README.md", model_card(method, models, settings, seed, config_file))
    write_json_atomic(out / RESULT_JSON, {
        "intervention": method,
        "settings": settings,
        "models": models,
        "provenance": provenance(
            seed=seed,
            fingerprints={k: model_fingerprint(v) for k, v in models.items() if k != "vlm" or v != str(vlm_lm)},
        ),
        **(extra or {}),
    })

def model_card(method: str, models: dict[str, str], settings: dict, seed, config_file: str | None = None) -> str:
    """A model card titled with the method and its inputs, listing the settings and where the VLM's
    language model came from (it may sit in the cache)."""
    name = lambda p: Path(str(p).rstrip("/")).name or str(p)  # noqa: E731
    shown = {k: v for k, v in settings.items() if v is not None}
    title = f"{method} of {name(models['base'])} and the language model of {name(models['vlm'])}"
    lines = ["---", yaml.safe_dump({"library_name": "transformers", "tags": ["sinkstudy", method]}, sort_keys=False).strip(), "---",
             f"# {title}", "",
             f"Made by sinkstudy's `{method}`" + (f" ({', '.join(f'{k} {v}' for k, v in shown.items())})" if shown else "")
             + f", seed {seed}, from:", "",
             f"- base LLM (config, tokenizer and chat template): `{models['base']}`",
             f"- VLM: `{models['vlm']}`"]
    if models["vlm_lm"] != models["vlm"]:
        lines.append(f"- the VLM's language model, extracted in the base's architecture: `{models['vlm_lm']}`")
    if models.get("root"):
        lines.append(f"- common ancestor (task vectors from it): `{models['root']}`")
    lines += ["", f"Settings, inputs' fingerprints and versions: `{RESULT_JSON}`"
              + (f"; the configuration it ran: `{config_file}`." if config_file else "."), ""]
    return "\n".join(lines)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

def side_files(path: str | os.PathLike) -> list[str]:
    """Names of a checkpoint's config, generation config, tokenizer and processor files: every
    file its fingerprint covers except the weights (and their index)."""
    return [f.name for f in fingerprinted_files(path)
            if not f.name.endswith(_WEIGHT_SUFFIXES) and not f.name.endswith(".index.json")]

def copy_side_files(src: str | os.PathLike, dst: Path) -> list[str]:
    """Copy the side files of checkpoint `src` into `dst`; returns their names."""
    names = side_files(src)
    for name in names:
        shutil.copy2(Path(src) / name, dst / name)
    return names

def replace_side_files(src: str | os.PathLike, dst: Path) -> list[str]:
    """Make `dst`'s side files exactly `src`'s (a root's tokenizer.model must not outlive it)."""
    for name in side_files(dst):
        os.unlink(dst / name)
    return copy_side_files(src, dst)

def check_finite_checkpoint(path: str | os.PathLike) -> None:
    """Refuse a checkpoint with NaN or infinite weights (read shard by shard, tensor by tensor)."""
    # lazy: loads torch, numpy
    import torch

    files = checkpoint_weights(path)
    for f in files.files:
        with safe_open(os.fspath(files.root / f), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise MergeError(f"the merge produced non-finite values in {name}; nothing was written")

def check_finite_model(model) -> None:
    """Refuse to save an in-memory model with NaN or infinite parameters or buffers."""
    # lazy: loads torch, numpy
    import torch

    for name, t in model.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise MergeError(f"the intervention produced non-finite values in {name}; nothing was written")
