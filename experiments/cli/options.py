"""The option groups the commands share, each defined once: model loading, evals (lm-eval and its
protocol), output and caching, progress. A command that does one of these things takes the group,
so a flag has one name, one meaning and one default on every command (tests/test_cli_options.py
walks every parser to keep it so). Where a default depends on the command (`run` keeps its config's
tasks and device), the flag's default is None and the command's help says what None means; `--device`
is the CPU wherever it is not given. Commands import this module at start-up: it imports nothing
heavy, so `--help` stays instant.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from pathlib import Path

import yaml

from evals.protocol import BACKENDS, DEFAULT_CONFIDENCE, DEFAULT_N_BOOT, EvalProtocol, check_backend
from evals.proxies import read_captions
from evals.task_names import check_task_names
from evals.tasks import SHIPPED_TASKS, parse_data_files
from experiments.cli import argtypes
from experiments.study.pair_steps import Loading, Measurement
from interventions.adapt.config import VisionSpec
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import looks_like_path
from sinkstudy.hub import hub_unreachable
from sinkstudy.io import slugify
from sinkstudy.numerics import ENV
from sinkstudy.real_models import REGISTRY

DTYPES = ("float32", "bfloat16", "float16")
PROTOCOL = EvalProtocol()  # the defaults every evaluating command and study shares (their one definition)
DEFAULT_TASKS = ",".join(PROTOCOL.tasks)  # a run without --tasks never needs the hub; the paper's hub tasks are opt-in
PAPER_TASKS = "ifeval,gsm8k_cot,bbh_cot_fewshot"


# --------------------------------------------------------------------------- model loading

def add_model_options(p, *, device: str | None = "cpu", dtype: str = "float32", tokenizer: bool = True) -> None:
    """--dtype, --device (device=None: the command takes none) and --tokenizer: how the command loads
    the models it runs. `device` / `dtype` word the help: what the command does when the flag is left out."""
    g = p.add_argument_group("model loading")
    g.add_argument("--dtype", choices=DTYPES, default=None, help=f"dtype the models are loaded in (default: {dtype})")
    if device is not None:
        g.add_argument("--device", default=None, metavar="DEVICE", help=f"torch device the models run on, e.g. cuda (default: {device})")
    if tokenizer:
        g.add_argument("--tokenizer", default=None, metavar="ID|PATH", help="tokenizer path or hub id when it is not beside the model")


def check_device(device: str | None) -> None:
    """--device names a device this torch can run on: one line before any work otherwise (torch's own errors are
    an assertion deep in CUDA's initialisation, or a list of every device type it knows)."""
    if device is None:
        return
    # lazy: loads torch, numpy
    import torch

    try:
        where = torch.device(device)
    except (RuntimeError, ValueError):
        raise SinkstudyError(f"--device {device}: not a device; use cpu, cuda, cuda:N or mps") from None
    if where.type == "cuda":
        if torch.version.cuda is None:
            raise SinkstudyError(f"--device {device}: this torch ({torch.__version__}) is built without CUDA; install a CUDA build "
                                 "(make clean-venv, then make install TORCH_SPEC='torch>=2.13') or drop --device to run on the CPU")
        if not torch.cuda.is_available() or (where.index or 0) >= torch.cuda.device_count():
            raise SinkstudyError(f"--device {device}: no such CUDA device is visible here ({torch.cuda.device_count()} found); "
                                 "drop --device to run on the CPU")
    elif where.type == "mps" and not torch.backends.mps.is_available():
        raise SinkstudyError(f"--device {device}: MPS is not available here; drop --device to run on the CPU")
    elif where.type not in ("cpu", "cuda", "mps"):
        raise SinkstudyError(f"--device {device}: sinkstudy runs on cpu, cuda or mps")


# --------------------------------------------------------------------------- evals

def add_task_option(p, *, default: str = f"{DEFAULT_TASKS}, offline; hub tasks are opt-in") -> None:
    p.add_argument("--tasks", default=None, metavar="TASK,...", help=f"comma-separated lm-eval tasks (default: {default})")


def add_limit_option(p) -> None:
    p.add_argument("--limit", type=argtypes.limit, default=None, metavar="N",
                   help="evaluate only the first N prompts of each task (a fraction < 1: that share)")


def add_eval_options(p) -> None:
    """How an evaluating command runs lm-eval: the flags of `sinkstudy eval`, on every command that
    evaluates (`eval_protocol` reads them back); a flag left out keeps the protocol's default."""
    g = p.add_argument_group("evals (lm-eval)")
    add_task_option(g)
    add_limit_option(g)
    g.add_argument("--max-gen-toks", type=argtypes.int_at_least(0), default=None, metavar="N",
                   help=f"generation cap per prompt (default {PROTOCOL.max_gen_toks}; 0 keeps each task's own)")
    g.add_argument("--batch-size", type=argtypes.batch_size, default=None, metavar="N|auto",
                   help=f"eval batch size: an integer, or auto / auto:N (lm-eval detects it; default {PROTOCOL.batch_size})")
    g.add_argument("--no-chat-template", action="store_true", help="prompt without the tokenizer's chat template")
    g.add_argument("--data", dest="eval_data", action="append", default=None, metavar="TASK=FILE",
                   help="a task's prompts from this local jsonl instead of its default data (repeatable)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help=f"default {PROTOCOL.backend}; hf-continuous: lm-eval's HF backend with continuous-batching greedy "
                        "generation (docs/evals.md); vllm: lm-eval's vLLM backend (GPU)")
    g.add_argument("--backend-args", default=None, metavar="JSON|K=V,...",
                   help="backend constructor arguments as a JSON object or K=V pairs (quote values with commas), "
                        "e.g. tensor_parallel_size=2,data_parallel_size=4,gpu_memory_utilization=0.85")
    add_protocol_options(p)


def add_protocol_options(p) -> None:
    """The eval protocol's knobs (`evals.protocol` says where each goes)."""
    g = p.add_argument_group("eval protocol (handed to lm-eval)")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON|K=V,...",
                   help="chat template variables, e.g. '{\"enable_thinking\": false}' for Qwen3 (the paper's protocol)")
    g.add_argument("--system-instruction", default=None, metavar="TEXT", help="a system message before every prompt")
    g.add_argument("--gen-kwargs", default=None, metavar="JSON|K=V,...",
                   help="generation settings over each task's own, e.g. temperature=0,do_sample=false,until=[\"</s>\"]")
    g.add_argument("--num-fewshot", type=argtypes.int_at_least(0), default=None, metavar="N",
                   help="override the tasks' few-shot count (the paper: 0)")
    g.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="let tasks that execute model-written code run (MBPP)")


