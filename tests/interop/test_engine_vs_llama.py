"""Greedy decoding: k3kit's engine and llama.cpp agree token for token on the same GGUF.

Token-for-token model: the shipped mini K3's weights (its HF checkpoint, `k3kit mini path --hf`,
converted with `k3kit convert target --trunk-type F32`) when the shipped model exists, else a
random tiny K3 converted the same way (tests/runtime/engine_models.py; 16 MXFP4 experts
top-4). The engine runs with ggml parity on (routed expert inputs rounded to Q8_0 as ggml-cpu
does for MXFP4 weights), llama.cpp with an F32 KV cache. 10 prompts x 64 tokens, engine expert
cache at 100%, 25% and one expert per layer.

Why an F32 trunk: with a Q8_0 trunk ggml also rounds every matmul's INPUT to Q8_0 (its
vec_dot type). The engine emulates that rounding on every quantized matmul (ggml parity), but an
activation that lands within float noise of a Q8_0 rounding boundary can round the other way
(summation order differs), so greedy paths on the Q8_0 trunk part at rare near-ties. The shipped
Q8_0 GGUF is checked by `test_shipped_q8_gguf_agrees_except_at_near_ties` here and by
tests/interop/test_shipped_mini_llama.py: argmax agreement wherever llama.cpp's top-1/top-2
margin is clear of a near-tie.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_models import SHIPPED, prompts, tiny_gguf  # noqa: E402
from llama_run import llama_greedy  # noqa: E402

from k3kit.adapters import load_model  # noqa: E402
from k3kit.convert.target import convert_target  # noqa: E402
from k3kit.runtime.engine import generate  # noqa: E402
from k3kit.runtime.loader import LoadOptions  # noqa: E402
from k3kit.runtime.sampling import make_sampling  # noqa: E402

llama_cpp = pytest.importorskip("llama_cpp")

N_PROMPTS, N_TOKENS = 10, 64


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


def _llama(path: Path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=1, logits_all=True,
                           type_k=0, type_v=0, verbose=False)


@pytest.fixture(scope="module")
def model_and_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_llama")
    if SHIPPED.exists():
        from k3kit.mini.paths import shipped_hf
        path = d / "mini-f32.gguf"
        convert_target(shipped_hf(), path, "F32")
    else:
        path, _ = tiny_gguf(d, "F32")
    llm = _llama(path)
    vocab = llm.n_vocab() - 16          # stay below the special tokens at the end of the vocab
    ps = prompts(N_PROMPTS, vocab)
    want = [llama_greedy(llm, p, N_TOKENS) for p in ps]
    llm.close()
    return path, ps, want


@pytest.mark.parametrize("cache", ["all", "quarter", "one_per_layer"])
def test_engine_greedy_equals_llama_cpp(model_and_llama, cache):
    path, ps, want = model_and_llama
    probe = load_model(path, LoadOptions(expert_cache_mib=0)).model
    st = probe.store
    one = st.cached_expert_nbytes(next(iter(st.layers))) / 2**20   # as the cache holds it
    total = one * sum(st.n_experts(il) for il in st.layers)
    n_moe = len(st.layers)
    probe.close()
    mib = {"all": total, "quarter": total / 4, "one_per_layer": one * n_moe}[cache]
    adapter = load_model(path, LoadOptions(expert_cache_mib=mib, ggml_parity=True)).model
    try:
        for i, p in enumerate(ps):
            got = generate(adapter, p, max_tokens=N_TOKENS, sampling=make_sampling(0.0, seed=0),
                           prefill_chunk=8).token_ids
            assert got == want[i], f"prompt {i}: first difference at token " \
                f"{next(j for j, (a, b) in enumerate(zip(got, want[i], strict=True)) if a != b)}"
        assert adapter.expert_stats().misses > 0
    finally:
        adapter.close()


def test_shipped_q8_gguf_agrees_except_at_near_ties():
    if not SHIPPED.exists():
        pytest.skip(f"{SHIPPED} not built")
    llm = _llama(SHIPPED)
    adapter = load_model(SHIPPED, LoadOptions(expert_cache_mib=1, ggml_parity=True)).model
    try:
        checked = 0
        for p in prompts(N_PROMPTS, llm.n_vocab() - 16):
            llama_greedy(llm, p, N_TOKENS)
            seq = [int(t) for t in llm._input_ids[:llm.n_tokens]]
            want = np.array(llm.scores[:llm.n_tokens], dtype=np.float32)
            adapter.reset()
            got = adapter.forward(seq, all_logits=True).numpy()
            top2 = np.sort(want, axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 0.05
            assert (got.argmax(-1) == want.argmax(-1))[clear].all()
            assert np.median(np.abs(got - want).max(-1)) < 0.1
            checked += int(clear.sum())
        assert checked >= N_PROMPTS * N_TOKENS // 2
    finally:
        adapter.close()
        llm.close()
