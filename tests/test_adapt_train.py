"""Training stages on HF Trainer: label-only logits give the full-logit loss; only assistant positions
count; each stage changes exactly the parameters it may (frozen tensors bit-identical, also under
AdamW weight decay); the hook seam runs where documented; a killed run resumes to the same weights;
the trajectory has S at every eval step."""

import copy
import shutil

import pytest
import torch

from interventions.adapt import FreezeParameters, TrainingHook, adapt, from_dict
from interventions.adapt import encoding, sources
from interventions.adapt.build import build_vlm
from interventions.adapt.config import VisionSpec
from interventions.adapt.vlm_io import parameter_groups
from interventions.adapt.trainer import label_only_loss, train_stage
from sinkstudy.tiny import tiny_causal_lm

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 4}
QA = [{"role": "user", "content": "<image>\nWhat digit is this?"}, {"role": "assistant", "content": "It is a 3."}]


def _batch(built, n=4):
    enc = encoding.Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token)
    feats = [enc(r) for r in sources.digits_records("heldout", n_heldout=n)]
    feats.append(enc({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                                   {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."},
                                   {"role": "assistant", "content": "Hi again."}]}))
    return encoding.collate(feats, built.tokenizer.pad_token_id)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_label_only_logits_give_the_full_logit_loss(tokenizer, family):
    kw = {"tie_word_embeddings": True, "final_logit_softcapping": 5.0} if family == "gemma3_text" else {}
    base = tiny_causal_lm(family, vocab_size=len(tokenizer), **kw)
    built = build_vlm(base, tokenizer, VisionSpec("tiny", tiny=TINY))
    batch = _batch(built)
    labels = batch.pop("labels")
    with torch.no_grad():
        ours, _ = label_only_loss(built.model, batch, labels)
        logits = built.model(**batch).logits.float()
        full = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        causal = built.model(**batch, labels=labels).loss
    assert torch.allclose(ours, full, atol=1e-5) and torch.allclose(ours, causal, atol=1e-5)


def test_loss_ignores_logits_at_non_assistant_positions(tokenizer):
    """Noise added to the final hidden state at every position whose next token is not an assistant
    target leaves the loss unchanged; the same noise at one target position changes it."""
    built = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, VisionSpec("tiny", tiny=TINY))
    batch = _batch(built)
    labels = batch.pop("labels")
    target = torch.zeros_like(labels, dtype=torch.bool)
    target[:, :-1] = labels[:, 1:] != -100
    assert target.any() and (~target & batch["attention_mask"].bool()).sum() > 2 * target.sum()

    def loss_with_noise(where):
        def hook(module, args, output):
            noise = torch.randn(output.shape, generator=torch.Generator().manual_seed(0)) * 10
            return output + noise * where[..., None]

        h = built.model.get_decoder().norm.register_forward_hook(hook)
        try:
            with torch.no_grad():
                return label_only_loss(built.model, batch, labels)[0]
        finally:
            h.remove()

    clean = loss_with_noise(torch.zeros_like(target))
    assert torch.equal(loss_with_noise(~target), clean)
    one = torch.zeros_like(target)
    one[target.nonzero()[0][0], target.nonzero()[0][1]] = True
    assert not torch.allclose(loss_with_noise(one), clean)


def _stage_cfg(**stages):
    return from_dict({"precision": "fp32", "stages": [{"name": n, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-2,
                                                        "weight_decay": 0.1, **s} for n, s in stages.items()]})


