"""Training-time protections on tiny real models: each does exactly what it says.

Head selection follows the sink maps; the q/k projection removes exactly the sink-logit gradient
span (gradients and updates orthogonal to it; the protected heads' sink logits move O(step^2) while
an unprotected head of the same KV group moves O(step)); frozen rows and layers stay bit-identical
under AdamW weight decay; the preservation loss is exactly 0 before the first update and positive
after drift; text replay puts the configured share of text-only rows into every batch; the QK-norm
switch gives a Llama twin of a Qwen3 that equals the Qwen3 with fitted scales in place of its norms.
"""

import copy
import json
import logging
import math

import pytest
import torch

from evals.sink import compute_sink_maps
from evals.sink.calibration import resolve_texts
from interventions.adapt import HookContext, TrainingHook, adapt, from_dict
from interventions.protect import ProtectionError, list_protections, make_protection, select_heads, validate_protection
from interventions.protect.qk import calibration_ids, counted_queries, forward_qk
from interventions.protect.heads import head_statistic, kv_group
from sinkstudy import SinkstudyError
from sinkstudy.tiny import tiny_causal_lm

TEXTS, _ = resolve_texts(None, "ifeval15")


def _maps(lm, tokenizer):
    return compute_sink_maps(lm, tokenizer, TEXTS, progress=False)


def _ctx(lm, tokenizer, maps, stage="stage2"):
    cfg = from_dict({"precision": "fp32", "stages": [{"name": stage, "batch_size": 2, "micro_batch_size": 2}]})
    return HookContext(model=lm, language_model=lm.model, tokenizer=tokenizer, stage=cfg.stages[0], config=cfg,
                       sink_maps=maps, calibration=TEXTS)


def _chats(tmp_path, n=24, name="chats.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Add {i} and 1."},
                                                       {"role": "assistant", "content": f"The answer is {i + 1}."}]})
                              for i in range(n)))
    return path


def _text_cfg(chats, steps=3, wd=0.1, lr=1e-2):
    return from_dict({"precision": "fp32", "seed": 1, "stages": [{"name": "text", "data": [str(chats)], "trainable": ["lm"],
                                                                   "steps": steps, "batch_size": 4, "micro_batch_size": 2,
                                                                   "lr": lr, "weight_decay": wd}]})


# --------------------------------------------------------------------------- registry and head selection

def test_registry_lists_the_shipped_protections_and_refuses_bad_settings_in_one_line():
    assert {"freeze_below_sink", "sink_head_qk_projection", "sink_head_freeze", "sink_preservation_loss", "text_replay",
            "disable_qk_norm"} <= set(list_protections())
    for name, params, needle in [
        ("nope", {}, "unknown protection"),
        ("sink_head_freeze", {"top_k": 3}, r"has no parameter\(s\) top_k"),
        ("sink_head_freeze", {"heads": {"by": "volume", "top_k": 2}}, "heads.by"),
        ("sink_head_freeze", {"heads": {"by": "mass"}}, "give top_k, threshold or both"),
        ("sink_head_freeze", {"heads": [[0, -1]]}, "explicit list"),
        ("sink_preservation_loss", {"weight": float("nan")}, "finite"),
        ("sink_preservation_loss", {"divergence": "js"}, "divergence"),
        ("text_replay", {"data": "missing.jsonl"}, "not found"),
        ("text_replay", {"data": "digits", "share": 1.0}, "share"),
        ("freeze_below_sink", {"statistic": "volume"}, "statistic"),
        ("disable_qk_norm", {"mode": "identity"}, "mode"),
        ("sink_head_freeze", {"stages": "stage2"}, "stages"),
    ]:
        with pytest.raises(ProtectionError, match=needle) as err:
            validate_protection(name, params)
        assert "\n" not in str(err.value)


