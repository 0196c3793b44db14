"""`sinkstudy merge`, `sinkstudy mitigate`: weight interventions on a (base LLM, VLM) pair, each
measured by Sink Strength and strict evals against base and VLM LM (`Measure`, shared with
`sinkstudy merge-sweep` in experiments.cli.cmd_sweep)."""

from __future__ import annotations

import argparse
import contextlib
import functools
from pathlib import Path
from typing import Any

from experiments.cli import argtypes, options
from experiments.report.fmt import ci_text, finite_or_none, num
from experiments.cli.closing import Summary, cmd, existing
from sinkstudy.io import reusable_json

# CLI defaults for sparse methods: the paper's settings (TIES density 0.2, DARE drop 0.9).
PAPER_DENSITY = {"ties": 0.2, "dare_ties": 0.1, "dare_linear": 0.1}
MODEL_DIR = "model"  # OUT/model: the checkpoint and its card; the measurements sit beside it in OUT


def register(subparsers) -> None:
    from interventions.merge import MERGEKIT_METHODS
    from interventions.spectral import SPECTRAL_METHODS

    m = subparsers.add_parser("merge", help="merge base LLM and VLM LM (mergekit, TSV, STAR), then measure",
                              description="Merge the base LLM with the VLM's language model into OUT/model (the checkpoint "
                              "and its card), then measure it beside: OUT/measure.json, OUT/sink.json, OUT/eval.")
    pair_args(m)
    m.add_argument("--method", required=True, choices=MERGEKIT_METHODS + SPECTRAL_METHODS)
    m.add_argument("--weight", type=argtypes.finite_float,
                   help="linear/slerp: VLM share (default 0.5); task vectors: scale (default 1; STAR 1/T)")
    m.add_argument("--density", type=argtypes.finite_float, help="kept fraction of each delta (ties: default 0.2, dare_*: 0.1, breadcrumbs)")
    m.add_argument("--eta", type=argtypes.finite_float, help="STAR: percent of the nuclear norm kept (default 40)")
    m.add_argument("--select", help="only these tensors: attn, mlp and/or layers:FIRST-LAST (e.g. attn,layers:0-7)")
    m.add_argument("--root", help="common pretrained ancestor: task vectors (base-root, vlm-root) merged onto it "
                                  "(task-vector methods only; config and tokenizer still come from --base)")
    mergekit_args(m)
    _common_args(m, out="runs/interventions/<base>__<vlm>/<method and settings>")
    m.set_defaults(func=run_merge)

    t = subparsers.add_parser("mitigate", help="apply a registered mitigation (default head_restore), then measure",
                              description="Apply a mitigation to the pair into OUT/model, then measure it beside "
                              "(OUT/measure.json, OUT/sink.json, OUT/eval). --list works alone.")
    t.add_argument("name", nargs="?", default="head_restore", help="mitigation name (--list shows them)")
    t.add_argument("--list", action="store_true", help="list registered interventions and exit")
    pair_args(t)
    t.add_argument("--top-k", type=argtypes.positive_int, help="head_restore: number of heads to restore")
    t.add_argument("--calibration", default=None, metavar="SET|FILE", help="calibration texts for the sink maps (shipped set name or file)")
    argtypes.add_plugin_option(t)
    _common_args(t, out="runs/interventions/<base>__<vlm>/<name>", seed="any random draw of the mitigation, the evals and the bootstrap")
    t.set_defaults(func=run_mitigate)


pair_args, check_pair_args = options.add_pair_options, options.check_pair_options


def mergekit_args(p) -> None:
    g = p.add_argument_group("mergekit execution (mergekit methods; recorded in intervention.json, not part of the reuse key)")
    g.add_argument("--cuda", action="store_true", help="run mergekit's tensor math on the GPU (mergekit-yaml --cuda)")
    g.add_argument("--lazy-unpickle", action="store_true", help="mergekit's lazy loading of .bin (pickle) shards")
    g.add_argument("--low-cpu-memory", action="store_true", help="mergekit keeps results on the GPU until written (with --cuda)")


def mergekit_options(args) -> dict[str, bool]:
    """The flags of `mergekit_args` that are set, as `apply_intervention(mergekit_options=...)`."""
    return {k: True for k in ("cuda", "lazy_unpickle", "low_cpu_memory") if getattr(args, k, False)}


