"""The demo's build steps, as plan records (`experiments.study.graph.Step`), and their bodies.

corpus -> tokenizer -> pretrain/<backbone> -> vl/<backbone>, and reference/<model> (the Sink
Strength of a real pretrained LLM, beside the miniatures'). Each is keyed by the engine on its
settings, its code and its inputs' keys. Files land under `<out>/data` and
`<out>/models/<backbone>-{base,vlm}`. `experiments.demo.build.Build` hands these to the study's plan.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from experiments.study.graph import Step
from sinkstudy import SinkstudyError

_ROOT = Path(__file__).resolve().parent.parent.parent


def _code(*parts: str) -> str:
    from sinkstudy.provenance import code_version

    return code_version(*(_ROOT / p for p in parts))


def build_steps(build, out: Path, sink: dict) -> list[Step]:
    """Every build step of `build` (experiments.demo.build.Build) under `out`; `sink`: the study's sink settings."""
    data, models = out / "data", out / "models"
    steps = [Step("build/corpus", lambda ctx: {"corpus": build.corpus, "code": _code("experiments/demo/corpus.py")},
                  outputs=(data / "train.jsonl",), run=lambda ctx: make_corpus(data, build.corpus), owner="build.corpus"),
             Step("build/tokenizer", {"tokenizer": build.tokenizer}, deps=("build/corpus",), outputs=(models / "tokenizer",),
                  run=lambda ctx: make_tokenizer(data, models / "tokenizer", build.tokenizer), owner="build.tokenizer")]
    for name in build.references:
        from sinkstudy.real_models import get, identity

        # `installed` in the key: a reference skipped for want of its package is measured once it is installed.
        steps.append(Step(f"build/reference/{name}", lambda ctx, name=name: {"model": identity(name), "installed": get(name).installed(), "sink": sink,
                                                                            "code": _code("evals/sink", "sinkstudy/real_models.py")},
                          run=lambda ctx, name=name: reference_step(name, sink, ctx.progress), owner=f"build.references {name}"))
    curve_every = build.pretrain["curve_every"]
    for b in build.backbones:
        base, vlm, owner = models / f"{b['name']}-base", models / f"{b['name']}-vlm", f"backbone {b['name']}"
        if b["kind"] == "pretrained":
            from sinkstudy.real_models import identity

            steps.append(Step(f"build/pretrain/{b['name']}",
                              lambda ctx, b=b: {"backbone": identity(b["pretrained"]), "code": _code("sinkstudy/real_models.py")},
                              outputs=(base,), run=lambda ctx, b=b, base=base: link_pretrained(b["pretrained"], base), owner=owner))
        else:
            train_code = ("experiments/demo/sinkgrow.py", "experiments/demo/backbones.py", "interventions/training.py", "interventions/adapt")
            steps.append(Step(f"build/pretrain/{b['name']}", lambda ctx, b=b: {"backbone": b, "curve_every": curve_every, "code": _code(*train_code)},
                              deps=("build/tokenizer",), outputs=(base,), owner=owner,
                              run=lambda ctx, b=b, base=base: pretrain_step(data, models, b, base, curve_every, ctx.progress)))
        steps.append(vl_adaptation(build, f"build/vl/{b['name']}", base, vlm, out, deps=(f"build/pretrain/{b['name']}", "build/corpus"),
                                   owner=owner))
    return steps


def vl_adaptation(build, step_id: str, base: Path, vlm: Path, out: Path, *, deps: tuple[str, ...], owner: str) -> Step:
    """The demo's VL recipe (`build.vl`) on the checkpoint `base`, writing the VLM `vlm`: a backbone's
    pair, or the same recipe on another start (the study's QK-norm arm)."""
    return Step(step_id, lambda ctx: {"vl": build.vl, "code": _code("experiments/demo/vl.py", "interventions/adapt")},
                deps=deps, outputs=(vlm,), owner=owner, run=lambda ctx: vl_step(base, vlm, build.vl, ctx.progress, data=out / "data"))


def build_facts(build, results: dict[str, dict]) -> dict:
    """What the report says about the build, from its steps' results: per backbone its recipe's knobs, pretraining
    and VL adaptation; the corpus; the VL recipe; the real models' Sink Strength (skipped ones left out)."""
    knobs = ("name", "kind", "family", "pretrained", "native_qk_norm", "num_hidden_layers", "hidden_size", "num_attention_heads",
             "lr", "weight_decay", "backcopy_share", "retrieval_share", "noise_share", "sprinkle_rate")
    backbones = []
    for b in build.backbones:
        pre, vl = results[f"build/pretrain/{b['name']}"], results[f"build/vl/{b['name']}"]
        backbones.append({**{k: b[k] for k in knobs if k in b},
                          "pretrain": {k: pre.get(k) for k in ("params", "steps", "final_loss")} | {"sink_curve": pre.get("sink_curve") or []},
                          "vl": {"final_loss": {s: r["final_loss"] for s, r in vl["stages"].items()},
                                 "text_chats": sum(vl.get("n_text_chats", {}).values()), "sink_trajectory": vl.get("sink_trajectory") or [],
                                 "heldout": vl["heldout"]}})
    corpus = results["build/corpus"]
    refs = [results[f"build/reference/{name}"] for name in build.references]
    return {"backbones": backbones, "corpus": {k: corpus[k] for k in ("train_records", "kinds", "heldout_ifeval", "heldout_gsm")},
            "vl": {"stage1_steps": build.vl["stage1"]["steps"], "stage2_steps": build.vl["stage2"]["steps"],
                   "text_share": build.vl["stage2"].get("text_share", 0), "heldout_images": build.vl["heldout_images"]},
            "references": [{k: r[k] for k in ("name", "source", "native_qk_norm", "layers", "sink_strength", "mean_mass")}
                           for r in refs if "sink_strength" in r]}


