"""Weight merging of a base LLM and a VLM's language model through mergekit.

Every merge runs `mergekit.merge.run_merge` on two same-architecture checkpoints on disk and
writes, beside the merged weights, the exact mergekit YAML it ran (`mergekit_config.yml`, with the
equivalent `mergekit-yaml` command in its header) and `intervention.json` (settings + provenance).

Conventions shared with `interventions.spectral` (TSV, STAR):
- `base` is the base LLM, `vlm` the VLM's extracted LM (a VLM checkpoint is extracted first, into a
  cache). `root`, optional, is their common pretrained ancestor: when given, task-vector methods
  merge both task vectors (base - root, vlm - root) onto it; otherwise the one task vector is
  vlm - base, applied to the base.
- `weight`: linear / slerp: the VLM's share (0 = base, 1 = VLM); task-vector methods: the scale
  of each task vector (lambda). `density`: the fraction of each delta kept (TIES, DARE, breadcrumbs).
- `select`: restrict the merge to some tensors (`Selection`); everything else stays the base's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import WeightFiles, local_checkpoint, weight_files
from sinkstudy.io import cache_root

LOG = logging.getLogger(__name__)

# mergekit 0.1.5 names (mergekit/merge_methods/registry.py).
MERGEKIT_METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties")
_SPARSE_METHODS = frozenset({"ties", "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties"})
# Extra mergekit parameters a user may pass through (`--param key=value`).
PASSTHROUGH_PARAMS = {"gamma", "lambda", "normalize", "rescale", "int8_mask"}
# Numeric pass-through parameters and their ranges (the others are booleans).
_PASSTHROUGH_RANGES = {"gamma": {"lo": 0.0, "hi": 1.0, "hi_open": True}, "lambda": {"lo": 0.0, "hi": 10.0}}

_NAME_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DISK_MARGIN = 1.10  # shard padding, tokenizer and temp files on top of the raw tensor bytes
RESULT_JSON = "intervention.json"
MERGEKIT_YAML = "mergekit_config.yml"


class MergeError(SinkstudyError):
    pass


# --------------------------------------------------------------------------- selection

_MODULE_FILTERS = {"attn": "self_attn", "mlp": "mlp"}


@dataclass(frozen=True)
class Selection:
    """Which tensors a merge touches: modules (attn / mlp) and/or decoder layers [first, last].

    Parsed from strings such as "attn", "mlp", "layers:0-3", "attn,layers:0-3". Expressed as
    mergekit `filter` substrings ("self_attn", "layers.2.", "layers.2.self_attn"), matched the way
    mergekit matches them (substring of the tensor name), so our own code selects the same tensors.
    """

    modules: tuple[str, ...] = ()
    layers: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str | None) -> "Selection | None":
        if not text:
            return None
        modules: list[str] = []
        layers = None
        for part in (p.strip() for p in text.split(",") if p.strip()):
            m = re.fullmatch(r"layers:(\d+)(?:-(\d+))?", part)
            if m:
                first, last = int(m.group(1)), int(m.group(2) or m.group(1))
                if last < first:
                    raise MergeError(f"bad layer range {part!r}: last layer before first")
                layers = (first, last)
            elif part in _MODULE_FILTERS:
                modules.append(part)
            else:
                raise MergeError(f"bad selection {part!r}: use attn, mlp and/or layers:FIRST-LAST")
        return cls(tuple(modules), layers)

    def filters(self) -> list[str]:
        mods = [_MODULE_FILTERS[m] for m in self.modules]
        if self.layers is None:
            return mods
        layer_keys = [f"layers.{i}." for i in range(self.layers[0], self.layers[1] + 1)]
        return [k + m for k in layer_keys for m in mods] if mods else layer_keys

    def matches(self, tensor_name: str) -> bool:
        return any(f in tensor_name for f in self.filters())

    def __str__(self) -> str:
        parts = list(self.modules) + ([f"layers:{self.layers[0]}-{self.layers[1]}"] if self.layers else [])
        return ",".join(parts)


def _selective(value: float, outside: float, selection: Selection | None) -> Any:
    """A mergekit parameter that is `value` on selected tensors and `outside` elsewhere."""
    if selection is None:
        return value
    return [{"filter": f, "value": value} for f in selection.filters()] + [{"value": outside}]


# --------------------------------------------------------------------------- checkpoints on disk

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
    import math

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


# Bump when resolve_lm's output changes for the same inputs (2: streamed, in the VLM's stored dtype).
_LM_CACHE_FORMAT = 2


def resolve_lm(base: str | os.PathLike, vlm: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The VLM's language model as a causal-LM checkpoint on disk: a VLM checkpoint is extracted
    once by the pair loader (base's class, vocabulary and tokenizer), streamed disk to disk in the
    VLM's stored dtype (about one shard in memory, never the vision tower), into a cache keyed by
    both models' fingerprints and the pair loader's code version."""
    import hashlib

    from sinkstudy.provenance import code_version, model_fingerprint

    vlm = local_checkpoint(vlm)
    if not is_vlm_checkpoint(vlm):
        return vlm
    extracted = Path(cache_dir) if cache_dir else cache_root() / "vlm_lm"
    key = "|".join([model_fingerprint(vlm), model_fingerprint(base), code_version(Path(__file__).parent / "pairs"),
                    f"format:{_LM_CACHE_FORMAT}"])
    target = extracted / hashlib.sha256(key.encode()).hexdigest()[:32]
    if not (target / "config.json").is_file():
        from interventions.pairs import load_tokenizer, plan_extraction, write_language_model

        LOG.info("extracting the language model of %s into %s", vlm, target)
        plan = plan_extraction(vlm, base)
        write_language_model(plan, target, tokenizer=load_tokenizer(base), force=True,
                             extra={"source": str(vlm), "extraction": plan.report.to_dict()})
    return target


