"""Template share in a study: the openings of the VL recipe's training answers, read once per recipe by a step
(`TrainingOpenings`, the one template-share kind: an `adapt:` recipe's data and the demo build's digits alike),
against which every evaluated model's eval answers are checked in the summary (`shares`; the definition:
`evals.template_share`). A model whose answers open like the VL training answers lost its text skill by collapse
to a template, not by erosion; the share tells the two apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from evals.template_share import Openings, openings, template_share
from experiments.study.kinds import StepArgs
from interventions.adapt.code import VL_WORLD
from interventions.adapt.sources import load_records, parse_spec, spec_identity


def training_data(recipe: dict) -> tuple:
    """The data specs of every stage of `recipe` (an AdaptConfig as a dict) that can hold image records: every spec
    but the base's self-distilled replies (text by construction, and made from a model)."""
    specs = []
    for stage in recipe["stages"]:
        for spec in stage.get("data") or ():
            if "selfdistill" not in parse_spec(spec) and spec not in specs:
                specs.append(spec)
    return tuple(specs)


@dataclass(frozen=True)
class TrainingOpenings(StepArgs):
    """The openings of the answers of `specs`' image records (`evals.template_share.openings`); text-only records
    (a text share, replayed chats) are no VL template. Keyed by the specs' content (`spec_identity`) and seed."""

    kind: ClassVar[str] = "template-openings"
    code: ClassVar[tuple[str, ...]] = ("evals.template_share", *VL_WORLD, "interventions.adapt.sources", "interventions.adapt.generated")
    specs: tuple
    seed: int = 0

    def identity(self, ctx) -> dict:
        return {"specs": [spec_identity(s) for s in self.specs], "seed": self.seed}

    def run(self, ctx) -> dict:
        answers = []
        for spec in self.specs:
            records = load_records(spec, seed=self.seed)
            for i in range(len(records)):
                rec = records[i]
                if rec.get("images"):
                    answers += [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        return openings(answers).as_dict()


def shares(openings: dict, run, tasks: list[str]) -> dict[str, Any]:
    """Per task, the template share of one model's eval answers (`evals.eval_run.EvalRun`) against `openings`
    (a `TrainingOpenings` result)."""
    found = Openings.from_dict(openings)
    return {t: template_share([s["output"] for s in run.docs(t).values()], found).as_dict() for t in tasks}