def test_head_selection_rules_read_the_sink_maps(tokenizer):
    maps = _maps(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer)
    strength = maps.logodds.double().nanmedian(-1).values
    ranked = sorted(((float(strength[l, h]), l, h) for l in range(maps.num_layers) for h in range(maps.num_heads)),
                    key=lambda c: (-c[0], c[1], c[2]))
    assert select_heads(maps, {"by": "strength", "top_k": 3}) == sorted((l, h) for _, l, h in ranked[:3])
    mass = maps.mass
    top_mass = max(((float(mass[l, h]), l, h) for l in range(maps.num_layers) for h in range(maps.num_heads)))
    assert select_heads(maps, {"by": "mass", "top_k": 1}) == [top_mass[1:]]
    cut = ranked[4][0]
    assert select_heads(maps, {"by": "strength", "threshold": cut}) == sorted((l, h) for s, l, h in ranked if s >= cut)
    assert all(layer == 1 for layer, _ in select_heads(maps, {"by": "mass", "top_k": 8, "layers": [-1, -1]}))
    assert select_heads(maps, [[1, 2], [0, 3], [1, 2]]) == [(0, 3), (1, 2)]
    assert torch.equal(head_statistic(maps, "mass"), maps.mass.double())
    with pytest.raises(SinkstudyError, match="no head passes"):
        select_heads(maps, {"by": "mass", "threshold": 1.5})
    with pytest.raises(SinkstudyError, match="outside the model"):
        select_heads(maps, [[5, 0]])


def test_heads_chosen_in_a_model_without_a_sink_are_named_in_a_warning(tokenizer, caplog):
    """A random tiny model has no attention sink (no head's mean attention on the sink position above 0.3): the
    ranking still picks its strongest heads, and says in one warning line that they are no sink heads. Where the
    chosen heads are sink heads (the same maps with a sink put on two heads), nothing is said."""
    import dataclasses

    from interventions.protect.heads import SINK_HEAD_MASS, describe

    maps = _maps(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer)
    assert float(maps.mass.max()) <= SINK_HEAD_MASS
    caplog.set_level(logging.WARNING)
    chosen = select_heads(maps, {"by": "strength", "top_k": 2})
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message and "2 of the 2 heads chosen by {'by': 'strength', 'top_k': 2} are no sink heads" in message
    assert all(f"L{layer}H{head} (S " in message for layer, head in chosen) and "this model has no sink head" in message
    assert [h["sink_head"] for h in describe(maps, chosen)] == [False, False]
    select_heads(maps, {"by": "strength", "top_k": 2})  # the next stage of the same run selects again: said once
    assert len(caplog.records) == 1

    mass = maps.mass.clone()
    mass[1, 0] = mass[1, 3] = 0.9
    sunk = dataclasses.replace(maps, mass=mass)
    caplog.clear()
    assert select_heads(sunk, {"by": "mass", "top_k": 2}) == [(1, 0), (1, 3)] and not caplog.records
    assert select_heads(sunk, {"by": "mass", "threshold": SINK_HEAD_MASS}) == [(1, 0), (1, 3)] and not caplog.records
    select_heads(sunk, {"by": "mass", "top_k": 3})
    assert "1 of the 3 heads" in caplog.records[0].getMessage() and "the model has 2 sink head(s)" in caplog.records[0].getMessage()


# --------------------------------------------------------------------------- sink_head_qk_projection

def _sink_logits(decoder, ids, maps, layer, head):
    """Every counted calibration query's logit on head (layer, head)'s argmax key, concatenated."""
    out = []
    skip = int(maps.settings["skip_queries"])
    with torch.no_grad():
        for n, seq in enumerate(ids):
            cap = forward_qk(decoder, seq, {layer})[layer]
            sink = int(maps.argmax_key[n, layer, head])
            queries = counted_queries(len(seq), sink, skip)
            out.append(cap["scaling"] * cap["q"][0, head, queries].double() @ cap["k"][0, kv_group(decoder, head), sink].double())
    return torch.cat(out)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q/k biases; native per-head q/k norms before RoPE
