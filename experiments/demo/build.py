"""The demo's `build` section: defaults, validation and the build steps the runner executes.

Steps (each cached by the runner under a key of its settings and its inputs' keys):
corpus -> tokenizer -> pretrain/<backbone> -> vl/<backbone>. Files land under `<out>/data` and
`<out>/models/<backbone>-{base,vlm}`.
"""

from __future__ import annotations

import json
from pathlib import Path

from sinkstudy import SinkstudyError

DEFAULTS = {
    "corpus": {"train_records": 6000, "heldout_ifeval": 48, "heldout_gsm": 32, "seed": 0},
    "tokenizer": {"vocab_size": 1024},
    "pretrain": {"steps": 300, "lr": 3e-3, "batch_size": 16, "seq_len": 160},
    "backbones": [],
    "vl": {
        "seed": 0, "heldout_images": 200,
        "vision": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 8, "patch_size": 4},
        "stage1": {"steps": 40, "lr": 1e-3, "batch_size": 16},
        # lr = pretraining lr / 3, not LLaVA's / 15: our LM has never seen caption wording and must learn it
        # before it can learn to read the digit (at 2e-4 x 100 steps accuracy stayed at chance).
        "stage2": {"steps": 200, "lr": 1e-3, "batch_size": 16},
        # Sink Strength of the LM during adaptation every N steps (trajectory.json beside each run); null: ends only.
        "trajectory_every": 50,
    },
}
BACKBONE_KEYS = {"name", "family", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "seed", "steps"}
FAMILIES = ("qwen2", "qwen3", "llama")

# `sinkstudy demo --quick`: the same pipeline, smaller everywhere (the end-to-end test runs this).
QUICK = {
    "build": {
        "corpus": {"train_records": 1500, "heldout_ifeval": 10, "heldout_gsm": 6},
        "tokenizer": {"vocab_size": 512},
        "pretrain": {"steps": 30, "batch_size": 8, "seq_len": 128},
        "vl": {"heldout_images": 20, "stage1": {"steps": 6, "batch_size": 8}, "stage2": {"steps": 8, "batch_size": 8},
               "trajectory_every": 4},
    },
    "evals": {"max_gen_toks": 24, "n_boot": 200},
}
QUICK_BACKBONE = {"hidden_size": 64, "num_hidden_layers": 2, "steps": None}
QUICK_QKNORM_STEPS = 10


def validate_build(build, where: str) -> dict:
    from experiments.study import StudyConfigError, deep_merge

    if not isinstance(build, dict):
        raise StudyConfigError(f"{where}: must be a mapping")
    unknown = sorted(set(build) - set(DEFAULTS))
    if unknown:
        raise StudyConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(DEFAULTS)}")
    for k in ("corpus", "tokenizer", "pretrain", "vl"):
        if k in build and not isinstance(build[k], dict):
            raise StudyConfigError(f"{where}.{k}: must be a mapping")
        extra = sorted(set(build.get(k) or {}) - set(DEFAULTS[k]))
        if extra:
            raise StudyConfigError(f"{where}.{k}: unknown key(s) {', '.join(extra)}; allowed: {', '.join(DEFAULTS[k])}")
    out = deep_merge(DEFAULTS, build)
    backbones = out["backbones"]
    if not isinstance(backbones, list) or not backbones:
        raise StudyConfigError(f"{where}.backbones: must be a non-empty list")
    names = set()
    for i, b in enumerate(backbones):
        bw = f"{where}.backbones[{i}]"
        if not isinstance(b, dict):
            raise StudyConfigError(f"{bw}: must be a mapping")
        extra = sorted(set(b) - BACKBONE_KEYS)
        if extra:
            raise StudyConfigError(f"{bw}: unknown key(s) {', '.join(extra)}; allowed: {', '.join(sorted(BACKBONE_KEYS))}")
        if b.get("family") not in FAMILIES:
            raise StudyConfigError(f"{bw}.family: must be one of {', '.join(FAMILIES)}, got {b.get('family')!r}")
        if not isinstance(b.get("name"), str) or b["name"] in names:
            raise StudyConfigError(f"{bw}.name: missing or duplicate")
        names.add(b["name"])
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(b.get(k), int) or b[k] < 1:
                raise StudyConfigError(f"{bw}.{k}: must be a positive integer, got {b.get(k)!r}")
        if b["hidden_size"] % b["num_attention_heads"]:
            raise StudyConfigError(f"{bw}: hidden_size {b['hidden_size']} is not divisible by num_attention_heads {b['num_attention_heads']}")
        b.setdefault("seed", 0)
    for k in ("steps", "batch_size", "seq_len"):
        if not isinstance(out["pretrain"][k], int) or out["pretrain"][k] < 1:
            raise StudyConfigError(f"{where}.pretrain.{k}: must be a positive integer")
    return out


def quick_overrides(raw: dict) -> dict:
    """Overrides for `--quick`: QUICK plus the first two backbones, shrunk (2 layers, d=64)."""
    from experiments.study import deep_merge

    backbones = [{**b, **{k: v for k, v in QUICK_BACKBONE.items() if v is not None}} for b in (raw.get("build") or {}).get("backbones", [])[:2]]
    for b in backbones:
        b.pop("steps", None)
        b["num_attention_heads"] = min(b.get("num_attention_heads", 4), 4)
        b["num_key_value_heads"] = min(b.get("num_key_value_heads", 2), 2)
    interventions = [dict(i, params={**i.get("params", {}), "train_steps": min(i["params"].get("train_steps", 0), QUICK_QKNORM_STEPS)})
                     if i.get("method") == "qknorm" and i.get("params") else i for i in raw.get("interventions") or []]
    return deep_merge(QUICK, {"build": {"backbones": backbones}, "interventions": interventions})