# The flag of each protocol field, for one-line errors.
_FLAGS = {"data_files": "--data", "apply_chat_template": "--no-chat-template"}


def eval_protocol(args) -> "EvalProtocol":
    """The protocol the eval flags (`add_eval_options`) ask for, over the defaults, checked (one line on bad input,
    naming the flag); the backend's package must be installed."""
    flags = {"tasks": args.tasks, "limit": args.limit, "max_gen_toks": args.max_gen_toks, "batch_size": args.batch_size,
             "apply_chat_template": False if args.no_chat_template else None, "data_files": args.eval_data,
             "backend": args.backend, "backend_args": args.backend_args,
             **{k: getattr(args, k, None) for k in ("chat_template_kwargs", "system_instruction", "gen_kwargs", "num_fewshot")},
             "confirm_run_unsafe_code": True if getattr(args, "confirm_run_unsafe_code", False) else None}
    protocol = EvalProtocol.build({k: v for k, v in flags.items() if v is not None},
                                  name=lambda f: _FLAGS.get(f, "--" + f.replace("_", "-")))
    check_backend(protocol.backend)
    _check_data_files(protocol.data_files)
    return protocol


def _check_data_files(data_files) -> None:
    """--data files are the user's: each must exist before any work (a study's own are checked by its config)."""
    parse_data_files(dict(data_files) or None)


