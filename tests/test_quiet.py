"""Issue 24 item 5: one --quiet on every command silences every progress bar, the libraries' too
(transformers' loading / saving bars, lm-eval's request bars, datasets'); without it the bars show."""

import os

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


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    from sinkstudy.tiny import tiny_causal_lm

    path = tmp_path_factory.mktemp("quiet") / "tiny-llama"
    tiny_causal_lm("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_eval_shows_lm_evals_bars_by_default_and_none_with_quiet(tiny_model_dir, tmp_path, capsys):
    from experiments.cli import main

    argv = ["eval", str(tiny_model_dir), "--tasks", "sinkstudy_gsm", "--limit", "1", "--max-gen-toks", "4", "--no-chat-template",
            "--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--out", str(tmp_path / "loud")]) == 0
    assert "Running generate_until requests" in capsys.readouterr().err  # progress stays on by default
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--no-cache", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "Running generate_until requests" not in err and "it/s]" not in err, err
