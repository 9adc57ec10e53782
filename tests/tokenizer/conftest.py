"""The tokenizer the tests write as KVs: the mini K3's BPE, trained small on the mini corpus."""

from __future__ import annotations

import pytest
from tokenizer_cases import VOCAB

from k3kit.mini.corpus import build_corpus
from k3kit.mini.tokenizer import train_tokenizer


@pytest.fixture(scope="session")
def corpus():
    return build_corpus(max_bytes=600_000)


@pytest.fixture(scope="session")
def tok(corpus):
    return train_tokenizer(corpus.train_docs, VOCAB)