def sharing(args) -> dict:
    """Whether a command reuses steps other runs finished, and where they are noted, as `--no-cache` and `--cache-dir`
    (`add_output_options(cache=True)`) say: `experiments.study.runner.run_plan`'s share and store_root."""
    return {"share": not args.no_cache, "store_root": args.cache_dir}


def check_hub_tasks(tasks, data_files=None) -> None:
    """Tasks whose data comes from the hub (lm-eval's own, without a local data file) fail at once,
    in one line, when the hub is unreachable (`sinkstudy.hub`), not after the libraries' retries.
    Unknown names are refused first, as such. `data_files` ({task: file}) only names the tasks with local
    data: a study's may be written by its own steps, and are read when the step that evaluates runs."""
    local = set(dict(data_files or {}))
    remote = [t for t in check_task_names(tasks) if t not in SHIPPED_TASKS and t not in local]
    if remote:
        reason = hub_unreachable()
        if reason:
            raise SinkstudyError(f"task(s) {', '.join(remote)} load their data from the Hugging Face hub, which is unreachable "
                                 f"({reason}); use the shipped offline tasks ({', '.join(SHIPPED_TASKS)}) "
                                 "or give a local file with --data TASK=FILE")


# --------------------------------------------------------------------------- a (base LLM, VLM) pair

def model_forms() -> str:
    """The forms a model argument takes on every command, for help texts."""
    return f"hub id, local path, .gguf file or a real LLM's name ({', '.join(REGISTRY)})"


MODEL_ARGS = ("model", "base", "vlm", "native", "root")  # where a command takes a model (positional or --flag)


def check_model_names(args) -> None:
    """A model argument that is no local path, no .gguf and no hub id (ORG/NAME) but close to a real LLM's name is a
    typo of that name: one line saying which, before the hub is asked for it."""
    for dest in MODEL_ARGS:
        value = getattr(args, dest, None)
        if not isinstance(value, str) or "/" in value or value in REGISTRY or value.endswith(".gguf") or os.path.exists(value):
            continue
        close = [n for n in REGISTRY if n.startswith(value)] or difflib.get_close_matches(value, list(REGISTRY), n=1, cutoff=0.6)
        if close:
            raise SinkstudyError(f"{value!r} is no local path and no real LLM's name: did you mean {close[0]}? "
                                 f"(real LLMs: {', '.join(REGISTRY)}; a hub id is ORG/NAME)")


def add_pair_options(p) -> None:
    """--base / --vlm: every pair command needs both; checked after parsing (`check_pair_options`), so
    that a listing (`mitigate --list`) works alone."""
    p.add_argument("--base", default=None, help=f"base LLM: {model_forms()} (required)")
    p.add_argument("--vlm", default=None, help="VLM, or its already extracted language model: local path or hub id (required)")


def check_pair_options(args, command: str) -> None:
    missing = [f"--{k}" for k in ("base", "vlm") if not getattr(args, k)]
    if missing:
        raise SinkstudyError(f"{command} needs {' and '.join(missing)}")


def pair_out(base: str, vlm: str, name: str, kind: str = "interventions") -> Path:
    """runs/<kind>/<base>__<vlm>/<name> (each model as `model_label` names it): a different pair never lands in the
    same default dir."""
    return Path("runs") / kind / f"{model_label(base)}__{model_label(vlm)}" / slugify(name)


def add_mergekit_options(p) -> None:
    g = p.add_argument_group("mergekit execution (mergekit methods; recorded in intervention.json; only --cuda changes the numbers)")
    g.add_argument("--cuda", action="store_true", help="run mergekit's tensor math on the GPU (mergekit-yaml --cuda)")
    g.add_argument("--lazy-unpickle", action="store_true", help="mergekit's lazy loading of .bin (pickle) shards")
    g.add_argument("--low-cpu-memory", action="store_true", help="mergekit keeps results on the GPU until written (with --cuda)")


