"""The pair loader: every supported VLM's language model extracted, saved, reloaded, and equal in logits."""

import contextlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from interventions.pairs import (
    EXTRACTION_JSON, PairMismatchError, check_same_layout, extract_language_model, format_diff_table,
    load_causal_lm, load_pair, plan_extraction, save_causal_lm, weight_diff, write_language_model,
)
from sinkstudy import SinkstudyError
from sinkstudy.checkpoint import weight_files
from sinkstudy.provenance import model_fingerprint
from vlm_factories import BASE_VOCAB, EXTRA_VOCAB, VLM_TEXT_FAMILIES, save_tiny_vlm, tiny_base, tiny_vlm

CASES = [(arch, fam) for arch, fams in VLM_TEXT_FAMILIES.items() for fam in fams]
# On-disk key prefixes of the vision towers and projectors of the tiny VLMs (test oracle, read off their files).
VISION_KEYS = ("visual.", "model.visual.", "vision_tower.", "model.vision_model.", "model.vision_backbone.",
               "multi_modal_projector.", "model.connector.", "image_newline")


def _is_vision(key: str) -> bool:
    return key.startswith(VISION_KEYS)


@contextlib.contextmanager
def tensor_reads(poison=lambda key: False):
    """Record every safetensors tensor read (sinkstudy's reader and transformers' loader); raise on poisoned keys."""
    import safetensors
    import transformers.modeling_utils

    from sinkstudy import checkpoint

    reads, real_open = [], safetensors.safe_open

    class Recorder:
        def __init__(self, path, *args, **kwargs):
            self._f = real_open(path, *args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __getattr__(self, attr):
            return getattr(self._f, attr)

        def _read(self, key, how):
            if poison(key):
                raise AssertionError(f"poisoned tensor read: {key}")
            reads.append(key)
            return getattr(self._f, how)(key)

        def get_tensor(self, key):
            return self._read(key, "get_tensor")

        def get_slice(self, key):
            return self._read(key, "get_slice")

    patch = pytest.MonkeyPatch()
    patch.setattr(checkpoint, "safe_open", Recorder)
    patch.setattr(transformers.modeling_utils, "safe_open", Recorder)
    try:
        yield reads
    finally:
        patch.undo()
TARGET_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "olmo3": "Olmo3ForCausalLM"}


def _ids(seed=0, batch=2, length=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, BASE_VOCAB, (batch, length), generator=g)
    ids[:, 0] = 1  # BOS, as the tokenizer adds it
    return ids


def _save_base(path, family, tokenizer, **overrides):
    model = tiny_base(family, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory, tokenizer):
    """family -> a saved tiny base (built once per module)."""
    root, cache = tmp_path_factory.mktemp("bases"), {}

    def get(family):
        if family not in cache:
            cache[family] = _save_base(root / family, family, tokenizer)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("qwen_pair")
    return _save_base(root / "base", "qwen2", tokenizer), save_tiny_vlm(root / "vlm", "qwen2_5_vl", tokenizer=tokenizer)


