"""Every block type gguf 0.19 lists: dispatch, gguf-py agreement, chunking, Q1_0, finiteness
checks and random valid blocks. Bit-identity with libggml is tests/interop/test_quants_ggml.py's
job; the torch kernels' is tests/kernels/test_dequant_torch.py's (against a scalar transcription).
"""

from __future__ import annotations

import gguf.quants
import hypothesis.strategies as st
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings

from k3kit.errors import FormatError, K3Error
from k3kit.gguf import quants
from k3kit.gguf.quants import gguf_py, scales

F = np.float32
# The issue-12 list: every quantized type of gguf 0.19 that ggml can dequantize (to_float).
ISSUE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
               T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
               T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4, T.Q1_0]
ALL = [*ISSUE_TYPES, T.F32, T.F16, T.BF16]


def test_every_listed_type_dequantizes_and_has_gguf_sizes():
    assert set(ALL) == set(quants.DEQUANTIZE_TYPES)
    for t in ALL:
        assert quants.type_size(t) == GGML_QUANT_SIZES[t]
    # what gguf 0.19 lists beyond these has no dequantizer in ggml either (dot-product or int types)
    rest = {t.name for t in T} - {t.name for t in ALL}
    assert rest == {"Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "F64"}


def test_delegated_types_are_gguf_py_codecs():
    assert gguf_py.DELEGATED <= set(ISSUE_TYPES)
    assert T.Q1_0 not in gguf_py.DELEGATED
    for t in gguf_py.DELEGATED:
        assert getattr(gguf.quants, t.name).qtype == t


@pytest.mark.parametrize("qtype", sorted(gguf_py.DELEGATED), ids=lambda t: t.name)
def test_delegated_equals_gguf_py_across_chunks(monkeypatch, qtype):
    """k3kit's chunked calls give gguf-py's exact bits, also when chunks end mid-tensor."""
    monkeypatch.setattr(gguf_py, "CHUNK_ELEMS", 3 * 256)
    fn = gguf_py.dequantizer(qtype)
    elems, _ = quants.type_size(qtype)
    n = 7 * 256 // elems + 1
    raw = quants.random_blocks(qtype, n, np.random.default_rng(int(qtype)))
    want = gguf.quants.dequantize(raw, qtype).reshape(-1)
    assert np.array_equal(fn(raw.reshape(-1)).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(quants.dequantize(raw, qtype, n * elems).view(np.uint32), want.view(np.uint32))


def test_tables_come_from_gguf_py():
    assert gguf_py.grid(T.IQ2_XXS).shape == (256, 8) and gguf_py.grid(T.IQ2_S).shape == (1024, 8)
    assert gguf_py.grid(T.IQ3_XXS).shape == (256, 4) and gguf_py.grid(T.IQ3_S).shape == (512, 4)
    assert gguf_py.grid(T.IQ1_S).shape == (2048, 8)
    assert set(np.unique(gguf_py.grid(T.IQ2_XS))) == {8, 25, 43}
    assert set(np.unique(gguf_py.grid(T.IQ1_S))) == {-1, 0, 1}
    # ksigns: the low 7 bits are the index, the 8th makes the count of minus signs even
    ks = gguf_py.KSIGNS.astype(int)
    assert np.array_equal(ks & 127, np.arange(128))
    assert all(bin(v).count("1") % 2 == 0 for v in ks)
    assert np.array_equal(gguf_py.sign_table()[3], [-1, -1, 1, 1, 1, 1, 1, 1])
    ue = gguf_py.ue4m3_table()
    assert ue[0] == 0 and ue[0x7F] == 0 and ue[0x38] == F(0.5) and ue[0x01] == F(2.0**-10)


def test_q1_0_hand_block():
    raw = np.zeros(18, np.uint8)
    raw[0:2] = np.frombuffer(np.float16(-0.75).tobytes(), np.uint8)
    raw[2] = 0b10000001
    got = quants.dequantize(raw, T.Q1_0, 128)
    want = np.full(128, F(0.75))
    want[[0, 7]] = F(-0.75)
    assert np.array_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=18 * 3, max_size=18 * 3))
