"""Dispatch, sizes, errors, chunked quantize_rows, and the Q5_K / Q6_K dequantizers."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k3kit.errors import K3Error
from k3kit.gguf import quants

F = np.float32


def test_type_size_matches_gguf_table():
    for t in quants.QUANTIZE_TYPES | quants.DEQUANTIZE_TYPES:
        assert quants.type_size(t) == GGML_QUANT_SIZES[t]
        assert quants.type_size(int(t)) == GGML_QUANT_SIZES[t]
    assert quants.type_size(T.Q4_K) == (256, 144)
    assert quants.type_size(T.MXFP4) == (32, 17)


def test_quantize_output_shapes():
    x = np.ones((2, 3, 512), F)
    for t in quants.QUANTIZE_TYPES:
        raw = quants.quantize(x, t)
        assert raw.dtype == np.uint8
        assert raw.shape == (2, 3, quants.row_bytes(t, 512))


def test_zero_rows_round_trip():
    for t in quants.QUANTIZE_TYPES:
        raw = quants.quantize(np.zeros((0, 256), F), t)
        assert raw.shape == (0, quants.row_bytes(t, 256))
        assert quants.dequantize(raw, t, 0).shape == (0,)


def test_bad_inputs_raise_k3error():
    with pytest.raises(K3Error, match="not a multiple of the Q4_K block"):
        quants.quantize(np.zeros((2, 100), F), T.Q4_K)
    with pytest.raises(K3Error, match="cannot quantize to Q6_K"):
        quants.quantize(np.zeros(256, F), T.Q6_K)
    with pytest.raises(K3Error, match="cannot dequantize Q8_K"):  # ggml has no to_float for Q8_K
        quants.dequantize(np.zeros(292, np.uint8), T.Q8_K, 256)
    with pytest.raises(K3Error, match="33 bytes for 32 elements"):
        quants.dequantize(np.zeros(33, np.uint8), T.Q8_0, 32)
    with pytest.raises(K3Error, match="unknown ggml type"):
        quants.type_size(9999)
    with pytest.raises(K3Error, match="must be uint8"):
        quants.dequantize(np.zeros(17, np.int16), T.MXFP4, 32)


def test_dequantize_accepts_bytes():
    raw = quants.quantize(np.arange(32, dtype=F), T.Q8_0)
    assert np.array_equal(quants.dequantize(raw.tobytes(), T.Q8_0, 32), quants.dequantize(raw, T.Q8_0, 32))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.MXFP4, T.BF16], ids=lambda t: t.name)
def test_quantize_rows_matches_one_call(qtype):
    x = np.random.default_rng(0).standard_normal((13, 512)).astype(F)
    assert np.array_equal(quants.quantize_rows(x, qtype, chunk_rows=4), quants.quantize(x, qtype))


def random_kquant_blocks(qtype, n, seed):
    """Random bytes with finite fp16 scales: covers every nibble, bit and 6-bit scale value."""
    rng = np.random.default_rng(seed)
    size = quants.type_size(qtype)[1]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    fp16 = (rng.standard_normal(2 * n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 4)
    if qtype == T.Q6_K:
        raw[:, 208:210] = fp16[:, :2]
    else:
        raw[:, 0:4] = fp16
    return raw


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.MXFP4], ids=lambda t: t.name)
def test_dequantize_agrees_with_gguf_py(qtype):
    """An independent implementation (gguf-py) must agree to float32 rounding: different
    expression order there can move the last bit, so this is a tolerance check."""
    raw = random_kquant_blocks(qtype, 64, seed=int(qtype))
    if qtype == T.MXFP4:
        raw[:, 0] = np.random.default_rng(1).integers(100, 150, 64)
    n = 64 * quants.type_size(qtype)[0]
    ours = quants.dequantize(raw, qtype, n)
    theirs = gguf.quants.dequantize(raw, qtype).reshape(-1).astype(F)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-9)


def test_q6_k_hand_block():
    # d = 1.0; scales 1..16; element e of half h: ql/qh chosen so q = (e % 64) - 32
    raw = np.zeros(210, np.uint8)
    raw[208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    raw[192:208] = np.arange(1, 17, dtype=np.int8).view(np.uint8)
    want = np.empty(256, F)
    for h in range(2):
        for e in range(128):
            q6 = (e * 7 + h * 13) % 64  # any 6-bit value
            g, lane = divmod(e, 32)
            byte = 64 * h + (g % 2) * 32 + lane
            raw[byte] |= (q6 & 0xF) << (4 * (g // 2))
            raw[128 + 32 * h + lane] |= (q6 >> 4) << (2 * g)
            want[128 * h + e] = F(1 + (128 * h + e) // 16) * F(q6 - 32)
    assert np.array_equal(quants.dequantize(raw, T.Q6_K, 256), want)


def test_q5_k_hand_block():
    # d = 0.5, dmin = 0.25; sub-block s has scale s+1 and min 2s; q = 5-bit pattern
    raw = np.zeros(176, np.uint8)
    raw[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    raw[2:4] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    sc = np.arange(1, 9)
    mn = 2 * np.arange(8)
    raw[4:8] = sc[:4] | ((sc[4:] >> 4) << 6)
    raw[8:12] = mn[:4] | ((mn[4:] >> 4) << 6)
    raw[12:16] = (sc[4:] & 0xF) | ((mn[4:] & 0xF) << 4)
    want = np.empty(256, F)
    for s in range(8):
        for lane in range(32):
            q5 = (s * 11 + lane * 5) % 32
            c, hi = divmod(s, 2)
            raw[48 + 32 * c + lane] |= (q5 & 0xF) << (4 * hi)
            raw[16 + lane] |= (q5 >> 4) << s
            want[32 * s + lane] = F(F(0.5) * F(sc[s])) * F(q5) - F(F(0.25) * F(mn[s]))
    assert np.array_equal(quants.dequantize(raw, T.Q5_K, 256), want)