@pytest.mark.parametrize("arch,family", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_extract_save_reload_matches_vlm_text_logits(tmp_path, tokenizer, base_dirs, arch, family):
    vlm_dir = save_tiny_vlm(tmp_path / "vlm", arch, family, tokenizer=tokenizer)
    base_dir = base_dirs(family)
    with tensor_reads(poison=_is_vision) as reads:  # in memory too, the vision tower is never read
        pair = load_pair(base_dir, vlm_dir, attn_implementation="eager")
    assert reads
    out = save_causal_lm(pair.vlm_lm, pair.tokenizer, tmp_path / "lm", extra={"report": pair.report.to_dict()})

    lm = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    vlm = tiny_vlm(arch, family)  # same seed: the VLM that was saved, never touched by extraction
    assert type(lm).__name__ == TARGET_CLASS[family] == type(pair.base).__name__
    assert set(lm.state_dict()) == set(pair.base.state_dict())  # same parameter names as the base
    ids = _ids()
    with torch.no_grad():
        want = vlm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = lm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert want.shape[-1] >= BASE_VOCAB and got.shape[-1] == BASE_VOCAB
    torch.testing.assert_close(got, want[..., :BASE_VOCAB], atol=1e-5, rtol=0)

    # Vocabulary: the VLM-added rows are dropped and named; tying follows the weights (Gemma ties).
    report = pair.report
    assert report.dropped_rows == [BASE_VOCAB, BASE_VOCAB + EXTRA_VOCAB]
    assert report.dropped_tokens == [f"<|vlm_{i}|>" for i in range(EXTRA_VOCAB)]
    assert report.tied is (arch == "gemma3") is lm.config.tie_word_embeddings
    assert json.loads((out / EXTRACTION_JSON).read_text())["provenance"]["model_fingerprint"].startswith("sd-sha256:")


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_text_positions_equal_1d_rope_under_left_padding(tokenizer, arch):
    # M-RoPE restarts positions at the first real token, a causal LM counts the pads too; RoPE is
    # relative, so the logits of real tokens still agree.
    vlm = tiny_vlm(arch)
    lm, _ = extract_language_model(vlm, tiny_base(VLM_TEXT_FAMILIES[arch][0]), attn_implementation="eager")
    ids = _ids(seed=3)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0
    with torch.no_grad():
        want = vlm(input_ids=ids, attention_mask=mask).logits[..., :BASE_VOCAB]
        got = lm(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=0)


def test_untied_flag_survives_tie_weights_like_hflm(tokenizer):
    # lm-eval's HFLM calls tie_weights(): with a wrong "tied" flag it would overwrite lm_head.
    lm, report = extract_language_model(tiny_vlm("internvl"), tiny_base("qwen2"))
    head = lm.lm_head.weight.detach().clone()
    lm.tie_weights()
    assert not report.tied and torch.equal(lm.lm_head.weight, head)
    assert not torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight)


def test_load_pair_of_loaded_models_follows_the_base_dtype():
    pair = load_pair(tiny_base("qwen2").to(torch.bfloat16), tiny_vlm("qwen2_5_vl"))
    assert pair.vlm_lm.dtype == torch.bfloat16 and pair.tokenizer is None
    assert pair.report.source_arch == "Qwen2_5_VLForConditionalGeneration" and pair.report.extracted


def test_vocab_padding_copies_base_rows():
    base = tiny_base("llama", vocab_size=BASE_VOCAB + EXTRA_VOCAB + 4)
    lm, report = extract_language_model(tiny_vlm("llava"), base)
    assert report.padded_rows == 4 and report.pad_source == "base" and report.dropped_rows == []
    assert torch.equal(lm.model.embed_tokens.weight[-4:], base.model.embed_tokens.weight[-4:])
    assert torch.equal(lm.lm_head.weight[-4:], base.lm_head.weight[-4:])


def test_load_causal_lm_keeps_all_rows_of_a_vlm_and_its_tokenizer(qwen_pair):
    base_dir, vlm_dir = qwen_pair
    lm, tok = load_causal_lm(vlm_dir)
    assert type(lm).__name__ == "Qwen2ForCausalLM" and lm.config.vocab_size == BASE_VOCAB + EXTRA_VOCAB
    assert len(tok) == BASE_VOCAB + EXTRA_VOCAB
    base, base_tok = load_causal_lm(base_dir, dtype="bfloat16")
    assert base.dtype == torch.bfloat16 and len(base_tok) == BASE_VOCAB