def test_two_stages_change_exactly_what_each_stage_allows(tokenizer):
    built = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, VisionSpec("tiny", tiny=TINY))
    vlm = built.model
    config = _stage_cfg(stage1={"steps": 3}, stage2={"steps": 3})
    enc = encoding.Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token)
    ds = encoding.EncodedDataset([sources.load_records("digits")], enc)
    collate = lambda f: encoding.collate(f, tokenizer.pad_token_id)  # noqa: E731
    groups = parameter_groups(vlm)
    changed = {}
    for stage in config.stages:
        before = {n: p.detach().clone() for n, p in vlm.named_parameters()}
        import tempfile

        with tempfile.TemporaryDirectory() as work:
            stats = train_stage(vlm, stage, config, ds, collate_fn=collate, work_dir=work, tokenizer=tokenizer, progress=False)
        changed[stage.name] = {n for n, p in vlm.named_parameters() if not torch.equal(p, before[n])}
        assert stats["steps"] == 3 and stats["effective_batch"] == 4
    assert changed["stage1"] == groups["projector"]
    allowed2 = groups["projector"] | groups["lm"]
    assert changed["stage2"] <= allowed2 and not (changed["stage2"] & groups["tower"])
    # Every LM matrix moved except rows no batch touched (embeddings of unseen tokens keep their values? no:
    # AdamW's decoupled decay moves every trained tensor), so all of them changed.
    assert changed["stage2"] == allowed2
    assert all(p.requires_grad for p in vlm.parameters()) and not vlm.training


def test_a_group_lr_is_the_initial_lr_of_that_group_alone(tokenizer, tmp_path):
    """One AdamW step moves each parameter by about its lr (the first step's update is lr × g / (|g| + eps)): with
    `group_lr: {projector: 1e-2}` and lr 1e-5 the projector moves by up to 1e-2 and the LM by up to 1e-5."""
    built = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, VisionSpec("tiny", tiny=TINY))
    vlm = built.model
    config = _stage_cfg(stage2={"steps": 1, "lr": 1e-5, "weight_decay": 0.0, "schedule": "constant", "warmup_ratio": 0.0,
                                "trainable": ["projector", "lm"], "group_lr": {"projector": 1e-2}})
    enc = encoding.Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token)
    ds = encoding.EncodedDataset([sources.load_records("digits")], enc)
    groups = parameter_groups(vlm)
    before = {n: p.detach().clone() for n, p in vlm.named_parameters()}
    train_stage(vlm, config.stages[0], config, ds, collate_fn=lambda f: encoding.collate(f, tokenizer.pad_token_id),
                work_dir=tmp_path, tokenizer=tokenizer, progress=False)
    moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in vlm.named_parameters()}
    projector = max(moved[n] for n in groups["projector"])
    lm = max(moved[n] for n in groups["lm"])
    assert 0.5e-2 < projector < 1.01e-2 and 0.5e-5 < lm < 1.01e-5  # float32 rounding of the weights aside
    with pytest.raises(Exception, match="group_lr"):
        _stage_cfg(stage2={"trainable": ["lm"], "group_lr": {"projector": 1e-2}})


class _Recorder(TrainingHook):
    """Masks the gradient of lm_head rows 0..9 after backward and restores them after each optimizer
    step (AdamW's weight decay would move them otherwise); adds a constant to the loss."""

    name = "recorder"
    edits_training = True

    def __init__(self):
        self.calls = []

    def setup(self, ctx):
        self.calls.append("setup")
        head = ctx.model.get_output_embeddings().weight
        ctx.state["rows"] = head.detach()[:10].clone()
        assert ctx.sink_maps is None and ctx.language_model is ctx.model.get_decoder()

    def loss(self, ctx, model, inputs):
        self.calls.append("loss")
        return torch.tensor(0.5)

    def after_backward(self, ctx):
        self.calls.append("after_backward")
        grad = ctx.model.get_output_embeddings().weight.grad
        ctx.log({"grad_norm_rows": float(grad[:10].norm())})
        grad[:10] = 0

    def after_optimizer_step(self, ctx):
        self.calls.append("after_optimizer_step")
        with torch.no_grad():
            ctx.model.get_output_embeddings().weight[:10] = ctx.state["rows"]

    def teardown(self, ctx):
        return {"steps_seen": self.calls.count("after_optimizer_step")}