def test_projection_removes_exactly_the_sink_logit_gradients(tokenizer, family):
    lm = tiny_causal_lm(family, vocab_size=len(tokenizer)).double()
    maps = _maps(lm, tokenizer)
    layer, head = 1, 0
    sibling = 1  # the other query head of the same KV group: it shares the k rows, its q rows are free
    assert kv_group(lm.model, head) == kv_group(lm.model, sibling)
    hook = make_protection("sink_head_qk_projection", {"heads": [[layer, head]], "rtol": 1e-6, "max_rank": 10**6})
    ctx = _ctx(lm, tokenizer, maps)
    hook.setup(ctx)
    (block,) = ctx.state["blocks"]
    u = block.basis.double()
    assert torch.allclose(u @ u.T, torch.eye(u.shape[0], dtype=u.dtype), atol=1e-8)
    assert block.energy == pytest.approx(1.0, abs=1e-9)

    # A real gradient: after the hook, the block's gradient has no component along U.
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    lm(input_ids=ids, labels=ids).loss.backward()
    raw = block.grads().clone()
    hook.after_backward(ctx)
    projected = block.grads()
    assert (u @ projected).abs().max() <= 1e-10 * raw.norm() and (u @ raw).norm() > 1e-3 * raw.norm()
    assert torch.allclose(projected, raw - u.T @ (u @ raw))
    assert 0 < ctx.state["removed"][0] < 1

    # First order: along the projected direction the protected head's sink logits change O(step^2),
    # the sibling head's (same k rows) O(step); along the raw direction the protected head's move O(step).
    cal = calibration_ids(tokenizer, TEXTS, maps)
    theta0 = block.values().clone()
    base = {h: _sink_logits(lm.model, cal, maps, layer, h) for h in (head, sibling)}

    def change(direction, eps, h):
        block.write(theta0 + eps * direction / direction.norm(), grad=False)
        try:
            return float((_sink_logits(lm.model, cal, maps, layer, h) - base[h]).abs().max())
        finally:
            block.write(theta0, grad=False)

    big, small = 1e-2, 1e-3
    protected = change(projected, big, head) / change(projected, small, head)
    free = change(projected, big, sibling) / change(projected, small, sibling)
    unprojected = change(raw, big, head) / change(raw, small, head)
    assert 60 < protected < 160, protected  # ~ (big / small)^2 = 100
    assert 7 < free < 13 and 7 < unprojected < 13, (free, unprojected)  # ~ big / small = 10
    assert change(projected, small, head) < 0.05 * change(projected, small, sibling)


def test_projected_updates_stay_orthogonal_through_adamw(tmp_path, tokenizer):
    """Through the engine (Adam rescales coordinates, weight decay moves every weight): the block's
    whole update is orthogonal to U, and the rest of the layer trains."""
    from interventions.pairs import load_causal_lm
    from interventions.protect.heads import geometry
    from interventions.protect.projection import Block, sink_directions

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    hook = make_protection("sink_head_qk_projection", {"heads": [[1, 2]], "rtol": 1e-4})
    report = adapt(copy.deepcopy(base), tokenizer=tokenizer, config=_text_cfg(_chats(tmp_path)), out=tmp_path / "run",
                   hooks=[hook], progress=False)
    trained, _ = load_causal_lm(report["model"])
    maps = _maps(base, tokenizer)
    args = (1, kv_group(base.model, 2), [2], geometry(base.model)[2])
    u, _ = sink_directions(base.model, Block(base.model.layers[1].self_attn, *args), calibration_ids(tokenizer, TEXTS, maps),
                           maps, 1e-4, 256)
    delta = Block(trained.model.layers[1].self_attn, *args).values() - Block(base.model.layers[1].self_attn, *args).values()
    assert delta.norm() > 1e-3 and (u.double() @ delta.double()).abs().max() < 1e-5 * delta.norm()
    summary = report["stages"][0]["hooks"]["sink_head_qk_projection"]
    assert summary["blocks"][0]["rank"] == u.shape[0] and summary["heads"][0]["layer"] == 1
    assert report["hooks"][0]["name"] == "sink_head_qk_projection" and report["hooks"][0]["source_sha256"].startswith("plugin-sha256:")


# --------------------------------------------------------------------------- freezing

def test_sink_head_freeze_keeps_rows_bit_identical_under_weight_decay(tmp_path, tokenizer):
    from interventions.pairs import load_causal_lm

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    hook = make_protection("sink_head_freeze", {"heads": [[0, 3]]})
    report = adapt(copy.deepcopy(base), tokenizer=tokenizer, config=_text_cfg(_chats(tmp_path)), out=tmp_path / "run",
                   hooks=[hook], progress=False)
    trained, _ = load_causal_lm(report["model"])
    hd, group = 16, kv_group(base.model, 3)
    for proj, rows in (("q_proj", slice(3 * hd, 4 * hd)), ("k_proj", slice(group * hd, (group + 1) * hd))):
        for part in ("weight", "bias"):
            a = getattr(getattr(base.model.layers[0].self_attn, proj), part)
            b = getattr(getattr(trained.model.layers[0].self_attn, proj), part)
            assert torch.equal(a[rows], b[rows]), (proj, part)
            other = torch.ones(a.shape[0], dtype=torch.bool)
            other[rows] = False
            assert not torch.equal(a[other], b[other])  # the rest of the matrix trained (and decayed)
    assert report["stages"][0]["hooks"]["sink_head_freeze"]["frozen_rows"] == 4 * hd