def check_pair(base: str | os.PathLike, vlm_lm: str | os.PathLike, root: str | os.PathLike | None = None) -> None:
    """Same architecture, head layout, tensor names and shapes, before mergekit runs: configs
    (heads split out) and then the on-disk tensors, with the pair loader's one-line error."""
    from interventions.pairs import check_same_layout
    from interventions.pairs.resolve import load_config

    pairs = [(base, vlm_lm, ("base", "vlm"))] + ([(root, base, ("root", "base"))] if root is not None else [])
    for a, b, names in pairs:
        check_same_layout(load_config(a), load_config(b), names=names)
        check_same_layout({k: v[1] for k, v in tensor_layout(a).items()}, {k: v[1] for k, v in tensor_layout(b).items()}, names=names)


# --------------------------------------------------------------------------- mergekit config

def check_number(where: str, value, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False, integer: bool = False) -> None:
    """A setting must be a finite real (an int with `integer`) inside [lo, hi] (open ends as given)."""
    import math

    kind = "an integer" if integer else "a finite number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value):
        raise MergeError(f"{where} must be {kind}, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)) or hi is not None and (value > hi or (hi_open and value == hi)):
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise MergeError(f"{where} must be in {left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}, got {value!r}")


def takes_root(method: str) -> bool:
    """Whether `method` merges task vectors from a common ancestor (`root`): not linear or slerp."""
    return method not in ("linear", "slerp")


def validate_merge_args(method: str, weight: float, density: float | None, select, params: dict | None,
                        root=None) -> Selection | None:
    """Method, ranges and parameter names; returns the parsed selection. Cheap: runs first."""
    if method not in MERGEKIT_METHODS:
        raise MergeError(f"unknown mergekit method {method!r}; choose from {', '.join(MERGEKIT_METHODS)}")
    check_number(f"{method} weight", weight, lo=0.0, hi=1.0 if method in ("linear", "slerp") else 10.0)
    if density is not None:
        if method not in _SPARSE_METHODS:
            raise MergeError(f"{method} has no density parameter")
        check_number("density", density, lo=0.0, hi=1.0, lo_open=True)
    if root is not None and not takes_root(method):
        raise MergeError(f"{method} interpolates base and VLM directly and takes no --root; use a task-vector method "
                         "(task_arithmetic, ties, dare_*, breadcrumbs*, tsv, star) with a root")
    params = dict(params or {})
    unknown = set(params) - PASSTHROUGH_PARAMS
    if unknown:
        raise MergeError(f"unknown merge parameter(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(PASSTHROUGH_PARAMS))}")
    for key, value in params.items():
        if key in _PASSTHROUGH_RANGES:
            check_number(f"{method} {key}", value, **_PASSTHROUGH_RANGES[key])
        elif not isinstance(value, bool):
            raise MergeError(f"{method} {key} must be true or false, got {value!r}")
    return Selection.parse(select) if isinstance(select, str) or select is None else select


def merge_config(
    method: str,
    base: str | os.PathLike,
    vlm: str | os.PathLike,
    *,
    weight: float = 0.5,
    density: float | None = None,
    select: Selection | str | None = None,
    root: str | os.PathLike | None = None,
    params: dict[str, Any] | None = None,
    out_dtype: str | None = None,
) -> dict[str, Any]:
    """The mergekit configuration (a plain dict, as in a mergekit YAML) for one merge.

    Paths are made absolute so the YAML runs from anywhere. Math is float32; the output keeps
    `out_dtype` (default: the base's stored dtype). Unselected tensors get the VLM weight 0 (and
    density 1), which leaves them exactly the base's.
    """
    selection = validate_merge_args(method, weight, density, select, params, root)
    params = dict(params or {})
    base_s, vlm_s = str(Path(base).resolve()), str(Path(vlm).resolve())
    cfg: dict[str, Any] = {"merge_method": method, "dtype": "float32", "out_dtype": out_dtype or checkpoint_dtype(base)}

    if method == "linear":
        cfg["base_model"] = base_s  # linear ignores it in the arithmetic; it fixes the config/tokenizer donor
        cfg["models"] = [
            {"model": base_s, "parameters": {"weight": _selective(1.0 - weight, 1.0, selection)}},
            {"model": vlm_s, "parameters": {"weight": _selective(weight, 0.0, selection)}},
        ]
    elif method == "slerp":
        cfg["base_model"] = base_s
        cfg["models"] = [{"model": base_s}, {"model": vlm_s}]
        cfg["parameters"] = {"t": _selective(weight, 0.0, selection)}
    else:
        def entry(model: str, inside: float, outside: float) -> dict[str, Any]:
            p: dict[str, Any] = {"weight": _selective(inside, outside, selection)}
            if method in _SPARSE_METHODS:
                p["density"] = _selective(density if density is not None else 1.0, 1.0, selection)
            return {"model": model, "parameters": p}

        if root is None:
            cfg["base_model"] = base_s
            cfg["models"] = [entry(vlm_s, weight, 0.0)]
        else:
            cfg["base_model"] = str(Path(root).resolve())
            cfg["models"] = [entry(base_s, weight, 1.0), entry(vlm_s, weight, 0.0)]
        # ties/della default to normalize=true, which cancels the weight of a single task vector
        # (NOTES.md): weights must mean what they say across a sweep.
        cfg["parameters"] = {"normalize": False}
    if params:
        cfg.setdefault("parameters", {}).update(params)
    # mergekit copies config and tokenizer from base_model (without one, from the first element of
    # a set: which model depends on the hash seed). No tokenizer_source: it would rebuild the
    # embeddings to len(tokenizer) (NOTES.md). With a root, run_mergekit_merge puts the base's
    # config and tokenizer back after mergekit (the root has no chat template).
    return cfg


def config_yaml(cfg: dict[str, Any], seed: int | None, base: str | os.PathLike | None = None) -> str:
    """The YAML written beside a merge: runnable as is with `mergekit-yaml`. With a root, the
    header says which files to copy from the base LLM afterwards (what sinkstudy did)."""
    import yaml

    seed_flag = f" --random-seed {seed}" if seed is not None else ""
    header = (
        "# Written by sinkstudy; reproduce these weights with:\n"
        f"#   mergekit-yaml {MERGEKIT_YAML} OUT_DIR{seed_flag}\n"
    )
    if base is not None and Path(cfg["base_model"]) != Path(base).resolve():
        header += (f"# base_model is the common root; sinkstudy then replaced the root's config.json,\n"
                   f"# generation_config.json and tokenizer files by the base LLM's ({Path(base).resolve()}):\n"
                   f"#   see `files` in {RESULT_JSON}\n")
    else:
        header += "# config.json, generation_config.json and the tokenizer come from base_model (the base LLM).\n"
    return header + yaml.safe_dump(cfg, sort_keys=False)


# --------------------------------------------------------------------------- running

def run_mergekit_merge(
    method: str,
    base: str | os.PathLike,
    vlm: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    weight: float = 0.5,
    density: float | None = None,
    select: Selection | str | None = None,
    root: str | os.PathLike | None = None,
    params: dict[str, Any] | None = None,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
    request: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> Path:
    """Merge base and the VLM's LM with mergekit into `out_dir`; returns `out_dir`.

    All checks (method, parameters, execution options, pair layout, disk space, existing output)
    run before mergekit; the output is scanned for non-finite tensors before it is moved into place.
    `request` (the registry's identity of this intervention) is stored in `intervention.json`.
    `options` go to mergekit's `MergeOptions` as `mergekit-yaml` flags would: cuda, lazy_unpickle,
    low_cpu_memory (recorded beside the request; `cuda` also changes what it computes, and the
    registry's request holds it).
    """
    from sinkstudy.io import atomic_output_dir, check_output_dir

    validate_merge_args(method, weight, density, select, params, root)
    options = check_mergekit_options(options)
    out_dir = check_output_dir(out_dir, force)
    base_in, vlm_in = base, vlm
    base, root = local_checkpoint(base), (local_checkpoint(root) if root is not None else None)
    vlm_lm = resolve_lm(base, vlm, cache_dir)
    check_pair(base, vlm_lm, root)
    cfg = merge_config(method, base, vlm_lm, weight=weight, density=density, select=select, root=root, params=params)
    check_disk_space(out_dir, estimate_output_bytes(base, cfg["out_dtype"]))
    text = config_yaml(cfg, seed, base)
    with atomic_output_dir(out_dir, force) as tmp:
        _run_mergekit(cfg, text, tmp, seed, progress, options)
        if root is None:
            files = {f: "base LLM (mergekit base_model)" for f in side_files(tmp)}
        else:  # mergekit took them from the root
            files = {f: "base LLM (copied after mergekit)" for f in replace_side_files(base, tmp)}
        check_finite_checkpoint(tmp)
        write_result(tmp, method=method, base=base_in, vlm=vlm_in, vlm_lm=vlm_lm, root=root, seed=seed,
                     settings={"weight": weight, "density": density, "select": str(select or "") or None, **(params or {})},
                     extra={"mergekit_config": cfg, "mergekit_options": options, "files": {"weights": "mergekit", **files},
                            **({"request": request} if request else {})})
    return out_dir


_EXECUTION_OPTIONS = ("cuda", "lazy_unpickle", "low_cpu_memory")


def check_mergekit_options(options: Mapping[str, Any] | None) -> dict[str, bool]:
    """All execution options, known ones checked before any work; --cuda without a GPU is one line."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(_EXECUTION_OPTIONS))
    if unknown:
        raise MergeError(f"unknown mergekit option(s) {', '.join(unknown)}; known: {', '.join(_EXECUTION_OPTIONS)}")
    out = {k: bool(options.get(k, False)) for k in _EXECUTION_OPTIONS}
    if out["cuda"]:
        import torch

        if not torch.cuda.is_available():
            raise MergeError("--cuda: no CUDA device is available here; merge on the CPU (drop --cuda)")
    if out["low_cpu_memory"] and not out["cuda"]:
        raise MergeError("--low-cpu-memory keeps results on the GPU: it needs --cuda")
    return out


def _run_mergekit(cfg: dict[str, Any], yaml_text: str, out: Path, seed: int | None, progress: bool,
                  options: dict[str, bool]) -> None:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    config = MergeConfiguration.model_validate(cfg)
    options = MergeOptions(copy_tokenizer=True, random_seed=seed, quiet=not progress, **options)
    try:
        run_merge(config, str(out), options=options, config_source=yaml_text)
    except (RuntimeError, ValueError) as exc:  # mergekit's own errors become one line
        raise MergeError(f"mergekit {cfg['merge_method']} failed: {str(exc).splitlines()[0]}") from exc


def write_result(out: Path, *, method: str, base, vlm, vlm_lm, root, seed, settings: dict, extra: dict | None = None) -> None:
    """`intervention.json`: what was done to which checkpoints, with provenance; and the model card
    `README.md` (`model_card`), in place of mergekit's (titled with its temporary folder's name)."""
    from sinkstudy.io import write_json_atomic, write_text_atomic
    from sinkstudy.provenance import model_fingerprint, provenance

    models = {"base": str(base), "vlm": str(vlm), "vlm_lm": str(vlm_lm)} | ({"root": str(root)} if root else {})
    write_text_atomic(out / "README.md", model_card(method, models, settings, seed))
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


def model_card(method: str, models: dict[str, str], settings: dict, seed) -> str:
    """A model card titled with the method and its inputs, listing the settings and where the VLM's
    language model came from (it may sit in the cache)."""
    import yaml

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
              + (f"; mergekit's configuration: `{MERGEKIT_YAML}`." if method in MERGEKIT_METHODS else "."), ""]
    return "\n".join(lines)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def side_files(path: str | os.PathLike) -> list[str]:
    """Names of a checkpoint's config, generation config, tokenizer and processor files: every
    file its fingerprint covers except the weights (and their index)."""
    from sinkstudy.provenance import fingerprinted_files

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
    import torch
    from safetensors import safe_open

    files = checkpoint_weights(path)
    for f in files.files:
        with safe_open(os.fspath(files.root / f), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise MergeError(f"the merge produced non-finite values in {name}; nothing was written")


def check_finite_model(model) -> None:
    """Refuse to save an in-memory model with NaN or infinite parameters or buffers."""
    import torch

    for name, t in model.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise MergeError(f"the intervention produced non-finite values in {name}; nothing was written")
