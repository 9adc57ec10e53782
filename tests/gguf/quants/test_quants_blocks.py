"""Q8_0, MXFP4 and Q4_K: hand-derived blocks, scalar-reference equality, error bounds, layout.

The scalar reference (quant_scalar_ref.py) is an element-at-a-time float32 transcription of
ggml's algorithms; the vectorised codecs must equal it byte for byte on varied data. The
llama.cpp comparison itself is in tests/interop/test_quants_ggml.py.
"""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
import quant_scalar_ref as ref
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings

from k3kit.gguf import quants
from k3kit.gguf.quants import mxfp4, q4_k

F = np.float32


def varied_blocks(n_blocks: int, block: int, seed: int) -> np.ndarray:
    """A few blocks of each awkward kind: scales, ties, constants, zeros, tiny, huge, outliers."""
    rng = np.random.default_rng(seed)
    kinds = [
        lambda: rng.standard_normal(block),
        lambda: rng.standard_normal(block) * 1e-3,
        lambda: rng.uniform(-5, 5, block),
        lambda: rng.uniform(0, 2, block),
        lambda: -np.abs(rng.standard_normal(block)),
        lambda: rng.standard_t(2, block),
        lambda: np.full(block, rng.standard_normal()),
        lambda: np.zeros(block),
        lambda: rng.standard_normal(block) * 1e-30,
        lambda: rng.standard_normal(block) * 1e-41,
        lambda: rng.standard_normal(block) * 1e30,
        lambda: np.where(np.arange(block) == rng.integers(block), 100.0, rng.standard_normal(block) * 0.01),
        lambda: rng.integers(-16, 16, block) * 0.5,
        lambda: rng.integers(-127, 128, block) + 0.5,
    ]
    rows = [kinds[i % len(kinds)]() for i in range(n_blocks)]
    return np.array(rows, dtype=np.float32)


# ---------------------------------------------------------------- Q8_0


def test_q8_0_hand_block():
    # amax 127 -> d = 1.0 exactly (fp16 0x3C00), q = roundf(x): halves go away from zero
    x = np.zeros(32, dtype=F)
    x[:8] = [-127, 2.5, -2.5, 0.5, -0.5, 0.49999997, 126.5, 3.2]
    raw = quants.quantize(x, T.Q8_0)
    assert raw.shape == (34,)
    assert raw[:2].tobytes() == b"\x00\x3c"
    assert raw[2:10].view(np.int8).tolist() == [-127, 3, -3, 1, -1, 0, 127, 3]
    assert not raw[10:].any()


def test_q8_0_equals_scalar_reference():
    x = varied_blocks(56, 32, seed=1)
    got = quants.quantize(x, T.Q8_0)
    want = np.frombuffer(b"".join(ref.q8_0_block(r) for r in x), dtype=np.uint8).reshape(got.shape)
    assert np.array_equal(got, want)


def test_q8_0_error_bound_and_zero_block():
    x = np.random.default_rng(2).standard_normal((64, 256)).astype(F)
    y = quants.dequantize(quants.quantize(x, T.Q8_0), T.Q8_0, x.size).reshape(x.shape)
    d = np.abs(x).reshape(-1, 32).max(axis=1, keepdims=True) / 127
    err = np.abs(x - y).reshape(-1, 32)
    assert np.all(err <= d * (0.5 + 127 * 2.0**-11) + 1e-12)
    assert not quants.quantize(np.zeros(64, F), T.Q8_0).any()


# ---------------------------------------------------------------- MXFP4


def test_mxfp4_hand_block():
    # amax 6 -> e = floor(log2 6) - 2 + 127 = 127, element values = kvalue * 2^(127-128)
    x = np.zeros(32, dtype=F)
    x[:16] = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -6, 0.25, 0.75, 2.5, 5, -0.25, -5]
    x[16:20] = [7, 1.25, -1.75, 3.5]
    raw = quants.quantize(x, T.MXFP4)
    assert raw[0] == 127
    lo = (raw[1:] & 0xF).tolist()
    hi = (raw[1:] >> 4).tolist()
    # ties go to the lower magnitude; -0.25 -> +0 (index 0, not 8)
    assert lo == [0, 1, 2, 3, 4, 5, 6, 7, 9, 15, 0, 1, 4, 6, 0, 14]
    assert hi[:4] == [7, 2, 11, 5]  # 7 -> 6; 1.25 -> 1 (tie); -1.75 -> -1.5 (tie); 3.5 -> 3 (tie)
    assert hi[4:] == [0] * 12


def test_mxfp4_e8m0_scale_table():
    e = np.arange(256, dtype=np.uint8)
    d = mxfp4.e8m0_half(e)
    assert d[0] == F(2.0**-128) and d[1] == F(2.0**-127)
    assert np.array_equal(d[2:255], (2.0 ** (np.arange(2, 255) - 128.0)).astype(F))


def test_mxfp4_exponent_of_amax_just_below_power_of_two():
    # log2f rounds 8*(1-2^-24) up to 3.0, so ggml picks e for 8, not for 4..8
    amax = np.array([np.nextafter(F(8), F(0)), F(8), np.nextafter(F(4), F(8))], dtype=F)
    assert mxfp4.block_exponent(amax).tolist() == [128, 128, 127]


