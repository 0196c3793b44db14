"""Shared fixtures: everything offline, tiny and built locally."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Hermetic: eval results, fingerprints and nltk tables cached by one run must not serve another.
os.environ["SINKSTUDY_CACHE"] = tempfile.mkdtemp(prefix="sinkstudy-test-cache-")
atexit.register(shutil.rmtree, os.environ["SINKSTUDY_CACHE"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine the thread
# pool's spin-waits made single forwards tens of times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from sinkstudy.tiny import train_bpe_tokenizer

    return train_bpe_tokenizer(vocab_size=512)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path