def mergekit_options(args) -> dict[str, bool]:
    """The flags of `add_mergekit_options` that are set."""
    return {k: True for k in ("cuda", "lazy_unpickle", "low_cpu_memory") if getattr(args, k, False)}


def add_measure_options(p, *, out: str, seed: str = "the merge (DARE, DELLA), the evals and the bootstrap") -> None:
    """How a pair command measures what it made: `sinkstudy eval`'s groups, the bootstrap, captions."""
    add_eval_options(p)
    add_model_options(p)
    add_output_options(p, out=out, cache=True)
    g = p.add_argument_group("measurement")
    add_bootstrap_options(g)
    g.add_argument("--captions", help="text file (one caption per line): text-only perplexity as a VL-side proxy")
    add_seed_option(p, seed)
    add_compute_options(p)
    add_progress_options(p)


def measurement(args):
    """How the pair command measures (`experiments.study.pair_steps.Measurement`), every input checked before any
    work: the eval flags, task names (hub tasks with the hub unreachable refused), the captions file."""
    protocol = eval_protocol(args)
    if getattr(args, "eval", True):
        check_hub_tasks(protocol.tasks, protocol.data_files)
        if args.captions:
            read_captions(args.captions)
    return Measurement(protocol=protocol, seed=args.seed, loading=Loading(args.dtype or "float32", args.device))


def parse_params(items: list[str]) -> dict:
    """--param KEY=VALUE items, each VALUE typed as in YAML (numbers, booleans, lists)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SinkstudyError(f"bad --param {item!r}: use KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


# --------------------------------------------------------------------------- training (adapt, qknorm)

def add_train_steps_option(p) -> None:
    p.add_argument("--train-steps", action="append", default=[], metavar="[STAGE=]N",
                   help="optimizer steps of training (without STAGE=: every stage); repeatable")


def add_train_data_option(p, help: str) -> None:
    p.add_argument("--train-data", action="append", default=[], metavar="[STAGE=]SPEC",
                   help=f"{help}: digits | FILE.json[l] | json:FILE[@IMAGES] | hf:NAME[:SPLIT][@IMAGES]; without STAGE= every stage; repeatable")


def parse_stage_values(values: list[str], stage_names: list[str], what: str) -> dict[str, list[str]]:
    """[STAGE=]VALUE items -> {stage: [values]}; an item without STAGE= goes to every stage."""
    out: dict[str, list[str]] = {}
    for item in values:
        stage, sep, value = item.partition("=")
        if sep and stage in stage_names:
            out.setdefault(stage, []).append(value)
        elif sep and not stage.startswith(("hf:", "json:")) and "/" not in stage and "." not in stage:
            raise SinkstudyError(f"--{what} {item}: no stage named {stage!r}; stages: {', '.join(stage_names)}")
        else:
            for name in stage_names:
                out.setdefault(name, []).append(item)
    return out


def stage_counts(values: list[str] | None, stage_names: list[str], what: str = "train-steps") -> dict[str, int]:
    """--`what` [STAGE=]N items (--train-steps, --examples) as {stage: N} (`parse_stage_values`: an item without STAGE=
    for every stage; the last one given wins), each a positive integer."""
    return {stage: _count(items[-1], f"--{what}", 1) for stage, items in parse_stage_values(values or [], stage_names, what).items()}


def check_counts(values: list[str] | None, what: str = "train-steps") -> None:
    """Each --`what` [STAGE=]N item's N a positive integer: checked before the recipe naming the stages is read."""
    for item in values or []:
        _count(item.rpartition("=")[2], f"--{what}", 1)