def test_q1_0_any_bytes_is_plus_or_minus_d(data):
    raw = np.frombuffer(data, np.uint8)
    y = quants.dequantize(raw, T.Q1_0, 3 * 128).reshape(3, 128)
    d = quants.dequantize(np.frombuffer(data, np.uint8).reshape(3, 18)[:, 0:2].copy(), T.F16, 3)
    bits = np.unpackbits(raw.reshape(3, 18)[:, 2:], axis=1, bitorder="little").astype(bool)
    want = np.where(bits, d[:, None], -d[:, None])
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))  # NaN scales: exact sign flips too


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_nonfinite_mask_is_exact_on_random_bytes(qtype):
    """A block is flagged exactly when its dequantized values hold an inf or NaN."""
    elems, nbytes = quants.type_size(qtype)
    n = max(64, 200_000 // elems)
    raw = np.random.default_rng(50 + int(qtype)).integers(0, 256, (n, nbytes), dtype=np.uint8)
    if qtype == T.MXFP4:
        raw[: n // 2, 0] = np.random.default_rng(1).integers(250, 256, n // 2)  # near the overflow edge
    with np.errstate(all="ignore"):
        y = quants.dequantize(raw, qtype, n * elems).reshape(n, elems)
    want = ~np.isfinite(y).all(axis=1)
    assert np.array_equal(scales.nonfinite_mask(raw, qtype), want)
    first = quants.first_nonfinite_block(raw, qtype, n * elems)
    assert first == (int(np.flatnonzero(want)[0]) if want.any() else None)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_random_blocks_are_valid(qtype):
    elems, nbytes = quants.type_size(qtype)
    n = max(16, 65536 // elems)
    raw = quants.random_blocks(qtype, n, np.random.default_rng(int(qtype)))
    assert raw.shape == (n, nbytes) and raw.dtype == np.uint8
    assert quants.first_nonfinite_block(raw, qtype, n * elems) is None
    assert np.isfinite(quants.dequantize(raw, qtype, n * elems)).all()
    quants.check_finite(raw, qtype, n * elems)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.IQ1_M, T.IQ2_XXS, T.MXFP4, T.BF16, T.Q2_K], ids=lambda t: t.name)
def test_random_blocks_scale_range(qtype):
    """With a scale range the fp16 scales (MXFP4: the exponent's block max) stay inside it."""
    elems, _ = quants.type_size(qtype)
    n = 512
    raw = quants.random_blocks(qtype, n, np.random.default_rng(2), scale_range=(1e-3, 1e-2))
    if qtype in scales.F16_SCALES:
        for off in scales.F16_SCALES[qtype]:
            d = np.abs(raw[:, off : off + 2].copy().view(np.float16).astype(F))
            assert (d >= F(np.float16(1e-3))).all() and (d <= F(np.float16(1e-2))).all()
    elif qtype == T.IQ1_M:
        d = np.abs(scales.iq1_m_scale_bits(raw).view(np.float16).astype(F))
        assert (d >= F(np.float16(1e-3))).all() and (d <= F(np.float16(1e-2))).all()
    y = np.abs(quants.dequantize(raw, qtype, n * elems))
    if qtype in (T.MXFP4, T.BF16):
        assert y.max() <= 2e-2 and y.max() >= 1e-4


@settings(max_examples=80, deadline=None)
@given(qtype=st.sampled_from([t for t in ALL if t != T.NVFP4]), n_blocks=st.integers(1, 60), data=st.data())
def test_first_nonfinite_block_finds_the_first_planted_one(qtype, n_blocks, data):
    """NVFP4 is left out: its ue4m3 scales cannot encode inf/NaN (see the test below)."""
    elems, _ = quants.type_size(qtype)
    raw = quants.random_blocks(qtype, n_blocks, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    planted = sorted(set(data.draw(st.lists(st.integers(0, n_blocks - 1), max_size=3))))
    kind = data.draw(st.sampled_from(["nan", "inf"]))
    for i in planted:
        _corrupt(raw, qtype, i, kind, data)
    want = planted[0] if planted else None
    assert quants.first_nonfinite_block(raw, qtype, n_blocks * elems) == want
    if want is None:
        quants.check_finite(raw, qtype, n_blocks * elems, what="m.gguf: blk.0.x")
    else:
        with pytest.raises(quants.CorruptBlockError) as e:
            quants.check_finite(raw, qtype, n_blocks * elems, what="m.gguf: blk.0.x")
        assert e.value.block == want and e.value.qtype == qtype
        assert str(e.value).startswith(f"m.gguf: blk.0.x: {qtype.name} ") and "\n" not in str(e.value)
        assert isinstance(e.value, FormatError)
        with np.errstate(all="ignore"):
            y = quants.dequantize(raw, qtype, n_blocks * elems).reshape(n_blocks, elems)
        assert not np.isfinite(y[want]).all() and np.isfinite(y[:want]).all()


def _corrupt(raw: np.ndarray, qtype: T, i: int, kind: str, data) -> None:
    """Make block i non-finite the way a corrupt file would: an inf/NaN scale or value."""
    f16 = np.array([0x7E00 if kind == "nan" else 0x7C00], "<u2")
    if data.draw(st.booleans()):
        f16 |= 0x8000
    if qtype in scales.F16_SCALES:
        off = data.draw(st.sampled_from(scales.F16_SCALES[qtype]))
        raw[i, off : off + 2] = f16.view(np.uint8)
    elif qtype == T.IQ1_M:
        sc = raw[i, 48:56].copy().view("<u2")
        for k in range(4):
            sc[k] = (sc[k] & 0x0FFF) | (((int(f16[0]) >> (4 * k)) & 0xF) << 12)
        raw[i, 48:56] = sc.view(np.uint8)
    elif qtype == T.MXFP4:
        raw[i, 0] = 255
        raw[i, 1] = 0x77  # |kvalue| 12 in both nibbles of byte 0: 12 * 2^127 overflows
    elif qtype == T.F32:
        raw[i] = np.array([np.nan if kind == "nan" else np.inf], F).view(np.uint8)
    elif qtype == T.F16:
        raw[i] = f16.view(np.uint8)
    elif qtype == T.BF16:
        raw[i] = np.array([0x7FC0 if kind == "nan" else 0x7F80], "<u2").view(np.uint8)
    else:
        raise AssertionError(qtype)


def test_nvfp4_has_no_nonfinite_blocks():
    raw = np.full((4, 36), 0xFF, np.uint8)
    assert quants.first_nonfinite_block(raw, T.NVFP4, 256) is None
    assert np.isfinite(quants.dequantize(raw, T.NVFP4, 256)).all()


def test_check_errors():
    with pytest.raises(K3Error, match="no finiteness check for Q8_K"):
        quants.first_nonfinite_block(np.zeros(292, np.uint8), T.Q8_K, 256)
    with pytest.raises(K3Error, match="expected 34"):
        quants.first_nonfinite_block(np.zeros(33, np.uint8), T.Q8_0, 32)
    assert quants.first_nonfinite_block(b"", T.Q8_0, 0) is None


def test_check_finite_scans_in_bounded_steps(monkeypatch):
    import k3kit.gguf.quants as q

    monkeypatch.setattr(q, "_CHECK_BLOCKS", 5)
    raw = quants.random_blocks(T.Q8_0, 23, np.random.default_rng(0))
    raw[17, 0:2] = np.array([0x7C00], "<u2").view(np.uint8)
    raw[21, 0:2] = np.array([0x7E00], "<u2").view(np.uint8)
    assert quants.first_nonfinite_block(raw, T.Q8_0, 23 * 32) == 17