def test_mxfp4_equals_scalar_reference():
    x = varied_blocks(70, 32, seed=3)
    got = quants.quantize(x, T.MXFP4)
    want = np.frombuffer(b"".join(ref.mxfp4_block(r) for r in x), dtype=np.uint8).reshape(got.shape)
    assert np.array_equal(got, want)


def test_mxfp4_dequantize_values_and_idempotence():
    x = np.random.default_rng(4).standard_normal((32, 128)).astype(F) * 3
    raw = quants.quantize(x, T.MXFP4)
    y = quants.dequantize(raw, T.MXFP4, x.size)
    e = raw.reshape(-1, 17)[:, 0].astype(np.float64)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    scaled = np.abs(y.reshape(-1, 32)) / 2.0 ** (e[:, None] - 127)
    assert np.all(np.isin(scaled, grid))
    assert np.array_equal(quants.quantize(y.reshape(x.shape), T.MXFP4), raw)
    # nearest grid point: error at most half the widest gap (1 unit of 2^(e-127)), except
    # above the top value 6 where amax < 8 units is clipped (up to 2 units)
    err = np.abs(x - y.reshape(x.shape)).reshape(-1, 32) / 2.0 ** (e[:, None] - 127)
    big = np.abs(x).reshape(-1, 32) / 2.0 ** (e[:, None] - 127) > 6
    assert np.all(err[~big] <= 1) and np.all(err[big] < 2)


# ---------------------------------------------------------------- Q4_K


def test_q4_k_zero_block_is_all_zero_bytes():
    assert not quants.quantize(np.zeros((2, 256), F), T.Q4_K).any()


def test_q4_k_hand_block_exact_ramp():
    # every sub-block is 0..15 twice: min 0, scale 1 is exact, no search step beats error 0.
    # d = fp16(1/63), every 6-bit scale 63, dmin 0, levels = the ramp itself.
    x = np.tile(np.arange(16, dtype=F), 16)
    raw = quants.quantize(x, T.Q4_K)
    assert raw.shape == (144,)
    assert raw[0:2].tobytes() == np.array([1 / 63], dtype=np.float16).tobytes()
    assert raw[2:4].tobytes() == b"\x00\x00"
    assert raw[4:8].tolist() == [63 | (3 << 6)] * 4  # low scales + top bits of scales 4..7
    assert raw[8:12].tolist() == [0] * 4  # mins 0..3 (+ top bits of mins 4..7)
    assert raw[12:16].tolist() == [15] * 4  # low nibbles of scales/mins 4..7
    qs = raw[16:].reshape(4, 32)
    assert np.array_equal(qs & 0xF, np.tile(np.tile(np.arange(16), 2), (4, 1)))
    assert np.array_equal(qs >> 4, qs & 0xF)
    y = quants.dequantize(raw, T.Q4_K, 256)
    d = F(np.float16(1 / 63)) * F(63)
    assert np.array_equal(y, x * d)


def test_q4_k_equals_scalar_reference():
    x = varied_blocks(14, 256, seed=5)
    got = quants.quantize(x, T.Q4_K)
    want = np.frombuffer(b"".join(ref.q4_k_block(r) for r in x), dtype=np.uint8).reshape(got.shape)
    assert np.array_equal(got, want)


def test_q4_k_gaussian_error():
    x = np.random.default_rng(6).standard_normal((16, 1024)).astype(F)
    y = quants.dequantize(quants.quantize(x, T.Q4_K), T.Q4_K, x.size).reshape(x.shape)
    rel = np.sqrt(np.mean((x - y) ** 2)) / np.sqrt(np.mean(x**2))
    assert 0.03 < rel < 0.12  # 4.5 bits per weight: about 9% RMS on gaussian data


def test_q4_k_chunking_does_not_change_bytes(monkeypatch):
    x = varied_blocks(40, 256, seed=7)
    whole = quants.quantize(x, T.Q4_K)
    monkeypatch.setattr(q4_k, "CHUNK_BLOCKS", 3)
    assert np.array_equal(quants.quantize(x, T.Q4_K), whole)


def test_axis0_reduction_is_sequential():
    """The Q4_K codec relies on numpy reducing axis 0 of a C-contiguous array row by row."""
    scale = 10.0 ** np.arange(-4, 4).repeat(512)
    a = (np.random.default_rng(8).standard_normal((32, 4096)) * scale).astype(F)
    s = a[0].copy()
    for row in a[1:]:
        s = s + row
    assert np.array_equal(np.add.reduce(a, axis=0), s)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4, T.Q4_K], ids=lambda t: t.name)
def test_inf_and_nan_inputs_do_not_raise(qtype):
    x = np.random.default_rng(9).standard_normal(256).astype(F)
    x[[3, 40, 200]] = [np.inf, -np.inf, np.nan]
    raw = quants.quantize(x, qtype)
    assert raw.shape == (quants.row_bytes(qtype, 256),)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, 32, elements=finite_f32))
def test_q8_0_and_mxfp4_any_finite_block_match_scalar_reference(x):
    assert quants.quantize(x, T.Q8_0).tobytes() == ref.q8_0_block(x)
    assert quants.quantize(x, T.MXFP4).tobytes() == ref.mxfp4_block(x)


@settings(max_examples=15, deadline=None)
@given(hnp.arrays(np.float32, 256, elements=st.floats(-1e6, 1e6, width=32)))
def test_q4_k_any_block_matches_scalar_reference(x):
    assert quants.quantize(x, T.Q4_K).tobytes() == ref.q4_k_block(x)