def measure_args(p, *, out: str, force: str = "replace an existing --out that holds a different result",
                 seed: str = "the merge (DARE, DELLA), the evals and the bootstrap") -> None:
    """How a pair command measures what it made: `sinkstudy eval`'s groups, the bootstrap, captions."""
    options.add_eval_options(p)
    options.add_model_options(p)
    options.add_output_options(p, out=out, force=force, cache=True)
    g = p.add_argument_group("measurement")
    options.add_bootstrap_options(g)
    g.add_argument("--captions", help="text file (one caption per line): text-only perplexity as a VL-side proxy")
    options.add_seed_option(p, seed)
    options.add_progress_options(p)


def _common_args(p, *, out: str, seed: str | None = None) -> None:
    measure_args(p, out=out, **({"seed": seed} if seed else {}))
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="extra parameter (repeatable)")
    p.add_argument("--eval", dest="eval", action=argparse.BooleanOptionalAction, default=True,
                   help="measure sink strength and strict evals after (default: on)")


def parse_params(items: list[str]) -> dict[str, Any]:
    import yaml

    from sinkstudy import SinkstudyError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SinkstudyError(f"bad --param {item!r}: use KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)  # numbers, booleans and lists typed as in YAML
    return out


# --------------------------------------------------------------------------- measuring

class Measure:
    """Sink Strength + strict evals of checkpoints against the base and the VLM LM (measured once).

    The references are measured on first use of `ref` (a sweep plans before it measures).
    All models are evaluated with the base's tokenizer (or --tokenizer; the extracted LM shares its
    vocabulary), so prompts are identical and results pair on doc_id. A measurement stored in a
    directory (`sink.json`, `eval/`) is reused only when its key matches: the measured model's
    fingerprint, the tokenizer, the settings and the code versions (`sink_key`; evals key themselves).
    """

    def __init__(self, base: str, vlm_lm: Path, args, ref_dir: Path | None):
        from experiments.cli.options import eval_kwargs, eval_tasks
        from interventions.pairs import load_tokenizer

        self.base, self.vlm_lm, self.args = base, vlm_lm, args
        self.eval = eval_kwargs(args)
        self.tasks = [t for t in eval_tasks(args).split(",") if t]
        self.captions = _read_captions(args.captions) if args.captions else None
        self.tokenizer = load_tokenizer(args.tokenizer or self.base)
        self.ref_dir = ref_dir

    @functools.cached_property
    def ref(self) -> dict[str, dict[str, Any]]:
        """The base's and the VLM LM's measurements, made (or reused from `ref_dir`) on first use."""
        return {name: self.measure(path, self.ref_dir / name if self.ref_dir else None)
                for name, path in (("base", self.base), ("vlm", self.vlm_lm))}

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """What every measurement depends on besides the measured model."""
        from evals.lmeval import eval_code_version, tokenizer_fingerprint
        from experiments.study.pair_steps import sink_code_version
        from sinkstudy.provenance import code_version

        a = self.args
        return {"tokenizer": tokenizer_fingerprint(self.tokenizer), "tasks": self.tasks, "eval": self.eval, "n_boot": a.n_boot,
                "confidence": a.confidence, "seed": a.seed, "dtype": self.dtype, "device": _device_type(a.device),
                "captions": digest(self.captions) if self.captions else None,
                "code": [sink_code_version(), eval_code_version(), code_version(__file__)]}

    @property
    def dtype(self) -> str:
        return self.args.dtype or "float32"

    def sink_key(self, path) -> str:
        from sinkstudy.provenance import model_fingerprint

        ident = self.identity
        return digest({"model": model_fingerprint(path), **{k: ident[k] for k in ("tokenizer", "captions", "code", "dtype", "device")}})

    def measure(self, path, out: Path | None) -> dict[str, Any]:
        """Sink Strength (+ caption NLL) and the eval run of one checkpoint; reused from `out` by key."""
        from evals.lmeval import run_eval
        from experiments.study.loaders import load_model
        from sinkstudy.io import write_json_atomic

        key = self.sink_key(path)
        cached = out / "sink.json" if out else None
        sink = None if self.args.no_cache else reusable_json(cached, key)
        if sink is None:
            sink = {**self._sink(path), "key": key}
            if cached:
                write_json_atomic(cached, sink)
        # force: the eval dir is a keyed measurement, replaced when the key changes (lm-eval results are cached by key)
        run = run_eval(path, self.tokenizer, tasks=self.tasks, out_dir=out / "eval" if out else None, force=True,
                       seed=self.args.seed, device=self.args.device, dtype=self.dtype, loader=load_model,
                       progress=not self.args.quiet, **self.eval)
        return {**sink, "run": run}

    def _sink(self, path) -> dict[str, Any]:
        import torch

        from evals.sink import sink_strength
        from interventions.pairs import load_causal_lm

        model, _ = load_causal_lm(path, dtype=getattr(torch, self.dtype), device=self.args.device or "cpu")
        s = sink_strength(model, self.tokenizer, progress=False)
        nll = caption_nll(model, self.tokenizer, self.captions) if self.captions else None
        return {"sink_strength": s.value, "sink_metric": s.metric, "caption_nll": nll, "captions": self.args.captions}

    def summary(self, point: dict[str, Any]) -> dict[str, Any]:
        """Scores and recovery with CI per task ("no loss to recover" where the pair lost nothing
        significant), GSM's strict-match beside its flexible-extract headline, and the VL-side proxies."""
        from evals.stats import headline_metrics, recovery

        b, v, run = self.ref["base"]["run"], self.ref["vlm"]["run"], point["run"]
        kw = {"n_boot": self.args.n_boot, "confidence": self.args.confidence, "seed": self.args.seed}
        tasks = {}
        for task in self.tasks:
            head, *others = reversed(headline_metrics(b, task))  # the paper's headline first, then strict-match
            tasks[task] = {**_recovery_row(recovery(b, v, run, task, head, **kw)),
                           "also": {m: _recovery_row(recovery(b, v, run, task, m, **kw)) for m in others}}
        return {
            "sink_strength": {"base": self.ref["base"]["sink_strength"], "vlm": self.ref["vlm"]["sink_strength"],
                              "value": point["sink_strength"], "metric": point["sink_metric"]},
            "tasks": tasks,
            "recovery": RECOVERY_CONVENTION,
            "caption_nll": {"vlm": self.ref["vlm"]["caption_nll"], "value": point["caption_nll"]} if self.captions else None,
        }


RECOVERY_CONVENTION = ("recovery = (intervened − VLM LM) / (base − VLM LM): 0 none, 1 back to base; stated only where the "
                       "base -> VLM LM loss is significant (its paired CI below 0, over at least 6 prompts), else the reason "
                       "(null): no loss to recover, loss not established, or too few prompts for any conclusion; \"below both "
                       "inputs\": the intervened model scored below the base and the VLM LM, each paired CI below 0")


def _recovery_row(r) -> dict[str, Any]:
    return {"metric": r.metric, "base": r.base, "vlm": r.vlm, "score": r.intervened, "recovery": finite_or_none(r.recovery),
            "ci": [finite_or_none(c) for c in r.ci], "status": r.status, "loss_points": r.loss_points,
            "loss_points_ci": list(r.loss_points_ci), "n": r.n, "vs_base_points": r.vs_base_points,
            "vs_base_ci": list(r.vs_base_ci or ()), "vs_vlm_points": r.vs_vlm_points, "vs_vlm_ci": list(r.vs_vlm_ci or ()),
            "below_both": r.below_both}


def digest(obj) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _device_type(device: str | None) -> str:
    """What of a device changes numbers: its type (cuda:0 and cuda:1 give the same results)."""
    return str(device or "cpu").split(":")[0]


def _read_captions(path: str) -> list[str]:
    from sinkstudy import SinkstudyError
    from sinkstudy.io import read_text

    p = Path(path)
    lines = [line.strip() for line in read_text(p, "captions file").splitlines() if line.strip()]
    if not lines:
        raise SinkstudyError(f"captions file {p} is empty")
    return lines


def caption_nll(model, tokenizer, captions: list[str]) -> float:
    """Mean per-token NLL of the captions as plain text (exp = text-only caption perplexity)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for text in captions:
            ids = tokenizer(text, return_tensors="pt").input_ids.to(model.device)
            if ids.shape[1] < 2:
                continue
            loss = model(input_ids=ids, labels=ids).loss
            total += loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / max(count, 1)


def weight_distance(path, vlm_lm, base) -> float:
    """||W - W_vlm|| / ||W_base - W_vlm|| over all float tensors: 0 at the VLM LM, 1 at the base."""
    import torch

    from interventions.spectral import _Tensors

    a, v, b = _Tensors(path), _Tensors(vlm_lm), _Tensors(base)
    num = den = 0.0
    for name in v.names():
        tv = v[name].double()
        num += (a[name].double() - tv).pow(2).sum().item()
        den += (b[name].double() - tv).pow(2).sum().item()
    return float(torch.tensor(num / den).sqrt()) if den else 0.0


def _print_summary(name: str, summary: dict[str, Any]) -> None:
    s = summary["sink_strength"]
    print(f"{name}: Sink Strength ({s['metric']}) {s['value']:.3f}  [base {s['base']:.3f}, VLM LM {s['vlm']:.3f}]")
    for task, t in summary["tasks"].items():
        for metric, row in [(t["metric"], t), *t.get("also", {}).items()]:
            print(f"  {task:<18} {metric:<32} {row['score']:.3f}  [base {row['base']:.3f}, VLM LM {row['vlm']:.3f}]  "
                  f"{recovery_text(row)}")
    print(f"  ({summary.get('recovery') or RECOVERY_CONVENTION})")


def recovery_text(row: dict[str, Any]) -> str:
    """"recovery 0.42 [0.10, 0.80]", or "no loss to recover (Δ VLM LM − base +1.2 points [−3.0, +5.0])"."""
    if row.get("status", "recovery") != "recovery":
        lo, hi = row["loss_points_ci"]
        text = f"{row['status']} (Δ VLM LM − base {row['loss_points']:+.1f} points [{lo:+.1f}, {hi:+.1f}])"
    else:
        text = f"recovery {num(row['recovery'], '.2f')} {ci_text(row['ci'], '.2f', '[n/a, n/a]')}"
    if row.get("below_both"):
        text += (f"; below both inputs (Δ vs base {row['vs_base_points']:+.1f} {ci_text(row['vs_base_ci'], '+.1f')}, "
                 f"vs VLM LM {row['vs_vlm_points']:+.1f} {ci_text(row['vs_vlm_ci'], '+.1f')} points)")
    return text


def _measure_and_write(out: Path, model: Path, vlm_lm: Path, args) -> dict[str, Any]:
    """Measure the checkpoint in `model`; write measure.json, sink.json and eval/ beside it in `out`."""
    from interventions.merge import local_checkpoint
    from sinkstudy.io import write_json_atomic
    from sinkstudy.provenance import provenance

    base = local_checkpoint(args.base)
    measure = Measure(base, vlm_lm, args, None)
    summary = measure.summary(measure.measure(model, out))
    summary["weight_distance_to_vlm"] = weight_distance(model, vlm_lm, base)
    write_json_atomic(out / "measure.json", {**summary, "provenance": provenance(seed=args.seed, tasks=measure.tasks, limit=args.limit)})
    _print_summary(out.name, summary)
    return summary


def check_measure_args(args) -> None:
    """The measurement's inputs (eval flags, task names, captions file), checked before any intervention runs."""
    from experiments.cli.options import check_hub_tasks, eval_kwargs, eval_tasks

    data_files = eval_kwargs(args)["data_files"]
    if getattr(args, "eval", True):
        check_hub_tasks(eval_tasks(args), data_files)  # unknown names first, then hub tasks with the hub unreachable
        if args.captions:
            _read_captions(args.captions)


def extracted_lm(base, vlm) -> tuple[Path, bool]:
    """(the VLM's language model on disk, whether it was extracted): a VLM checkpoint is extracted
    once, into the cache, and the command says where."""
    from interventions.merge import is_vlm_checkpoint, local_checkpoint, resolve_lm

    lm = resolve_lm(local_checkpoint(base), vlm)
    extracted = is_vlm_checkpoint(local_checkpoint(vlm))
    if extracted:
        print(f"the VLM's language model (in the base's architecture): {lm} (extracted once, reused by later runs)")
    return lm, extracted


# --------------------------------------------------------------------------- commands

def _check_models(*refs) -> None:
    """Every model argument resolves (local dir, or a hub id fetched once) before any output exists."""
    from interventions.merge import local_checkpoint

    for ref in refs:
        if ref is not None:
            local_checkpoint(ref)


def default_out(base: str, vlm: str, name: str, kind: str = "interventions") -> Path:
    """runs/<kind>/<base>__<vlm>/<name>: a different pair never lands in the same default dir."""
    from sinkstudy.io import slugify

    pair = f"{slugify(Path(str(base).rstrip('/')).name)}__{slugify(Path(str(vlm).rstrip('/')).name)}"
    return Path("runs") / kind / pair / slugify(name)


def run_merge(args) -> Summary | int:
    from interventions.registry import apply_intervention, execution_options, validate_intervention
    from sinkstudy.io import output_lock

    check_pair_args(args, "merge")
    params = parse_params(args.param)
    for key in ("weight", "density", "eta", "select", "root"):
        if getattr(args, key) is not None:
            params[key] = getattr(args, key)
    if args.method in ("linear", "slerp"):  # defaults only: a --param weight=... stays
        params.setdefault("weight", 0.5)
    if args.method not in ("linear", "slerp", "star", "tsv"):  # TSV: alpha defaults to 1
        params.setdefault("weight", 1.0)
    if args.method in PAPER_DENSITY:
        params.setdefault("density", PAPER_DENSITY[args.method])
    validate_intervention(args.method, params)
    execution = execution_options(args.method, mergekit_options(args))
    check_measure_args(args)
    _check_models(args.base, args.vlm, args.root)
    tag = "-".join([args.method] + [f"{k}{v}" for k, v in sorted(params.items()) if k in ("weight", "density", "eta", "select")])
    out = Path(args.out) if args.out else default_out(args.base, args.vlm, tag)
    vlm_lm, extracted = extracted_lm(args.base, args.vlm)
    with output_lock(out), _left_clean(out):  # the merge and its measurements
        model = apply_intervention(args.method, args.base, args.vlm, params, out / MODEL_DIR, seed=args.seed, force=args.force,
                                   mergekit_options=execution, progress=not args.quiet)
        print(f"wrote {model}")
        measured = _measure_and_write(out, model, vlm_lm, args) if args.eval else None
    return _summary("merge", f"{args.method} merge ({', '.join(f'{k} {v}' for k, v in sorted(params.items()))})", out, measured,
                    args, vlm_lm if extracted else None)


def run_mitigate(args) -> Summary | int:
    from interventions.registry import apply_intervention, list_interventions, validate_intervention
    from sinkstudy.io import output_lock

    argtypes.load_plugin_options(args)
    if args.list:
        for name, kind in list_interventions().items():
            print(f"  {name:<18} {kind}")
        return 0
    check_pair_args(args, "mitigate")
    params = parse_params(args.param)
    if args.top_k is not None:
        params["top_k"] = args.top_k
    if args.calibration:
        params["texts"] = args.calibration
    validate_intervention(args.name, params)
    check_measure_args(args)
    _check_models(args.base, args.vlm)
    out = Path(args.out) if args.out else default_out(args.base, args.vlm, args.name)
    vlm_lm, extracted = extracted_lm(args.base, args.vlm)
    with output_lock(out), _left_clean(out):
        model = apply_intervention(args.name, args.base, args.vlm, params, out / MODEL_DIR, seed=args.seed, force=args.force,
                                   progress=not args.quiet)
        print(f"wrote {model}")
        measured = _measure_and_write(out, model, vlm_lm, args) if args.eval else None
    return _summary("mitigate", f"mitigation {args.name}", out, measured, args, vlm_lm if extracted else None)


@contextlib.contextmanager
def _left_clean(out: Path):
    """A refused intervention leaves no empty OUT behind (OUT/model's lock made it)."""
    fresh = not out.exists()
    try:
        yield
    except Exception:
        if fresh and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def _summary(command: str, what: str, out: Path, measured: dict[str, Any] | None, args, extracted: Path | None):
    """The closing summary of merge / mitigate: Sink Strength and each task's recovery with its CI
    (or "no loss to recover"), every headline metric named; the extracted VLM LM among the outputs."""
    if measured is None:
        result = f"{what}: written, not measured (--no-eval)"
    else:
        s = measured["sink_strength"]
        recs = [f"{task} {metric.removesuffix(',none')} {recovery_text(row)}" for task, t in measured["tasks"].items()
                for metric, row in [(t["metric"], t), *t.get("also", {}).items()]]
        result = (f"{what}: Sink Strength {s['value']:.3f} (base {s['base']:.3f}, VLM LM {s['vlm']:.3f}); " + "; ".join(recs)
                  + " (recovery = (merged − VLM LM) / (base − VLM LM): 0 none, 1 back to base)")
    model = out / MODEL_DIR
    nxt = [cmd("sinkstudy", "eval", model)] if measured is None else []
    nxt.append(cmd("sinkstudy", "merge-sweep", "--base", args.base, "--vlm", args.vlm) if command == "merge"
               else cmd("sinkstudy", "mitigate", "--list"))
    return Summary(command, result, outputs=existing(model, out / "measure.json", out / "eval", extracted), next=nxt)