def test_freeze_below_sink_freezes_exactly_the_layers_below_the_first_sink_layer(tmp_path, tokenizer):
    from interventions.pairs import load_causal_lm
    from interventions.protect.freeze import first_sink_layer, layer_statistic

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer), num_hidden_layers=3)
    maps = _maps(base, tokenizer)
    values = layer_statistic(maps, "mean_mass")
    threshold = sorted(values)[-1]  # the layer with the highest mean sink mass is the first to reach it
    first = first_sink_layer(maps, "mean_mass", threshold)
    assert first == values.index(threshold)
    if first == 0:  # make the test meaningful: the first sink layer must have a layer below it
        threshold, first = values[1] if values[1] > values[0] else values[2], None
        first = first_sink_layer(maps, "mean_mass", threshold)
    assert first >= 1
    hook = make_protection("freeze_below_sink", {"statistic": "mean_mass", "threshold": threshold})
    report = adapt(copy.deepcopy(base), tokenizer=tokenizer, config=_text_cfg(_chats(tmp_path)), out=tmp_path / "run",
                   hooks=[hook], progress=False)
    trained, _ = load_causal_lm(report["model"])
    before, after = dict(base.named_parameters()), dict(trained.named_parameters())
    for name in before:
        below = any(name.startswith(f"model.layers.{i}.") for i in range(first)) or name.startswith("model.embed_tokens")
        assert torch.equal(before[name], after[name]) == below, name
    summary = report["stages"][0]["hooks"]["freeze_below_sink"]
    assert summary["first_sink_layer"] == first and summary["per_layer"] == [round(v, 4) for v in values]
    # A base with no layer at the threshold freezes nothing and says so.
    none = make_protection("freeze_below_sink", {"statistic": "mean_mass", "threshold": 2.0})
    ctx = _ctx(base, tokenizer, maps)
    none.setup(ctx)
    assert none.teardown(ctx)["first_sink_layer"] is None and "nothing frozen" in none.teardown(ctx)["note"]


# --------------------------------------------------------------------------- sink_preservation_loss

