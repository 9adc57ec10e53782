"""A k3kit requant is what libggml would write, and llama.cpp runs it.

Every Q4_K tensor of the output equals ggml_quantize_chunk(Q4_K) applied to ggml's own
dequantization of the Q8_0 source (the ctypes oracle in ggml_oracle.py), and llama.cpp loads
the 3-shard output and gives finite logits that still track the Q8_0 model's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from k3kit.gguf import synth
from k3kit.gguf.requant import Options, requantize
from k3kit.gguf.shards import Model

llama_cpp = pytest.importorskip("llama_cpp")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ggml_oracle  # noqa: E402

pytestmark = pytest.mark.interop


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("rq")
    src = synth.synthesize(d / "src", "mini", 4, 8, shards=3, seed=11, progress=False)
    requantize(src.paths[0], d / "out", Options(), jobs=1, progress=False)
    return Path(src.paths[0]), d / "out" / Path(src.paths[0]).name


def test_q4k_tensors_equal_libggml(pair):
    ggml = ggml_oracle.load()
    if ggml is None:
        pytest.skip("libggml-base not found")
    src, out = Model.open(pair[0]), Model.open(pair[1])
    try:
        n = 0
        for name, t in out.tensors.items():
            if t.ggml_type != Q.Q4_K:
                continue
            s = src.tensors[name]
            x = ggml.dequantize(np.asarray(src.view(name)), int(s.ggml_type), s.n_elements)
            want = ggml.quantize(x.reshape(-1, s.shape[0]), int(Q.Q4_K)).reshape(-1)
            assert np.array_equal(np.asarray(out.view(name)), want), name
            n += 1
        assert n == 36
    finally:
        src.close()
        out.close()


def _logits(path: Path, text: bytes) -> np.ndarray:
    model = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, logits_all=True)
    try:
        tokens = model.tokenize(text, add_bos=False)
        model.eval(tokens)
        return np.array(model.scores[:len(tokens)], dtype=np.float32)
    finally:
        model.close()


def test_llama_cpp_runs_the_requantized_model(pair):
    text = b"the quick brown fox jumps over"
    before, after = _logits(pair[0], text), _logits(pair[1], text)
    assert after.shape == before.shape and after.shape[1] == 1024
    assert np.isfinite(after).all() and after.std() > 1e-3
    assert not np.array_equal(after, before)  # the trunk really changed
    corr = np.corrcoef(before.ravel(), after.ravel())[0, 1]
    assert corr > 0.9, corr  # Q4_K noise on a Q8_0 trunk: same model, slightly perturbed
