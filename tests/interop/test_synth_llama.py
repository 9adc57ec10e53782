"""llama.cpp loads what `k3kit synth` writes and runs a finite forward pass.

The k3-geometry file is real K3 width (hidden 7168, 96 heads, MLA 1536/512, latent MoE
3584 x 3072, dense FFN 18432) cut to 2 layers (one KDA + dense FFN, one MLA + MoE) and
8 experts with a 1024-token vocab: 1.49 GB, loads in well under a second from the page
cache and evaluates a short prompt in seconds on 2 cores. A sharded mini model checks
that llama.cpp follows our shard layout.

Weight repacking into "extra" buffer types is switched off for all interop tests (conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3kit.gguf import synth

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.interop


def _load(path: Path):
    return llama_cpp.Llama(model_path=str(path), vocab_only=False, n_ctx=64, verbose=False, logits_all=True)


def _eval(model, text: bytes) -> np.ndarray:
    tokens = model.tokenize(text, add_bos=False)
    model.reset()
    model.eval(tokens)
    return np.array(model.scores[:len(tokens)], dtype=np.float32)


@pytest.mark.slow
def test_k3_geometry_loads_and_gives_finite_logits(tmp_path):
    result = synth.synthesize(tmp_path, "k3", 2, 8, vocab=1024, seed=5, progress=False)
    assert result.file_bytes < 1.5e9
    model = _load(Path(result.paths[0]))
    try:
        assert model.n_vocab() == 1024 and model.n_embd() == 7168
        assert model.metadata["general.architecture"] == "kimi-k3"
        logits = _eval(model, b"the quick brown fox jumps")
        assert logits.shape[1] == 1024 and logits.shape[0] >= 5
        assert np.isfinite(logits).all()
        assert logits.std() > 1e-3                      # not a constant output
        assert not np.allclose(logits[0], logits[-1])   # depends on the input
    finally:
        model.close()


def test_sharded_mini_loads_tokenizes_and_runs(tmp_path):
    result = synth.synthesize(tmp_path, "mini", 4, 8, shards=3, seed=9, progress=False)
    vocab = synth.make_vocab(1024)
    model = _load(Path(result.paths[0]))
    try:
        # byte-level BPE: every byte string round-trips, and our merges are applied
        text = "hello world, 12 µs\n\tok".encode()
        assert model.detokenize(model.tokenize(text, add_bos=False)) == text
        assert model.tokenize(b"ab", add_bos=False) == [vocab.tokens.index("ab")]
        assert model.token_bos() == vocab.bos and model.token_eos() == vocab.eos
        first = _eval(model, b"hello world")
        again = _eval(model, b"hello world")
        assert np.isfinite(first).all() and first.std() > 1e-3
        np.testing.assert_allclose(first, again, rtol=1e-5, atol=1e-5)
    finally:
        model.close()
