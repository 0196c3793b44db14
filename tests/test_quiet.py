"""One --quiet on every command silences every progress bar, the libraries' too (transformers' loading /
saving bars, lm-eval's request bars, datasets'), and the libraries' log chatter (lm-eval's per-eval warnings,
mergekit's INFO lines); sinkstudy's own warnings still show. Without it the bars and the libraries' lines show."""

import logging
import os
import warnings

import pytest


def test_quiet_disables_every_tqdm_bar_and_puts_everything_back():
    from tqdm import tqdm
    from tqdm.auto import tqdm as auto_tqdm
    from transformers.utils import logging as hf_logging

    from sinkstudy.progress import quiet

    before = os.environ.get("TQDM_DISABLE")
    with quiet():
        # lm-eval creates its request bars with an explicit disable=False: that one must go too.
        bars = [tqdm(total=3, disable=False), auto_tqdm(range(2)), hf_logging.tqdm(total=2), tqdm(None, "d", 3, True, None, None, 0.1,
                                                                                                   10.0, None, None, False)]
        assert all(b.disable for b in bars)
        assert os.environ["TQDM_DISABLE"] == "1" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    shown = tqdm(total=3, disable=False)
    assert not shown.disable and os.environ.get("TQDM_DISABLE") == before
    shown.close()
    with quiet(False):
        assert not tqdm(total=1, disable=False).disable


def test_quiet_keeps_the_libraries_errors_only_and_our_warnings(caplog):
    from sinkstudy.progress import quiet

    def emit():
        caplog.clear()
        logging.getLogger("lm_eval.evaluator").warning("Ensure 'do_sample=True' for non-greedy decoding!")
        logging.getLogger("mergekit.merge").info("Planning operations")
        logging.getLogger().info("Base model specified but not in input models - adding")  # mergekit, through root
        logging.getLogger("transformers.configuration_utils").warning("`torch_dtype` is deprecated!")
        logging.getLogger("lm_eval.api.task").error("a library's error")
        logging.getLogger("interventions.protect.heads").warning("no attention sink")
        return [r.getMessage() for r in caplog.records]

    caplog.set_level(logging.INFO)
    loud = emit()
    assert len(loud) == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet():
            assert emit() == ["a library's error", "no attention sink"]
            assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"  # for a library first imported inside, and workers
            warnings.warn_explicit("deprecated", FutureWarning, "x.py", 1, module="transformers.modeling_utils")
            warnings.warn_explicit("a model without a sink", UserWarning, "x.py", 1, module="interventions.protect.heads")
        assert [str(w.message) for w in caught] == ["a model without a sink"]
    assert emit() == loud and "TRANSFORMERS_VERBOSITY" not in os.environ


def test_a_real_mergekit_merge_logs_nothing_below_error_under_quiet(tokenizer, tmp_path, caplog):
    from interventions.merge import run_mergekit_merge
    from sinkstudy.progress import quiet
    from sinkstudy.tiny import tiny_causal_lm

    for name, seed in (("base", 1), ("vlm", 2)):
        tiny_causal_lm("qwen2", seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    caplog.set_level(logging.INFO)
    run_mergekit_merge("linear", tmp_path / "base", tmp_path / "vlm", tmp_path / "loud", progress=False)
    assert any(r.name.startswith("mergekit") for r in caplog.records)  # mergekit's INFO lines by default
    caplog.clear()
    with quiet():
        run_mergekit_merge("linear", tmp_path / "base", tmp_path / "vlm", tmp_path / "quiet", progress=False)
    assert [r for r in caplog.records if r.levelno < logging.ERROR] == []


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    path = tmp_path_factory.mktemp("quiet") / "tiny-llama"
    tiny_causal_lm("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_eval_shows_lm_evals_bars_and_warnings_by_default_and_none_with_quiet(tiny_model_dir, tmp_path, capsys, caplog):
    from experiments.cli import main

    argv = ["eval", str(tiny_model_dir), "--tasks", "sinkstudy_gsm", "--limit", "1", "--max-gen-toks", "4", "--no-chat-template",
            "--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--out", str(tmp_path / "loud")]) == 0
    assert "Running generate_until requests" in capsys.readouterr().err  # progress stays on by default
    assert any("Ensure 'do_sample=True'" in r.getMessage() for r in caplog.records)  # and lm-eval's warnings
    caplog.clear()
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--no-cache", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "Running generate_until requests" not in err and "it/s]" not in err, err
    assert [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.name.startswith("lm_eval")] == []