def test_hook_seam_order_and_bit_identical_rows_under_weight_decay(tokenizer, tmp_path):
    built = build_vlm(tiny_causal_lm("qwen2", vocab_size=len(tokenizer)), tokenizer, VisionSpec("tiny", tiny=TINY))
    vlm = built.model
    config = _stage_cfg(stage2={"steps": 2, "trainable": ["projector", "lm"]})
    enc = encoding.Encoder(built.tokenizer, processor=built.processor, image_token=built.image_token)
    ds = encoding.EncodedDataset([sources.load_records("digits")], enc)
    head0 = vlm.get_output_embeddings().weight.detach().clone()
    emb0 = vlm.get_input_embeddings().weight.detach().clone()
    rec = _Recorder()
    stats = train_stage(vlm, config.stages[0], config, ds, collate_fn=lambda f: encoding.collate(f, 0), work_dir=tmp_path,
                        tokenizer=tokenizer, hooks=[rec, FreezeParameters([r"embed_tokens"])], progress=False)
    head = vlm.get_output_embeddings().weight
    assert torch.equal(head[:10], head0[:10]) and not torch.equal(head[10:], head0[10:])
    assert torch.equal(vlm.get_input_embeddings().weight, emb0)  # frozen by the hook: out of the optimizer
    # 2 steps x 2 micro-batches: loss per micro-batch, after_backward / after_step once per step.
    assert rec.calls == ["setup"] + ["loss", "loss", "after_backward", "after_optimizer_step"] * 2
    assert stats["hooks"] == {"recorder": {"steps_seen": 2}, "freeze": {"frozen": 1}}
    assert [e["step"] for e in stats["hook_logs"]["recorder"]] == [0, 1]


class _KillAt(__import__("transformers").TrainerCallback):
    def __init__(self, stage_name, step):
        self.stage_name, self.step = stage_name, step

    def on_step_end(self, args, state, control, **kw):
        if args.output_dir.endswith(self.stage_name) and state.global_step == self.step:
            raise KeyboardInterrupt("killed")


def _run_cfg():
    return from_dict({"precision": "fp32", "seed": 3, "trajectory": {"every": 2}, "stages": [
        {"name": "stage1", "data": ["digits"], "steps": 4, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-2, "save_steps": 2},
        {"name": "stage2", "data": ["digits"], "steps": 5, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-2,
         "weight_decay": 0.1, "save_steps": 2}]})


