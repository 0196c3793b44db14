"""Shared fixtures: everything offline, tiny and built locally; every test starts from the same state.

`make test` runs the suite on all cores (pytest-xdist: each worker imports this file, so each has its own
cache) in random order (pytest-randomly; the seed is printed last, `--randomly-seed=N` replays an order),
the longest modules handed out first (pytest_collection_modifyitems below).
"""

import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process, in-process commands (their default: sinkstudy.threads) and started ones alike:
# tiny models gain nothing from more, and the suite's workers already use every core.
os.environ["OMP_NUM_THREADS"] = "1"
# The suite runs in the native numeric mode (a process enters the reproducible one only when it starts:
# sinkstudy.numerics); tests/test_numerics.py starts its own processes in each mode.
os.environ["SINKSTUDY_NUMERICS"] = "native"
# The real checkpoints (tests marked `real`) are converted once into the user's cache, not the suite's
# throw-away one: the cache in effect when the run started (`make test` converts them there first).
os.environ.setdefault("SINKSTUDY_REAL_CACHE", os.environ.get("SINKSTUDY_CACHE") or str(Path.home() / ".cache" / "sinkstudy"))
# Hermetic: eval results, fingerprints and nltk tables cached by one run must not serve another.
os.environ["SINKSTUDY_CACHE"] = tempfile.mkdtemp(prefix="sinkstudy-test-cache-")
atexit.register(shutil.rmtree, os.environ["SINKSTUDY_CACHE"], ignore_errors=True)
# ...but lm-eval's task index (keyed by lm-eval's version and task files, ~13 s to build) is the installed
# lm-eval's, whoever reads it: kept in the user's cache like the real checkpoints, built once for every worker.
Path(os.environ["SINKSTUDY_REAL_CACHE"], "lm-eval-index").mkdir(parents=True, exist_ok=True)
Path(os.environ["SINKSTUDY_CACHE"], "lm-eval-index").symlink_to(Path(os.environ["SINKSTUDY_REAL_CACHE"], "lm-eval-index"))

import pytest  # noqa: E402


def _freeze_library_objects() -> None:
    """Import the libraries nearly every test uses, then move their ~0.5 M objects out of the garbage
    collector's reach: each full collection (accelerate's `free_memory` at the start of every Trainer run calls one)
    otherwise walks them all, about 0.5 s a time."""
    import accelerate  # noqa: F401
    import lm_eval.evaluator  # noqa: F401
    import transformers  # noqa: F401
    from lm_eval.models.huggingface import HFLM  # noqa: F401
    from transformers import Trainer  # noqa: F401

    gc.collect()
    gc.freeze()


def pytest_configure(config):
    """Set up a process that runs tests; pytest-xdist's controller only hands tests to its workers, and
    importing the libraries there (about 6 s) would hold back every worker's start."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import torch

    # Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine the thread
    # pool's spin-waits made single forwards tens of times slower.
    torch.set_num_threads(1)
    _freeze_library_objects()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Longest modules first, each where the shuffle put it among modules of like cost. `--dist loadscope`
    hands a worker one module at a time in this order, so a long module drawn last runs on one core while the
    other idles: over shuffled orders of a measured suite that cost 19 s on average and 55 s one time in ten;
    longest first, about 1 s. A module's cost is estimated from its tests: one on the real backbones about
    30 s (their module also converts both checkpoints), an end-to-end (`slow`) one about 15 s or the seconds its
    mark states (`@pytest.mark.slow(seconds=100)`, measured), any other 0.3 s."""
    def cost(item) -> float:
        slow = item.get_closest_marker("slow")
        return 30.0 if item.get_closest_marker("real") else slow.kwargs.get("seconds", 15.0) if slow else 0.3

    module_cost: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_cost[module] = module_cost.get(module, 0.0) + cost(item)
    items.sort(key=lambda item: -module_cost[item.nodeid.split("::")[0]])  # stable: the shuffled order otherwise


def pytest_terminal_summary(terminalreporter, config):
    """The random order's seed, last (pytest -q shows no header), so any failing order can be replayed."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"tests ran in random order, seed {seed}: replay it with --randomly-seed={seed} "
                                    f"(make test ARGS=--randomly-seed={seed})")


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory):
    """No test sees what another left: plug-ins and registered names, environment variables, torch's
    thread count and its global random generator are put back (and the generator seeded) around each.
    Each test runs in an empty working directory of its own: what a command reads or writes by a relative
    path (the default `runs/...`, a config's `runs/demo/...` inputs) is never the checkout's, whatever
    `make demo` left there."""
    import torch

    from sinkstudy.plugins import isolated

    environ, threads, cwd = dict(os.environ), torch.get_num_threads(), os.getcwd()
    torch.manual_seed(0)
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        with isolated():
            yield
    finally:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)
    # What outlives a test (fixtures, caches, lazily imported modules) leaves the collector's reach too: the
    # full collection that starts every Trainer run (accelerate's free_memory) then walks only what the
    # current test made, not the whole suite's heap (28 s of a suite run went to those walks).
    gc.collect()
    gc.freeze()


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: no finished step (nor eval) of another test is found and reused by key."""
    cache = tmp_path / "own-cache"
    cache.mkdir()
    (cache / "lm-eval-index").symlink_to(Path(os.environ["SINKSTUDY_REAL_CACHE"], "lm-eval-index"))
    monkeypatch.setenv("SINKSTUDY_CACHE", str(cache))
    return cache


@pytest.fixture
def fake_measurements(monkeypatch):
    """The sink and eval steps without lm-eval (what a sweep reuses is decided by keys, not by scores): the names
    of the points they measured, in order."""
    import experiments.study.treat as treat
    from experiments.study.pair_steps import MeasureEval, MeasureSink

    calls: list[str] = []

    def sink(self, ctx):
        if self.out.parent.parent.name == "points":
            calls.append(self.out.parent.name)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("{}")
        return {"value": 1.0, "metric": "logodds", "maps": str(self.out)}

    def evaluate(self, ctx):
        self.out.mkdir(parents=True, exist_ok=True)
        return {"dir": str(self.out), "scores": {}}

    monkeypatch.setattr(MeasureSink, "run", sink)
    monkeypatch.setattr(MeasureEval, "run", evaluate)
    monkeypatch.setattr(treat, "measure_summary", lambda results, refs, point, tasks, **kw: {
        "sink_strength": {"value": 1.0, "base": 1.0, "vlm": 0.5, "metric": "logodds"}, "tasks": {"t": {"recovery": 0.5, "ci": [0.4, 0.6]}},
        "caption_nll": None, "weight_distance_to_vlm": results[point["distance"]]["weight_distance_to_vlm"]})
    return calls


@pytest.fixture(scope="session")
def tokenizer():
    from sinkstudy.tiny import train_bpe_tokenizer

    return train_bpe_tokenizer(vocab_size=512)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path
