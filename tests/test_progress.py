"""Long silent work shows its progress like the training stages do: the self-distilled replies (about 11 min on 2
cores for SmolLM2-135M) and the tower's pretraining, each a bar that --quiet hides."""

import pytest

from sinkstudy import SinkstudyError
from sinkstudy.progress import quiet
from sinkstudy.tiny import tiny_causal_lm


def test_self_distillation_counts_its_replies(tmp_path, tokenizer, capsys):
    from interventions.adapt import selfdistill

    base = tmp_path / "base"
    tiny_causal_lm("qwen2", vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    capsys.readouterr()

    def replies():
        try:
            selfdistill.generate(str(base), {"prompts": 3, "max_new_tokens": 4})
        except SinkstudyError:  # a tiny model's replies may hold no whole sentence: its progress showed all the same
            pass
        return capsys.readouterr().err

    err = replies()
    assert "self-distilled replies" in err and "3/3" in err
    with quiet():
        assert "self-distilled" not in replies()


@pytest.mark.slow(seconds=10)
def test_tower_pretraining_shows_a_bar(capsys):
    from interventions.adapt import tower

    settings = tower.settings_of({"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                                  "steps": 3, "scenes": 16, "per_source": 8, "batch_size": 4})
    tower.pretrain(settings, progress=True)
    err = capsys.readouterr().err
    assert "tower pretraining" in err and "3/3" in err
