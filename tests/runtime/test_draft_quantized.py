"""A draft read from a GGUF keeps its matrices as the file's bytes (like a target's quantized
trunk) and runs them through the native kernels; `--trunk float` dequantizes them once."""

from __future__ import annotations

import pytest
import torch
from toy_target import one_thread  # noqa: F401  (autouse: one torch thread)

from k3kit.adapters.session import open_session
from k3kit.gguf.reader import GGUFFile
from k3kit.layers.norm import RMSNorm
from k3kit.layers.quantized_linear import QuantizedLinear
from k3kit.mini.paths import shipped_draft, shipped_gguf
from k3kit.models.dflash.names import gguf_tensor_name
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.speculative import FeatureRing, Sampling, ScheduleConfig, SpeculativeDecoder, propose


@pytest.fixture(scope="module")
def sessions():
    q = open_session(shipped_gguf(), LoadOptions(), draft=shipped_draft())
    f = open_session(shipped_gguf(), LoadOptions(trunk="float"), draft=shipped_draft())
    yield q, f
    q.close()
    f.close()


def test_matrices_stay_the_files_bytes(sessions):
    quant, flt = (s.draft_model for s in sessions)
    f = GGUFFile.open(shipped_draft())
    stored = {t.name: t for t in f.tensors}
    held = 0
    for name, m in quant.draft.named_modules():
        if isinstance(m, QuantizedLinear):
            t = stored[gguf_tensor_name(f"{name}.weight")]
            assert m.qtype.name == t.ggml_type.name == "Q8_0"
            assert m.nbytes == t.nbytes
            held += m.nbytes
    # every matrix but the Markov pair (rows of 32: float, see adapters.dflash.SHORT_ROWS)
    q8 = sum(t.nbytes for t in f.tensors if t.ggml_type.name == "Q8_0" and not t.name.startswith("markov_w"))
    assert held == q8 > 0
    w1 = quant.draft.markov_head.markov_w1.weight
    assert w1.dtype == torch.float32 and w1.shape == (quant.cfg.vocab_size, quant.cfg.markov_rank)
    assert not any(isinstance(m, QuantizedLinear) for m in flt.draft.modules())
    # llama.cpp's norm order in both
    assert {m.style for m in quant.draft.modules() if isinstance(m, RMSNorm)} == {"ggml"}


def test_quantized_draft_proposes_what_the_float_one_does(sessions):
    """The target's taps of a real prompt, the same anchors: hidden rows within Q8_0's rounding of
    the float draft's, and nearly always the same greedy proposals (the drafts differ only by
    rounding, int8 activations included)."""
    quant, flt = (s.draft_model for s in sessions)
    target = sessions[0].model
    dec = SpeculativeDecoder(target, quant, Sampling(), torch.Generator(), schedule=ScheduleConfig())
    ids = sessions[0].codec.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = ")
    dec.prefill(ids)
    n = dec.ring.length
    same = total = 0
    for drafter in (quant, flt):
        drafter.sync(dec.ring)
    for anchor in [ids[-1], *range(10, 4000, 397)]:
        a, b = quant.draft_block(anchor, n), flt.draft_block(anchor, n)
        err = float((a.hidden - b.hidden).norm() / b.hidden.norm())
        assert err < 0.05, err
        pa, pb = propose(quant, anchor, n, Sampling()), propose(flt, anchor, n, Sampling())
        same += sum(x == y for x, y in zip(pa.tokens, pb.tokens, strict=True))
        total += len(pa.tokens)
    assert same >= 0.9 * total, (same, total)
    for drafter in (quant, flt):
        drafter.release(dec.ring)


def test_a_block_joins_the_context_in_place_with_the_bits_of_a_copy(sessions):
    """Past a long context the block's K/V rows are written after the context's in its storage
    (no copy of the context each step): the same hidden rows as a plain concatenation, and the
    context is what it was."""
    quant = sessions[0].draft_model
    g = torch.Generator().manual_seed(4)
    ring = FeatureRing(quant.feature_width, storage="f32")
    ring.append(torch.randn(300, quant.feature_width, generator=g))
    quant.sync(ring)
    ctx = quant.context()
    plain = [(k.clone(), v.clone()) for k, v in ctx]
    b = quant.block_size
    pos = torch.arange(300, 300 + b)
    x = quant.draft.block_embed([17], b)[0]
    with torch.no_grad():
        joined = quant.draft(None, pos, ctx, x=x)
        copied = quant.draft(None, pos, plain, x=x)
    assert torch.equal(joined, copied)
    for (k, v), (pk, pv) in zip(quant.context(), plain, strict=True):
        assert k.shape[0] == 300 and torch.equal(k, pk) and torch.equal(v, pv)
    quant.release(ring)