def test_tokenizer_beside_a_qwen2_model_reloads_unchanged(qwen_pair, tokenizer):
    # AutoTokenizer would force Qwen2Tokenizer here (other pre-tokenizer, one extra token).
    text = "Hello world! The answer is 8.\n  def add(a, b): <|user|> x"
    tok = load_pair(*qwen_pair).tokenizer
    assert len(tok) == len(tokenizer) and tok(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_already_extracted_dir_loads_as_pair(tmp_path, qwen_pair):
    base_dir, vlm_dir = qwen_pair
    pair = load_pair(base_dir, vlm_dir)
    out = save_causal_lm(pair.vlm_lm, pair.tokenizer, tmp_path / "lm")
    again = load_pair(base_dir, out)
    assert not again.report.extracted and again.report.dropped_rows == []
    for (name, a), b in zip(pair.vlm_lm.state_dict().items(), again.vlm_lm.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("overrides,match", [
    ({"hidden_size": 128}, r"model\.embed_tokens\.weight: base \(512, 128\) vs vlm \(512, 64\)"),
    ({"num_hidden_layers": 3}, r"model\.layers\.2\.self_attn\.q_proj\.weight: base \(4, 16, 64\) vs vlm \(missing\)"),
    ({"num_attention_heads": 8}, r"layers\.0\.self_attn\.q_proj\.weight: base \(8, 8, 64\) vs vlm \(4, 16, 64\)"),
    ({"num_key_value_heads": 4}, r"layers\.0\.self_attn\.k_proj\.weight: base \(4, 16, 64\) vs vlm \(2, 16, 64\)"),
])
def test_mismatched_pair_fails_before_reading_weights(tmp_path, tokenizer, qwen_pair, overrides, match):
    _, vlm_dir = qwen_pair
    base_dir = _save_base(tmp_path / "base", "qwen2", tokenizer, **overrides)
    with tensor_reads(poison=lambda key: True) as reads, pytest.raises(PairMismatchError, match=match) as info:
        load_pair(base_dir, vlm_dir)
    assert "\n" not in str(info.value) and reads == []


def test_family_mismatch_and_check_same_layout_on_models(qwen_pair, tmp_path, tokenizer):
    _, vlm_dir = qwen_pair
    llama_dir = _save_base(tmp_path / "llama", "llama", tokenizer)
    with pytest.raises(PairMismatchError, match="qwen2_5_vl_text.*qwen2 but the base is llama"):
        load_pair(llama_dir, vlm_dir)
    check_same_layout(tiny_base("qwen2"), tiny_base("qwen2", seed=5))
    check_same_layout(base_dir := qwen_pair[0], vlm_dir, ignore_vocab=True)  # paths; a VLM as its extracted LM
    with pytest.raises(PairMismatchError, match=r"embed_tokens\.weight: base \(512, 64\) vs vlm \(520, 64\)"):
        check_same_layout(base_dir, vlm_dir)
    with pytest.raises(PairMismatchError, match=r"mlp\.gate_proj\.weight: base \(128, 64\) vs vlm \(96, 64\)"):
        check_same_layout(tiny_base("qwen2"), tiny_base("qwen2", intermediate_size=96))


def test_unknown_unsupported_and_missing_inputs(tmp_path, qwen_pair):
    base_dir, _ = qwen_pair
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "internvl_chat"}))
    with pytest.raises(SinkstudyError, match=r"unsupported architecture 'internvl_chat'.*-hf.*supported VLMs: .*Qwen2\.5-VL"):
        load_pair(base_dir, unknown)
    blip = tmp_path / "blip"
    from transformers import Blip2Config

    Blip2Config().save_pretrained(blip)
    with pytest.raises(SinkstudyError, match=r"unsupported architecture 'blip-2'.*Molmo2"):
        load_pair(base_dir, blip)
    with pytest.raises(SinkstudyError, match="missing path: .*/nope does not exist"):
        load_pair(base_dir, tmp_path / "nope")
    with pytest.raises(SinkstudyError, match="has no config.json"):
        load_causal_lm(tmp_path)
    with pytest.raises(SinkstudyError, match="no-such-org/no-such-vlm': no such local path, and the hub could not"):
        load_pair(base_dir, "no-such-org/no-such-vlm")  # offline in tests