def test_kill_and_resume_ends_bit_identical_with_s_at_every_eval_step(tmp_path, tokenizer):
    from safetensors.torch import load_file

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    vision = VisionSpec("tiny", tiny=TINY)
    whole = adapt(tmp_path / "base", vision=vision, config=_run_cfg(), out=tmp_path / "whole", progress=False)
    with pytest.raises(KeyboardInterrupt):
        adapt(tmp_path / "base", vision=vision, config=_run_cfg(), out=tmp_path / "killed", progress=False,
              callbacks=[_KillAt("stage2", 3)])
    assert (tmp_path / "killed" / "work" / "stage1" / "done.json").is_file()
    with pytest.raises(Exception, match="pass --resume"):
        adapt(tmp_path / "base", vision=vision, config=_run_cfg(), out=tmp_path / "killed", progress=False)
    resumed = adapt(tmp_path / "base", vision=vision, config=_run_cfg(), out=tmp_path / "killed", resume=True, progress=False)
    assert resumed["stages"][1]["resumed_from"].endswith("checkpoint-2")
    a, b = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in ("whole", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for report in (whole, resumed):
        points = report["trajectory"]["points"]
        assert [p["step"] for p in points] == [0, 2, 4, 6, 8, 9]  # stage 1: 0..4, stage 2: 4 + (2, 4, 5)
        assert all(isinstance(p["sink_strength"], float) for p in points)
    assert [p["sink_strength"] for p in whole["trajectory"]["points"]] == [p["sink_strength"] for p in resumed["trajectory"]["points"]]
    assert (tmp_path / "whole" / "trajectory.png").stat().st_size > 1000
    assert not (tmp_path / "whole" / "work").exists()  # checkpoints removed once done
    # Nothing is reused or replaced here (the engine decides that for the step that adapts): a run of the same request
    # continues only when asked, another request's folder is refused.
    with pytest.raises(Exception, match="pass --resume"):
        adapt(tmp_path / "base", vision=vision, config=_run_cfg(), out=tmp_path / "whole", progress=False)
    other = _run_cfg()
    other.stages[1].lr = 2e-2
    with pytest.raises(Exception, match="holds no run of this request"):
        adapt(tmp_path / "base", vision=vision, config=other, out=tmp_path / "whole", resume=True, progress=False)


class _Stage2Steps(TrainingHook):
    """A stage-2 hook that only counts steps: another run's identity, the same stage 1."""

    name = "stage2_steps"
    stages = ["stage2"]

    def after_optimizer_step(self, ctx):
        ctx.state["n"] = ctx.state.get("n", 0) + 1


class _Stage1Trainings(TrainingHook):
    name = "stage1_trainings"

    def __init__(self):
        self.setups = []

    def setup(self, ctx):
        self.setups.append(ctx.stage.name)


def test_runs_share_a_finished_stage_through_the_stage_cache_and_end_bit_identical(tmp_path, tokenizer):
    """Two arms differing only in stage 2 train stage 1 once; the second arm's weights and S trajectory equal
    those of the same run without the cache; a hook acting in stage 1 keys it apart."""
    from safetensors.torch import load_file

    from interventions.adapt import stagecache

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    vision, cache = VisionSpec("tiny", tiny=TINY), tmp_path / "stages"

    def run(name, hooks, shared):
        return adapt(tmp_path / "base", vision=vision, config=_run_cfg(), out=tmp_path / name, progress=False, hooks=hooks,
                     stage_cache=cache if shared else None)

    run("control", [], True)
    assert len(list(cache.iterdir())) == 2  # stage 1 and stage 2 stored
    watch = _Stage1Trainings()
    watch.stages = ["stage2"]
    shared = run("arm", [_Stage2Steps(), watch], True)
    assert watch.setups == ["stage2"]  # stage 1 came from the cache
    alone = run("alone", [_Stage2Steps()], False)
    a, b = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in ("arm", "alone"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert shared["trajectory"]["points"] == alone["trajectory"]["points"]
    assert [s["steps"] for s in shared["stages"]] == [4, 5]
    shutil.copytree(tmp_path / "base", tmp_path / "elsewhere")  # the same weights at another path: both stages reused
    moved = _Stage1Trainings()
    moved.stages = ["stage2"]
    adapt(tmp_path / "elsewhere", vision=vision, config=_run_cfg(), out=tmp_path / "moved", progress=False,
          hooks=[_Stage2Steps(), moved], stage_cache=cache)
    assert moved.setups == []
    c = load_file(str(tmp_path / "moved" / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)
    early = _Stage1Trainings()  # acts in stage 1 (every stage): stage 1 is trained again, not reused
    run("early", [early], True)
    assert early.setups == ["stage1", "stage2"]
    assert len(list(cache.iterdir())) == 5  # control's two stages, the arm's stage 2, early's two
    assert all(stagecache.lookup(cache, e.name) for e in cache.iterdir())


def test_text_only_run_trains_the_causal_lm(tmp_path, tokenizer):
    import json

    from interventions.pairs import load_causal_lm

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Add {i} and 1."},
                                                        {"role": "assistant", "content": str(i + 1)}]}) for i in range(20)))
    cfg = from_dict({"precision": "fp32", "stages": [{"name": "text", "data": [str(chats)], "trainable": ["lm"], "steps": 2,
                                                      "batch_size": 4, "micro_batch_size": 4, "lr": 1e-2}]})
    seen = _SinkMapsSeen()
    report = adapt(copy.deepcopy(base), tokenizer=tokenizer, config=cfg, out=tmp_path / "run", hooks=[seen], progress=False)
    trained, _ = load_causal_lm(report["model"])
    assert type(trained).__name__ == "Qwen2ForCausalLM" and report["build"] == {"kind": "text-only"}
    assert not torch.equal(trained.lm_head.weight, base.lm_head.weight)
    # The base's sink maps reach a hook that asks for them; the hook is part of the run's identity.
    assert seen.shape == (2, 4) and report["stages"][0]["hooks"] == {"sink_maps_seen": {"layers": 2}}
    assert report["hooks"][0]["name"] == "sink_maps_seen" and report["hooks"][0]["source_sha256"].startswith("plugin-sha256:")


