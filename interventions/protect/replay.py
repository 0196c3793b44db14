"""`text_replay`: mix a share of text-only chat data into VL training (the baseline every protection
must beat; LLaVA-665K itself carries ~6% ShareGPT text-only chats).

`data` is an adaptation data spec (`interventions.adapt.sources`: FILE.json[l], json:FILE, hf:NAME, the base's
self-distilled replies {selfdistill: base}, or in Python {"records": [...]}) of text-only records (chats or
plain text); by default the base's own greedy replies to neutral prompts (`interventions.adapt.selfdistill`),
which hold its text skill without teaching it a format an eval grades. They are formatted by the
stage's own encoder (the base's chat template, loss on assistant turns). The stage's data becomes
an `interventions.adapt.encoding.MixedDataset`: every VL record still appears once per epoch and exactly
`share` of the items seen are replayed text (floor(n * share) of any first n items of an epoch;
share * b of every micro-batch of b when that is whole), shuffled by the run's seed. Acts in
`stages` (default: stage2).
"""

from __future__ import annotations

from interventions.adapt.encoding import EncodedDataset, MixedDataset
from interventions.adapt.sources import check_spec, load_records, spec_identity
from interventions.protect import Protection, register_protection
from sinkstudy import SinkstudyError


def _validate(config: dict) -> None:
    share = config["share"]
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
        raise SinkstudyError(f"share must be a number in (0, 1), got {share!r}")
    check_spec(config["data"])


@register_protection("text_replay", defaults={"data": {"selfdistill": "base"}, "share": 0.2, "stages": ["stage2"]}, validate=_validate)
class TextReplay(Protection):
    """Mix `share` of text-only chats (`data`) into the stage's batches."""

    def identity_params(self) -> dict:
        # The replayed file's content, not only its path, identifies the run.
        return {**super().identity_params(), "config": {**self.config, "data": spec_identity(self.config["data"])}}

    def dataset(self, ctx, dataset):
        encoder = getattr(dataset, "encoder", None)
        if encoder is None:
            raise SinkstudyError("text_replay: the stage's dataset has no encoder to format the replayed chats with")
        records = load_records(self.config["data"], seed=ctx.config.seed, base=ctx.base)
        if isinstance(records.rows, list):
            with_images = next((i for i in range(len(records)) if records[i].get("images")), None)
            if with_images is not None:
                raise SinkstudyError(f"text_replay: record {with_images} of {records.name} has images; replay data must be text-only")
        mixed = MixedDataset(dataset, EncodedDataset([records], encoder), self.config["share"], seed=ctx.config.seed)
        ctx.state.update(records=len(records), epoch_length=mixed.epoch_length,
                         replayed_per_epoch=mixed.epoch_length - len(dataset))
        return mixed

    def teardown(self, ctx) -> dict:
        return {"share": self.config["share"], "replay_records": ctx.state.get("records"),
                "epoch_length": ctx.state.get("epoch_length"), "replayed_per_epoch": ctx.state.get("replayed_per_epoch")}