# --------------------------------------------------------------------------- the build steps

def run_build(runner, build: dict) -> dict[str, str]:
    """Run (or reuse) every build step; returns {backbone name: step id of its VLM} for deps."""
    out = runner.out
    data, models = out / "data", out / "models"
    runner.run("build/corpus", {"corpus": build["corpus"]}, lambda: make_corpus(data, build["corpus"]), outputs=data / "train.jsonl")
    runner.run("build/tokenizer", {"tokenizer": build["tokenizer"]}, lambda: make_tokenizer(data, models / "tokenizer", build["tokenizer"]),
               deps=["build/corpus"], outputs=models / "tokenizer")
    done = {}
    for b in build["backbones"]:
        train = {**build["pretrain"], **({"steps": b["steps"]} if b.get("steps") else {})}
        runner.run(f"build/pretrain/{b['name']}", {"backbone": b, "pretrain": train},
                   lambda b=b, train=train: pretrain_step(data, models, b, train, runner.progress), deps=["build/tokenizer"],
                   outputs=models / f"{b['name']}-base")
        runner.run(f"build/vl/{b['name']}", {"vl": build["vl"]},
                   lambda b=b: vl_step(models / f"{b['name']}-base", models / f"{b['name']}-vlm", build["vl"], runner.progress),
                   deps=[f"build/pretrain/{b['name']}"], outputs=models / f"{b['name']}-vlm")
        done[b["name"]] = f"build/vl/{b['name']}"
    return done


def make_corpus(data: Path, cfg: dict) -> dict:
    from experiments.demo import corpus
    from sinkstudy.io import write_text_atomic

    records = corpus.training_records(cfg["train_records"], cfg["seed"])
    ifeval, gsm = corpus.heldout_prompts(cfg["heldout_ifeval"], cfg["heldout_gsm"], cfg["seed"])
    jsonl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    write_text_atomic(data / "train.jsonl", jsonl({"user": u, "assistant": a} for u, a in records))
    write_text_atomic(data / "heldout_ifeval.jsonl", jsonl(ifeval))
    write_text_atomic(data / "heldout_gsm.jsonl", jsonl(gsm))
    kinds = {"chat": sum(a is not None for _, a in records), "plain": sum(a is None for _, a in records)}
    return {"train_records": len(records), "kinds": kinds, "heldout_ifeval": len(ifeval), "heldout_gsm": len(gsm),
            "files": {k: str(data / f) for k, f in (("train", "train.jsonl"), ("ifeval", "heldout_ifeval.jsonl"), ("gsm", "heldout_gsm.jsonl"))}}


def read_records(data: Path) -> list[tuple[str, str | None]]:
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return [(r["user"], r["assistant"]) for r in rows]


def training_texts(data: Path, tokenizer) -> list[str]:
    """The corpus as training strings: chats in the tokenizer's template, plain text as is."""
    from experiments.demo.corpus import chat

    return [chat(tokenizer, u, a) if a is not None else u for u, a in read_records(data)]


def make_tokenizer(data: Path, out_dir: Path, cfg: dict) -> dict:
    from experiments.demo.corpus import tokenizer_texts
    from sinkstudy.io import atomic_output_dir
    from sinkstudy.tiny import train_bpe_tokenizer

    tok = train_bpe_tokenizer(tokenizer_texts(read_records(data)), vocab_size=cfg["vocab_size"])
    with atomic_output_dir(out_dir, force=True) as tmp:
        tok.save_pretrained(tmp)
    return {"path": str(out_dir), "vocab_size": len(tok)}


def load_demo_tokenizer(path: Path):
    from interventions.pairs import load_tokenizer

    return load_tokenizer(path)


def pretrain_step(data: Path, models: Path, spec: dict, train: dict, progress: bool) -> dict:
    from experiments.demo.backbones import pretrain_backbone
    from sinkstudy.provenance import model_fingerprint

    tok = load_demo_tokenizer(models / "tokenizer")
    texts = training_texts(data, tok)
    out = models / f"{spec['name']}-base"
    stats = pretrain_backbone(spec, tok, texts, out, train=train, force=True, progress=progress)
    return {**stats, "path": str(out), "fingerprint": model_fingerprint(out)}


def vl_step(base: Path, out: Path, cfg: dict, progress: bool) -> dict:
    """The engine's two LLaVA stages on digits; the run directory (report, trajectory) is
    `<models>/../adapt/<out name>`, the VLM checkpoint `out`."""
    from experiments.demo.vl import adapt_vl
    from sinkstudy.provenance import model_fingerprint

    if not (base / "config.json").is_file():
        raise SinkstudyError(f"VL adaptation needs the base checkpoint {base}")
    res = adapt_vl(base, out, cfg, work_dir=out.parent.parent / "adapt" / out.name, progress=progress)
    return {**res, "path": str(out), "fingerprint": model_fingerprint(out)}