def recovery_steps(values: list[str] | None) -> int:
    """--train-steps of recovery training, one text stage: a plain N (the last given; 0: no training)."""
    if not values:
        return 0
    if "=" in values[-1]:
        raise SinkstudyError(f"--train-steps {values[-1]}: recovery training is one stage; give a plain N (STAGE=N is for "
                             "--recipe's stages)")
    return _count(values[-1], "--train-steps", 0)


def _count(value: str, flag: str, low: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise SinkstudyError(f"{flag} {value}: not an integer") from None
    if n < low:
        raise SinkstudyError(f"{flag} must be >= {low}, got {n}")
    return n


def vision_spec(args, seed: int) -> "VisionSpec | None":
    """The vision side the flags of `add_vision_options` name (None: none, a text-only run), seeded with the recipe's
    seed: a fresh tower (--vision), a donor's (--donor), a tiny one (--tiny-vision) or the scenes tower."""
    if args.vision:
        return VisionSpec("fresh", args.vision, seed=seed)
    if args.donor:
        return VisionSpec("donor", args.donor, seed=seed)
    if getattr(args, "tiny_vision", False):
        return VisionSpec("tiny", seed=seed)
    if getattr(args, "scenes_vision", False):
        return VisionSpec("scenes", seed=seed)
    return None


def add_recipe_option(p, help: str) -> None:
    p.add_argument("--recipe", metavar="YAML", default=None, help=help)


def add_vision_options(p, *, required: bool) -> None:
    """The vision side of an adaptation: one of --vision / --donor (/ --tiny-vision / --text-only for
    `adapt`, where one is required: checked after parsing, so that `--protect list` works alone)."""
    side = p.add_mutually_exclusive_group() if required else p
    side.add_argument("--vision", metavar="ID|PATH", help="fresh LLaVA: a CLIP or SigLIP tower + a new 2-layer GELU projector"
                                                          + ("" if required else " (default: a tiny local tower)"))
    side.add_argument("--donor", metavar="ID|PATH", help="an existing VLM (Qwen2/2.5-VL, LLaVA) whose tower + projector to keep")
    if required:
        side.add_argument("--tiny-vision", action="store_true", help="a tiny random CLIP tower built locally (offline tests, the demo)")
        side.add_argument("--scenes-vision", action="store_true",
                          help="a small CLIP tower pretrained locally on the VL recipe's images (cached; docs/adapt.md)")
        side.add_argument("--text-only", action="store_true", help="no vision: train the LM itself on text (the Tülu-style contrast)")


# --------------------------------------------------------------------------- statistics

def add_bootstrap_options(p) -> None:
    """--n-boot and --confidence of the paired bootstrap CIs."""
    p.add_argument("--n-boot", type=argtypes.n_boot, default=DEFAULT_N_BOOT, metavar="N",
                   help=f"bootstrap replicates (>= 1; default {DEFAULT_N_BOOT})")
    p.add_argument("--confidence", type=argtypes.confidence, default=DEFAULT_CONFIDENCE,
                   help=f"confidence of the intervals (default {DEFAULT_CONFIDENCE})")


def add_seed_option(p, what: str = "every random choice of the command") -> None:
    p.add_argument("--seed", type=int, default=0, help=f"seed of {what} (default 0)")


# --------------------------------------------------------------------------- output and caching

def add_output_options(p, *, out: str, cache: bool = False) -> None:
    """--out DIR (default None: `out` words where the command writes then), --force, and with `cache`
    --no-cache / --cache-dir: whether finished steps of other runs are reused, and where they are noted (`sharing`)."""
    g = p.add_argument_group("output and caching")
    g.add_argument("--out", default=None, metavar="DIR", help=f"output directory (default: {out}); a rerun into it reuses "
                                                              "what is finished")
    add_force_option(g)
    if cache:
        g.add_argument("--no-cache", action="store_true", help="make every step again that another run finished (what an earlier "
                                                                "run of this command left in --out is still reused)")
        g.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="where finished steps are noted for other runs to reuse (default $SINKSTUDY_CACHE/steps)")


