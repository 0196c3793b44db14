"""Shared fixtures: everything offline, tiny and built locally."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from sinkstudy.tiny import train_bpe_tokenizer

    return train_bpe_tokenizer(vocab_size=512)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path