@pytest.mark.parametrize("divergence", ["kl", "l2"])
def test_preservation_loss_is_zero_at_step_zero_and_positive_after_drift(tokenizer, divergence):
    lm = tiny_causal_lm("qwen3", vocab_size=len(tokenizer))
    maps = _maps(lm, tokenizer)
    hook = make_protection("sink_preservation_loss", {"heads": {"by": "strength", "top_k": 2}, "divergence": divergence,
                                                      "batch_texts": 3})
    ctx = _ctx(lm.train(), tokenizer, maps)
    hook.setup(ctx)
    assert hook.loss(ctx, lm, {}).item() == 0.0
    ctx.step = 7  # another batch of calibration texts: still exactly 0
    assert hook.loss(ctx, lm, {}).item() == 0.0
    layer = ctx.state["heads"][0][0]
    with torch.no_grad():  # drift: the q projection of a sink head's layer moves (not a pure rescale: QK-norm undoes that)
        w = lm.model.layers[layer].self_attn.q_proj.weight
        w.add_(0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    term = hook.loss(ctx, lm, {})
    assert term.item() > 1e-6
    term.backward()
    assert lm.model.layers[layer].self_attn.q_proj.weight.grad.abs().sum() > 0  # the term trains what moved


def test_preservation_term_through_the_engine_starts_at_zero(tmp_path, tokenizer):
    hook = make_protection("sink_preservation_loss", {"heads": {"by": "strength", "top_k": 2}, "weight": 10.0})
    report = adapt(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer=tokenizer,
                   config=_text_cfg(_chats(tmp_path), steps=4, lr=3e-2), out=tmp_path / "run", hooks=[hook], progress=False)
    summary = report["stages"][0]["hooks"]["sink_preservation_loss"]
    assert summary["first_term"] == 0.0 and summary["last_term"] > 0
    logged = [e["preservation_term"] for e in report["stages"][0]["hook_logs"]["sink_preservation_loss"]]
    assert len(logged) == 4 and logged[0] == 0.0


# --------------------------------------------------------------------------- text_replay

def test_mixed_dataset_puts_the_share_in_every_prefix_and_each_main_item_once():
    from interventions.adapt.encoding import MixedDataset

    main, extra = list(range(50)), [f"t{i}" for i in range(7)]
    for share in (0.25, 0.3, 1 / 3):
        ds = MixedDataset(main, extra, share, seed=4)
        for epoch in (0, 1):
            order = ds.order(4, epoch)
            assert sorted(i for i in order if i < 50) == main
            for n in range(1, len(order) + 1):
                assert sum(i >= 50 for i in order[:n]) == math.floor(n * ds.share)
        assert ds.order(4, 0) != ds.order(4, 1) and ds.order(4, 0) == MixedDataset(main, extra, share, seed=4).order(4, 0)


class _BatchCounter(TrainingHook):
    """Counts, per micro-batch the model sees, the rows without any image token."""

    name = "batch_counter"

    def __init__(self, image_token_id):
        self.image_token_id, self.batches = image_token_id, []

    def loss(self, ctx, model, inputs):
        ids = inputs["input_ids"]
        self.batches.append((len(ids), int((~(ids == self.image_token_id).any(-1)).sum())))
        return None


def test_text_replay_mixes_the_configured_share_into_stage_2_batches(tmp_path, tokenizer):
    from interventions.adapt.config import VisionSpec

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    cfg = from_dict({"precision": "fp32", "seed": 2, "stages": [
        {"name": "stage1", "data": ["digits"], "steps": 2, "batch_size": 8, "micro_batch_size": 4, "lr": 1e-3},
        {"name": "stage2", "data": ["digits"], "steps": 5, "batch_size": 8, "micro_batch_size": 4, "lr": 1e-3}]})
    corpus = tmp_path / "corpus.jsonl"  # the demo corpus's form: {user, assistant} exchanges, assistant null = plain text
    corpus.write_text("\n".join(json.dumps({"user": f"Say {i}.", "assistant": None if i % 3 == 0 else f"{i}."}) for i in range(24)))
    replay = make_protection("text_replay", {"data": str(corpus), "share": 0.25})
    counter = _BatchCounter(tokenizer.convert_tokens_to_ids("<|image|>"))
    counter.stages = ["stage2"]
    report = adapt(tmp_path / "base", vision=VisionSpec("tiny", tiny={"hidden_size": 32, "num_hidden_layers": 1,
                                                                        "num_attention_heads": 2, "patch_size": 4}),
                   config=cfg, out=tmp_path / "run", hooks=[replay, counter], progress=False)
    assert counter.batches == [(4, 1)] * 10  # 5 steps x 2 micro-batches, each exactly 1 text row of 4
    s1, s2 = report["stages"]
    assert "text_replay" not in s1["hooks"] and s2["hooks"]["text_replay"]["replay_records"] == 24


def test_text_replay_replays_the_bases_own_replies_by_default(tmp_path, tokenizer, monkeypatch):
    """No data named: the base's self-distilled replies (interventions.adapt.selfdistill), read from their cache
    entry for this base (a tiny random base ends no reply, so the entry is written here as generation would)."""
    from interventions.adapt import selfdistill
    from interventions.adapt.config import VisionSpec
    from interventions.protect import validate_protection
    from sinkstudy.provenance import model_fingerprint

    assert validate_protection("text_replay", {})["data"] == {"selfdistill": "base"}
    monkeypatch.setenv("SINKSTUDY_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    settings = selfdistill.settings_of({"selfdistill": "base"})
    entry = selfdistill.cache_dir() / f"{selfdistill.cache_key(model_fingerprint(base), settings)}.jsonl"
    entry.parent.mkdir(parents=True)
    entry.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                      {"role": "assistant", "content": f"About that: {k}."}]}) + "\n"
                             for k, p in enumerate(selfdistill.neutral_prompts(6))))
    cfg = from_dict({"precision": "fp32", "seed": 2, "stages": [
        {"name": "stage1", "data": ["digits"], "steps": 1, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-3},
        {"name": "stage2", "data": ["digits"], "steps": 1, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-3}]})
    report = adapt(base, vision=VisionSpec("tiny", tiny={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                                          "patch_size": 4}),
                   config=cfg, out=tmp_path / "run", hooks=[make_protection("text_replay", {"share": 0.25})], progress=False)
    assert report["stages"][1]["hooks"]["text_replay"]["replay_records"] == 6