def test_weight_diff_measures_a_known_change():
    base = tiny_base("qwen3")
    other = tiny_base("qwen3")
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight.mul_(1.25)
        other.model.layers[0].mlp.up_proj.weight.add_(1.0)
    before = {n: t.clone() for n, t in other.state_dict().items()}
    rows = {r["name"]: r for r in weight_diff(base, other)}
    assert all(torch.equal(t, before[n]) for n, t in other.state_dict().items())  # read-only
    k = rows["model.layers.1.self_attn.k_proj.weight"]
    assert k["group"] == "k" and k["layer"] == 1 and k["rel_change"] == pytest.approx(0.25, rel=1e-6)
    up = base.model.layers[0].mlp.up_proj.weight
    assert rows["model.layers.0.mlp.up_proj.weight"]["rel_change"] == pytest.approx(up.numel() ** 0.5 / float(up.detach().norm()), rel=1e-5)
    assert rows["model.layers.0.self_attn.q_norm.weight"]["group"] == "norm"
    assert rows["model.embed_tokens.weight"]["layer"] is None and rows["lm_head.weight"]["group"] == "lm_head"
    changed = {n for n, r in rows.items() if r["rel_change"]}
    assert changed == {"model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    table = format_diff_table(list(rows.values()))
    assert table.splitlines()[0].split() == ["layer", "q", "k", "v", "o", "mlp", "norm", "embed", "lm_head"]
    assert "0.2500" in table.splitlines()[3]  # layer 1 row


def test_weight_diff_counts_tied_head_once():
    base, other = tiny_base("gemma3_text"), tiny_base("gemma3_text", seed=2)
    groups = [r["group"] for r in weight_diff(base, other)]
    assert "embed" in groups and "lm_head" not in groups


def test_cli_extract_and_diff(tmp_path, qwen_pair, capsys):
    from experiments.cli import main

    base_dir, vlm_dir = qwen_pair
    out = tmp_path / "lm"
    assert main(["pair", "extract", "--base", str(base_dir), "--vlm", str(vlm_dir), "--out", str(out)]) == 0
    assert "dropped rows 512..519" in capsys.readouterr().out
    lm = AutoModelForCausalLM.from_pretrained(out)
    assert lm.config.vocab_size == BASE_VOCAB
    before = (out / "model.safetensors").read_bytes()
    argv = ["pair", "extract", "--base", str(base_dir), "--vlm", str(vlm_dir), "--out", str(out)]
    assert main(argv) == 0  # one step of the engine: the same extraction is reused, its report said again
    printed = capsys.readouterr().out
    assert "reused pair/extract (finished before" in printed and "dropped rows 512..519" in printed
    assert main([*argv, "--dtype", "bfloat16"]) == 2  # another request into it: one line, nothing touched
    assert "holds pair/extract made by another request (dtype differ); pass --force" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    assert main([*argv, "--force"]) == 0 and (out / "model.safetensors").read_bytes() == before  # made again: the same bytes

    report = tmp_path / "diff.json"
    assert main(["pair", "diff", "--base", str(base_dir), "--vlm", str(out), "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert f"\nwrote {report}\n── sinkstudy pair diff: largest relative change " in printed and "lm_head" in printed
    data = json.loads(report.read_text())
    assert data["provenance"]["extraction"]["extracted"] is False and data["provenance"]["base_fingerprint"]
    # The CLI's numbers are the Python API's numbers.
    pair = load_pair(base_dir, out)
    expected = {r["name"]: r["rel_change"] for r in weight_diff(pair.base, pair.vlm_lm)}
    assert {r["name"]: r["rel_change"] for r in data["rows"]} == pytest.approx(expected)
    assert main(["pair", "diff", "--base", str(base_dir), "--vlm", str(out), "--json", str(report)]) == 2


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


@pytest.mark.parametrize("arch,family", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_streamed_extraction_of_a_sharded_vlm_reads_only_the_language_model(tmp_path, tokenizer, base_dirs, arch, family):
    vlm_dir = save_tiny_vlm(tmp_path / "vlm", arch, family, tokenizer=tokenizer, max_shard_size="40KB")
    assert len(weight_files(vlm_dir).files) > 2  # a real index with several shards
    with tensor_reads(poison=_is_vision) as reads:
        plan = plan_extraction(vlm_dir, base_dirs(family))
        assert reads == []  # planning reads headers only
        out = write_language_model(plan, tmp_path / "lm", max_shard_bytes=60_000)
    lm_keys = [k for k in weight_files(vlm_dir).tensors if not _is_vision(k)]
    assert sorted(set(reads)) == sorted(lm_keys)  # every language-model tensor, nothing else
    written = weight_files(out)
    assert written.indexed and len(written.files) > 1 and written.float_dtype() == "float32"
    lm = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = _ids()
    torch.testing.assert_close(_logits(lm, ids), _logits(tiny_vlm(arch, family), ids)[..., :BASE_VOCAB], atol=1e-5, rtol=0)
    meta = json.loads((out / EXTRACTION_JSON).read_text())
    assert meta["provenance"]["model_fingerprint"] == model_fingerprint(out) and meta["model_class"] == TARGET_CLASS[family]


def test_the_study_extract_step_streams_and_never_builds_the_vision_tower(tmp_path, tokenizer, base_dirs, monkeypatch):
    """`sinkstudy run`'s extract step: no vision tensor read, the vision tower only ever on the meta device
    (a weightless layout), the language model never built in memory; the written LM equals the VLM's."""
    from types import SimpleNamespace

    from experiments.study.kinds import Ref
    from experiments.study.pair_steps import Extract

    vlm_dir = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl", "qwen2", tokenizer=tokenizer, max_shard_size="40KB")
    reference = tiny_vlm("qwen2_5_vl", "qwen2")
    tower, real_init, towers_built = type(reference.model.visual), type(reference.model.visual).__init__, []

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        towers_built.append({p.device.type for p in self.parameters()})

    def no_in_memory_lm(*args, **kwargs):
        raise AssertionError("the extract step built the language model in memory")

    monkeypatch.setattr(tower, "__init__", recording_init)
    monkeypatch.setattr("interventions.pairs.extract.build_causal_lm", no_in_memory_lm)
    monkeypatch.setattr("interventions.pairs.loading.build_causal_lm", no_in_memory_lm)
    base, out = base_dirs("qwen2"), tmp_path / "lm"
    with tensor_reads(poison=_is_vision) as reads:
        result = Extract(Ref(str(base)), Ref(str(vlm_dir)), "bfloat16", out=out).run(SimpleNamespace(progress=False))
    assert reads and all(devices == {"meta"} for devices in towers_built)
    assert result["fingerprint"] == model_fingerprint(out) and result["path"] == str(out)
    assert result["report"]["target_class"] == "Qwen2ForCausalLM" and result["report"]["dropped_rows"] == [BASE_VOCAB, BASE_VOCAB + EXTRA_VOCAB]
    assert {t.dtype for t in weight_files(out).tensors.values()} == {"BF16"}  # the study's dtype
    assert json.loads((out / EXTRACTION_JSON).read_text())["provenance"]["extraction"] == result["report"]
    lm = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    expected = _logits(reference.to(torch.bfloat16).float(), _ids())[..., :BASE_VOCAB]
    torch.testing.assert_close(_logits(lm, _ids()), expected, atol=1e-5, rtol=0)


def test_streamed_extraction_keeps_the_checkpoint_dtype_unless_told(tmp_path, tokenizer, base_dirs):
    vlm_dir = save_tiny_vlm(tmp_path / "vlm", "llava", "qwen2", tokenizer=tokenizer, dtype=torch.bfloat16)
    plan = plan_extraction(vlm_dir, base_dirs("qwen2"))
    bf16 = write_language_model(plan, tmp_path / "bf16")
    assert {t.dtype for t in weight_files(bf16).tensors.values()} == {"BF16"}
    lm = AutoModelForCausalLM.from_pretrained(bf16)
    assert lm.dtype == torch.bfloat16
    ref, _ = extract_language_model(tiny_vlm("llava", "qwen2").to(torch.bfloat16), tiny_base("qwen2"))
    assert all(torch.equal(t, ref.state_dict()[n]) for n, t in lm.state_dict().items())  # bit-identical bf16
    fp32 = write_language_model(plan, tmp_path / "fp32", dtype="float32")
    assert {t.dtype for t in weight_files(fp32).tensors.values()} == {"F32"}
    with pytest.raises(SinkstudyError, match="already exists; pass --force"):
        write_language_model(plan, tmp_path / "fp32")


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_extracted_config_is_the_bases_with_the_vlms_real_changes(tmp_path, tokenizer, arch):
    # Released Qwen2-VL / Qwen2.5-VL configs carry `rope_scaling: {"type": "mrope", ...}` and their own θ.
    vlm_dir = save_tiny_vlm(tmp_path / "vlm", arch, tokenizer=tokenizer)
    cfg = json.loads((vlm_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text.pop("rope_parameters", None)
    text["rope_theta"] = 10000.0
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [4, 2, 2]}
    (vlm_dir / "config.json").write_text(json.dumps(cfg))
    base_dir = _save_base(tmp_path / "base", "qwen2", tokenizer, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                          max_position_embeddings=777, initializer_range=0.05)
    plan = plan_extraction(vlm_dir, base_dir)
    out = write_language_model(plan, tmp_path / "lm")
    saved = (out / "config.json").read_text()
    assert "mrope" not in saved
    config = json.loads(saved)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}  # the VLM's θ
    assert config["max_position_embeddings"] == 777 or "max_position_embeddings" in plan.report.config_changes
    assert config["initializer_range"] == 0.05  # not a VLM setting: the base's
    assert plan.report.config_changes["rope_parameters"] == [{"rope_type": "default", "rope_theta": 1e6},
                                                             {"rope_type": "default", "rope_theta": 10000.0}]
    assert "initializer_range" not in plan.report.config_changes and "vocab_size" not in plan.report.config_changes
    config_line = next(line for line in plan.report.summary().splitlines() if line.startswith("config: the base's, with the VLM's"))
    assert "rope_parameters {'rope_theta': 1000000.0, 'rope_type': 'default'} -> {'rope_theta': 10000.0" in config_line
    lm = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    vlm = AutoModelForImageTextToText.from_pretrained(vlm_dir, attn_implementation="eager").eval()
    ids = _ids()
    torch.testing.assert_close(_logits(lm, ids), _logits(vlm, ids)[..., :BASE_VOCAB], atol=1e-5, rtol=0)


def test_pair_diff_streams_and_matches_the_in_memory_diff(tmp_path, qwen_pair, capsys, monkeypatch):
    from transformers import AutoModelForImageTextToText as VLMAuto

    from experiments.cli import main

    base_dir, _ = qwen_pair
    vlm_dir = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl", max_shard_size="40KB")
    expected = {r["name"]: r["rel_change"] for r in weight_diff(*_loaded_pair(base_dir, vlm_dir))}

    def refuse(*args, **kwargs):
        raise AssertionError("pair diff loaded a whole model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(VLMAuto, "from_pretrained", refuse)
    report = tmp_path / "diff.json"
    with tensor_reads(poison=_is_vision):
        assert main(["pair", "diff", "--base", str(base_dir), "--vlm", str(vlm_dir), "--json", str(report)]) == 0
    rows = {r["name"]: r["rel_change"] for r in json.loads(report.read_text())["rows"]}
    assert rows == pytest.approx(expected) and len(rows) == len(expected)
    assert "lm_head" in capsys.readouterr().out


def _loaded_pair(base_dir, vlm_dir):
    pair = load_pair(base_dir, vlm_dir)
    return pair.base, pair.vlm_lm