class _SinkMapsSeen(TrainingHook):
    name = "sink_maps_seen"
    needs_sink_maps = True

    def setup(self, ctx):
        self.shape = tuple(ctx.sink_maps.mass.shape)

    def teardown(self, ctx):
        return {"layers": ctx.sink_maps.num_layers}


def _kept_cfg(steps: int, keep: list[int]):
    cfg = _run_cfg()
    cfg.stages[1].steps, cfg.stages[1].save_models_at = steps, keep
    cfg.stages[1].schedule, cfg.stages[1].warmup_ratio = "constant", 0.0  # the lr at step k does not depend on the length
    return cfg


def test_a_kept_model_is_the_model_at_that_step_and_survives_the_stage_cache(tmp_path, tokenizer):
    """`save_models_at: [2, 4]` in a 5-step stage keeps the model after steps 2 and 4: the kept model after step 2
    is bit-identical to the model of the same run stopped at 2 steps (constant lr: the schedule does not depend on the
    length); a second run reusing the stage from the stage cache gets the same kept models."""
    from safetensors.torch import load_file

    from interventions.adapt.run import snapshot_dir

    base = tiny_causal_lm("qwen2", vocab_size=len(tokenizer))
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    vision, cache = VisionSpec("tiny", tiny=TINY), tmp_path / "stages"
    long = adapt(tmp_path / "base", vision=vision, config=_kept_cfg(5, [2, 4]), out=tmp_path / "long", progress=False,
                 stage_cache=cache)
    short = adapt(tmp_path / "base", vision=vision, config=_kept_cfg(2, []), out=tmp_path / "short", progress=False)
    assert [(s["stage"], s["stage_step"], s["step"]) for s in long["snapshots"]] == [("stage2", 2, 6), ("stage2", 4, 8)]
    weights = lambda d: load_file(str(d / "model.safetensors"))
    kept2, kept4, end2, end5 = (weights(d) for d in (snapshot_dir(tmp_path / "long", "stage2", 2),
                                                     snapshot_dir(tmp_path / "long", "stage2", 4),
                                                     tmp_path / "short" / "model", tmp_path / "long" / "model"))
    assert kept2.keys() == end2.keys() and all(torch.equal(kept2[k], end2[k]) for k in kept2)
    lm = [k for k in kept2 if "layers" in k and "vision" not in k]
    assert lm
    assert any(not torch.equal(kept2[k], kept4[k]) for k in lm) and any(not torch.equal(kept4[k], end5[k]) for k in lm)
    assert (snapshot_dir(tmp_path / "long", "stage2", 2) / "processor_config.json").is_file()  # a whole VLM with its processor
    again = adapt(tmp_path / "base", vision=vision, config=_kept_cfg(5, [2, 4]), out=tmp_path / "again", progress=False,
                  stage_cache=cache)
    assert [s["fingerprint"] for s in again["snapshots"]] == [s["fingerprint"] for s in long["snapshots"]]
    for bad in ([5], [4, 2], [0]):  # the stage's own end, out of order, not a step
        with pytest.raises(Exception, match="save_models_at"):
            from_dict(_kept_cfg(5, bad).to_dict())