# --------------------------------------------------------------------------- engine seams the protections use

class _Calls(TrainingHook):
    name = "calls"

    def __init__(self):
        self.seen = []

    def setup(self, ctx):
        self.seen.append(ctx.stage.name)


def test_hooks_act_only_in_their_stages_and_unknown_stages_fail_before_work(tmp_path, tokenizer):
    chats = _chats(tmp_path)
    cfg = from_dict({"precision": "fp32", "stages": [{"name": n, "data": [str(chats)], "trainable": ["lm"], "steps": 1,
                                                      "batch_size": 2, "micro_batch_size": 2} for n in ("a", "b")]})
    hook = _Calls()
    hook.stages = ["b"]
    adapt(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer=tokenizer, config=cfg, out=tmp_path / "run",
          hooks=[hook], progress=False)
    assert hook.seen == ["b"]
    images = tmp_path / "with_images.jsonl"
    images.write_text(json.dumps({"image": "x.png", "conversations": [{"from": "human", "value": "<image>\nHi"},
                                                                       {"from": "gpt", "value": "Hi."}]}))
    (tmp_path / "x.png").write_bytes(b"")
    with pytest.raises(SinkstudyError, match="replay data must be text-only"):
        make_protection("text_replay", {"data": str(images), "stages": ["b"]}).dataset(
            HookContext(model=None, language_model=None, tokenizer=tokenizer, stage=cfg.stages[1], config=cfg),
            type("D", (), {"encoder": object()})())
    bad = make_protection("sink_head_freeze", {"stages": ["stage9"]})
    with pytest.raises(SinkstudyError, match="stage9"):
        adapt(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer=tokenizer, config=cfg, out=tmp_path / "bad",
              hooks=[bad], progress=False)
    assert not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------- the QK-norm sufficiency switch

def test_disable_qk_norm_gives_the_exact_llama_twin_of_qwen3_with_fitted_scales(tokenizer):
    from interventions.protect.qknorm_switch import fitted_scales, remove_qk_norm

    lm = tiny_causal_lm("qwen3", vocab_size=len(tokenizer))
    texts = [t.text for t in TEXTS]
    twin, report = remove_qk_norm(lm, tokenizer, texts)
    assert type(twin).__name__ == "LlamaForCausalLM" and not any("norm" in n for n, _ in twin.named_modules()
                                                                  if n.endswith(("q_norm", "k_norm")))
    assert report["fold_max_abs_logit_diff"] < 1e-5
    assert 0 <= report["mean_next_token_kl_to_original"] < 0.5
    # The fitted scale is the least-squares linear stand-in: better than the norm's gain alone (r = 1).
    sq, _ = fitted_scales(lm, tokenizer, texts)[0]
    assert sq.shape == (lm.config.num_attention_heads, lm.config.head_dim) and torch.isfinite(sq).all()
    # Unchanged weights elsewhere; q rows scaled by exactly the fitted factors.
    assert torch.equal(twin.model.layers[0].mlp.up_proj.weight, lm.model.layers[0].mlp.up_proj.weight)
    factor = sq.reshape(-1).float()[:, None]
    assert torch.allclose(twin.model.layers[0].self_attn.q_proj.weight, lm.model.layers[0].self_attn.q_proj.weight * factor)