def make_corpus(data: Path, cfg: dict) -> dict:
    from experiments.demo import corpus
    from sinkstudy.io import write_text_atomic

    records = corpus.training_records(cfg["train_records"], cfg["seed"])
    ifeval, gsm = corpus.heldout_prompts(cfg["heldout_ifeval"], cfg["heldout_gsm"], cfg["seed"])
    jsonl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    write_text_atomic(data / "train.jsonl", corpus.records_jsonl(records))
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


def pretrain_step(data: Path, models: Path, backbone: dict, out: Path, curve_every: int | None, progress: bool) -> dict:
    """Train one backbone's recipe on the corpus (its data mix formed here), recording S every
    `curve_every` steps; save model + tokenizer to `out` atomically."""
    import dataclasses

    from experiments.demo.backbones import save_backbone
    from experiments.demo.sinkgrow import Recipe, grow
    from sinkstudy.checkpoint import load_tokenizer
    from sinkstudy.provenance import model_fingerprint

    tok = load_tokenizer(models / "tokenizer")
    fields = {f.name for f in dataclasses.fields(Recipe)}
    recipe = Recipe(**{k: v for k, v in backbone.items() if k in fields})
    marks = sorted({0, recipe.steps, *range(0, recipe.steps, curve_every)}) if curve_every else ()
    model, grown = grow(recipe, tok, training_texts(data, tok), checkpoints=marks, progress=progress)
    save_backbone(model, tok, out)
    return {"steps": recipe.steps, "final_loss": grown.final_loss, "tokens": grown.tokens, "train_seconds": round(grown.train_seconds, 1),
            "params": sum(p.numel() for p in model.parameters()), "recipe": grown.recipe.to_json(),
            "sink_curve": [{k: p[k] for k in ("step", "S", "mass", "argmax_is_sink")} for p in grown.curve],
            "path": str(out), "fingerprint": model_fingerprint(out)}


def link_pretrained(name: str, out: Path) -> dict:
    """A pretrained backbone: `out` holds its converted checkpoint (weights linked from the user's cache)
    with a chat template (`sinkstudy.real_models.chat_checkpoint`)."""
    from sinkstudy import real_models
    from sinkstudy.provenance import model_fingerprint

    real_models.chat_checkpoint(name, out)
    return {"pretrained": name, "source": real_models.get(name).source, "checkpoint": str(real_models.checkpoint(name)), "path": str(out),
            "params": _count_params(out), "fingerprint": model_fingerprint(out)}


def _count_params(path: Path) -> int:
    from sinkstudy.checkpoint import weight_files

    files = weight_files(path)
    return sum(math.prod(t.shape) for t in files.tensors.values()) if files else 0


def reference_step(name: str, sink: dict, progress: bool) -> dict:
    """Sink Strength of a real pretrained LLM with the study's sink settings (skipped, saying why,
    when its weights package is not installed)."""
    from evals.sink import compute_sink_maps, strength_from_maps
    from interventions.pairs import load_causal_lm
    from sinkstudy import real_models

    model_info = real_models.get(name)
    if not model_info.installed():
        return {"name": name, "skipped": f"its weights package is not installed ({model_info.install_command()}; make real-model installs it)"}
    path = real_models.checkpoint(name)
    model, tok = load_causal_lm(path)
    maps = compute_sink_maps(model, tok, sink["texts"], metric=sink["metric"], progress=progress, **sink["options"])
    strength = strength_from_maps(maps, sink["metric"], **sink["params"])
    return {"name": name, "source": model_info.source, "native_qk_norm": model_info.native_qk_norm, "path": str(path),
            "sink_strength": strength.value, "mean_mass": float(maps.mass.mean()),
            "median_per_layer": strength.details.get("median_per_layer"), "layers": model.config.num_hidden_layers}


def vl_step(base: Path, out: Path, cfg: dict, progress: bool, *, data: Path) -> dict:
    """The engine's two LLaVA stages on digits (plus text-only corpus chats where a stage sets
    `text_share`); the run directory (report, trajectory) is `<models>/../adapt/<out name>`, the VLM
    checkpoint `out`."""
    from experiments.demo.vl import adapt_vl
    from sinkstudy.provenance import model_fingerprint

    if not (base / "config.json").is_file():
        raise SinkstudyError(f"VL adaptation needs the base checkpoint {base}")
    chats = [(u, a) for u, a in read_records(data) if a is not None]
    res = adapt_vl(base, out, cfg, work_dir=out.parent.parent / "adapt" / out.name, progress=progress, chats=chats)
    return {**res, "path": str(out), "fingerprint": model_fingerprint(out)}