def add_force_option(p, output: str = "--out") -> None:
    """--force, one meaning on every command: what an earlier run of this command left in its output is made again
    and replaced, never reused (a study: every step; nothing the command did not write there, which is refused)."""
    p.add_argument("--force", action="store_true",
                   help=f"make again and replace what an earlier run of this command left in {output} instead of reusing "
                        "it, or refusing it when other settings made it; anything else there is refused, never deleted")


def json_made_with(path: Path, keys: tuple[str, ...], command: str) -> str | None:
    """None when the JSON file at `path` is one `command` wrote (it holds every one of `keys`); else what it is not."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    return None if isinstance(data, dict) and all(k in data for k in keys) else f"not a JSON file `sinkstudy {command}` wrote"


# The folder every command saves its model in (OUT/model): named by the folder above it instead.
SAVED_MODEL_DIR = "model"


def model_label(model) -> str:
    """A model argument as a default folder's name, one per input: a hub id or a real LLM's name as written
    (slugified, its organisation kept); a local path by its folder's name (the folder above a command's saved
    `model`, which every dose, merge and adaptation has) and a 6-hex digest of where it lies, so that two models
    of one name (runs/dose/a/model, runs/dose/b/model) never share a default output."""
    text = os.fspath(model).rstrip("/") or os.fspath(model)
    path = Path(text).expanduser()
    if not path.exists() and not looks_like_path(text):
        return slugify(text)
    name = path.parent.name if path.name == SAVED_MODEL_DIR and path.parent.name else path.name
    return f"{slugify(name)}-{hashlib.sha256(os.fspath(path.resolve()).encode()).hexdigest()[:6]}"


def default_out(command: str, model, *settings) -> Path:
    """runs/<command>/<model>[-<setting>...]: where a command writes without --out; the model as `model_label` names it
    (unique per input), each setting slugified."""
    return Path("runs") / command / "-".join([model_label(model), *(slugify(str(x)) for x in settings if x)])


# --------------------------------------------------------------------------- computing: threads and numeric mode

def add_compute_options(p, *, study: bool = False) -> None:
    """--threads and --numerics, on every command that computes. A study runs in the reproducible mode by default and
    may name several modes (the study once per mode); a single command runs native by default, in one mode."""
    g = p.add_argument_group("computing")
    g.add_argument("--threads", type=argtypes.positive_int, default=None, metavar="N",
                   help="compute threads of this process" + (" (with --jobs: of each worker; default 1 each)" if study else "")
                        + ": default the cores no other sinkstudy process on this machine has claimed ($OMP_NUM_THREADS "
                          "if set); the reproducible mode computes on one. Idle threads sleep (OMP_WAIT_POLICY=PASSIVE) "
                          "instead of spinning on cores another job needs")
    modes = ("reproducible: every CPU code path pinned (MKL, ATen, oneDNN, threads, libm, numpy), the same numbers on any "
             "x86-64 CPU; native: each library's fastest path for this CPU; native-aten-default: native with ATen's "
             "baseline kernels")
    g.add_argument("--numerics", type=argtypes.numeric_modes, default=None, metavar="MODE[,MODE...]" if study else "MODE",
                   help=f"{modes}. " + ("Several, comma-separated (native,native-aten-default): the study once per mode (the "
                                        "others in OUT/numerics/MODE), the report with the spread, answers only where every "
                                        f"mode agrees (default: ${ENV}, else reproducible; docs/numerics.md)" if study else
                                        f"(default: ${ENV}, else native; several modes are for studies: docs/numerics.md)"))
    p.set_defaults(numerics_default="reproducible" if study else "native", numeric_spread=study)


# --------------------------------------------------------------------------- progress

def add_progress_options(p) -> None:
    g = p.add_argument_group("progress")
    g.add_argument("--quiet", action="store_true",
                   help="no progress bars, ours or the libraries' (transformers, lm-eval, datasets, mergekit), and of the "
                        "libraries' log lines only errors; sinkstudy's own warnings still show")