def test_disable_qk_norm_in_an_adaptation_and_its_refusals(tmp_path, tokenizer):
    from interventions.pairs import load_causal_lm

    chats = _chats(tmp_path)
    report = adapt(tiny_causal_lm("qwen3", vocab_size=len(tokenizer)), tokenizer=tokenizer, config=_text_cfg(chats),
                   out=tmp_path / "off", hooks=[make_protection("disable_qk_norm")], progress=False)
    trained, _ = load_causal_lm(report["model"])
    assert type(trained).__name__ == "LlamaForCausalLM"
    info = report["stages"][0]["hooks"]["disable_qk_norm"]
    assert info["mode"] == "remove" and info["fold_max_abs_logit_diff"] < 1e-5
    base = tiny_causal_lm("qwen3", vocab_size=len(tokenizer))
    report = adapt(copy.deepcopy(base), tokenizer=tokenizer, config=_text_cfg(chats), out=tmp_path / "frozen",
                   hooks=[make_protection("disable_qk_norm", {"mode": "freeze_gains"})], progress=False)
    trained, _ = load_causal_lm(report["model"])
    for a, b in zip(base.model.layers, trained.model.layers):
        assert torch.equal(a.self_attn.q_norm.weight, b.self_attn.q_norm.weight)
        assert not torch.equal(a.self_attn.q_proj.weight, b.self_attn.q_proj.weight)
    # Gemma 3: its gains freeze (bit-identical after training); removing its norm has no twin and is refused.
    gemma = tiny_causal_lm("gemma3_text", vocab_size=len(tokenizer), tie_word_embeddings=True)
    report = adapt(copy.deepcopy(gemma), tokenizer=tokenizer, config=_text_cfg(chats), out=tmp_path / "gemma",
                   hooks=[make_protection("disable_qk_norm", {"mode": "freeze_gains"})], progress=False)
    trained, _ = load_causal_lm(report["model"])
    assert report["stages"][0]["hooks"]["disable_qk_norm"]["frozen_gain_params"] > 0
    for a, b in zip(gemma.model.layers, trained.model.layers):
        assert torch.equal(a.self_attn.k_norm.weight, b.self_attn.k_norm.weight)
        assert not torch.equal(a.self_attn.k_proj.weight, b.self_attn.k_proj.weight)
    for base, hook, needle in [(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), make_protection("disable_qk_norm"),
                                "native per-head QK-norm"),
                               (gemma, make_protection("disable_qk_norm"), "mode remove needs a Qwen3.*use mode freeze_gains")]:
        with pytest.raises(SinkstudyError, match=needle) as err:
            adapt(base, tokenizer=tokenizer, config=_text_cfg(chats), out=tmp_path / "refused", hooks=[hook], progress=False)
        assert "\n" not in str(err.value) and not (tmp_path / "refused").exists()


# --------------------------------------------------------------------------- the command line

def test_adapt_command_takes_protections_with_settings(tmp_path, tokenizer, capsys):
    from experiments.cli import main

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    chats = _chats(tmp_path)
    common = ["adapt", "--base", str(tmp_path / "base"), "--text-only", "--train-data", str(chats), "--train-steps", "2", "--quiet"]
    assert main([*common, "--protect", "sink_head_freeze", "--protect-param", "heads=[[0, 1]]",
                 "--protect-param", "keys=false", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert 'text sink_head_freeze: {"heads": [{"layer": 0, "head": 1' in out and '"frozen_rows": 32' in out  # q rows + q bias rows (keys: false)
    request = json.loads((tmp_path / "run" / "run" / "request.json").read_text())
    assert request["hooks"][0]["params"]["config"]["heads"] == [[0, 1]] and request["hooks"][0]["params"]["config"]["keys"] is False
    for extra, needle in [(["--protect", "sink_head_freeze", "--protect-param", "top_k=2"], "has no parameter"),
                          (["--protect", "a", "--protect", "b", "--protect-param", "k=1"], "unknown protection"),
                          (["--protect", "sink_head_freeze", "--protect", "text_replay", "--protect-param", "k=1"], "say which"),
                          (["--protect", "sink_head_freeze", "--protect-param", "x.k=1"], "not one of the --protect"),
                          (["--protect", "disable_qk_norm"], "native per-head QK-norm")]:
        assert main([*common, *extra, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "bad").exists()


def test_a_run_request_follows_the_content_of_the_data_files_it_names(tmp_path, tokenizer):
    """A stage's JSON data and text_replay's chats are identified by content: the same path rewritten with
    other rows is another request (the finished run is not reused), the same bytes the same request."""
    from interventions.adapt.run import make_request

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    chats = _chats(tmp_path)

    def request():
        replay = make_protection("text_replay", {"data": str(chats), "share": 0.25})
        return make_request(base, None, _text_cfg(chats), hooks=[replay])

    first = request()
    assert request() == first
    _chats(tmp_path, n=25)  # same path, one more chat
    second = request()
    assert second["config"]["stages"][0]["data"] != first["config"]["stages"][0]["data"]
    assert second["hooks"][0]["params"]["config"]["data"] != first["hooks"][0]["params"]["config"]["data"]
    assert second["hooks"][0]["params"]["config"]["share"] == 0.25
    assert first["code"].startswith("code-sha256:")
