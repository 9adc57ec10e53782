"""Torch dequant kernels vs a scalar numpy transcription of ggml's dequantize_row_* (bitwise).

The reference below walks each block element by element in np.float32, mirroring the C
loops (products in C evaluation order, each rounded to float32). It is deliberately slow
and obvious; the torch kernels are the fast, vectorised side under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from k3kit.runtime.dequant import SUPPORTED, block_size, dequantize, nbytes_for

F = np.float32
KVALUES_MXFP4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def _f16(b: np.ndarray) -> np.float32:
    return F(b[:2].copy().view(np.float16)[0])


def _e8m0_half(e: int) -> np.float32:
    bits = (0x00200000 << e) if e < 2 else (e - 1) << 23
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    q = [int(v) for v in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_block(qtype: T, b: np.ndarray) -> list[np.float32]:
    y: list[np.float32] = []
    if qtype == T.Q8_0:
        d = _f16(b)
        return [F(int(v)) * d for v in b[2:].view(np.int8)]
    if qtype == T.MXFP4:
        d = _e8m0_half(int(b[0]))
        qs = b[1:]
        lo = [F(KVALUES_MXFP4[int(v) & 0xF]) * d for v in qs]
        hi = [F(KVALUES_MXFP4[int(v) >> 4]) * d for v in qs]
        return lo + hi
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[0:2]), _f16(b[2:4])
        scales = b[4:16]
        qh = b[16:48] if qtype == T.Q5_K else None
        ql = b[48:176] if qtype == T.Q5_K else b[16:144]
        u1, u2 = 1, 2
        for j in range(4):
            sc, m = _scale_min_k4(2 * j, scales)
            d1, m1 = d * F(sc), dmin * F(m)
            sc, m = _scale_min_k4(2 * j + 1, scales)
            d2, m2 = d * F(sc), dmin * F(m)
            q = ql[32 * j : 32 * j + 32]
            for lo_hi, (dd, mm, u) in enumerate(((d1, m1, u1), (d2, m2, u2))):
                for l in range(32):
                    v = (int(q[l]) >> (4 * lo_hi)) & 0xF
                    if qh is not None and int(qh[l]) & u:
                        v += 16
                    y.append(dd * F(v) - mm)
            u1 <<= 2
            u2 <<= 2
        return y
    if qtype == T.Q6_K:
        ql, qh, sc = b[0:128], b[128:192], b[192:208].view(np.int8)
        d = _f16(b[208:210])
        out = [F(0)] * 256
        for n in range(2):
            L, H, S = ql[64 * n :], qh[32 * n :], sc[8 * n :]
            for l in range(32):
                i = l // 16
                q1 = ((int(L[l]) & 0xF) | (((int(H[l]) >> 0) & 3) << 4)) - 32
                q2 = ((int(L[l + 32]) & 0xF) | (((int(H[l]) >> 2) & 3) << 4)) - 32
                q3 = ((int(L[l]) >> 4) | (((int(H[l]) >> 4) & 3) << 4)) - 32
                q4 = ((int(L[l + 32]) >> 4) | (((int(H[l]) >> 6) & 3) << 4)) - 32
                for k, (q, s) in enumerate(((q1, S[i]), (q2, S[i + 2]), (q3, S[i + 4]), (q4, S[i + 6]))):
                    out[128 * n + 32 * k + l] = d * F(int(s)) * F(q)
        return out
    raise AssertionError(qtype)


def reference(qtype: T, raw: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # random scales overflow and make NaNs, like in C
        return _reference(qtype, raw)


def _reference(qtype: T, raw: np.ndarray) -> np.ndarray:
    if qtype == T.F32:
        return raw.view(np.float32).copy()
    if qtype == T.F16:
        # numpy converts half signalling NaNs without quieting them; ggml (F16C or its bit
        # twiddling) and torch set the quiet bit, as IEEE conversion does.
        y = raw.view(np.float16).astype(np.float32)
        y.view(np.uint32)[np.isnan(y)] |= 0x00400000
        return y
    if qtype == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    _, bb = block_size(qtype)
    out: list[np.float32] = []
    for blk in raw.reshape(-1, bb):
        out.extend(ref_block(qtype, blk))
    return np.array(out, dtype=np.float32)


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator, sane_scales: bool) -> np.ndarray:
    """Random bytes; with sane_scales the f16 scales are finite and moderate (no NaN/inf)."""
    elems, bb = block_size(qtype)
    raw = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8)
    if sane_scales:
        def put_f16(col: int) -> None:
            d = rng.uniform(-2, 2, n_blocks).astype(np.float16)
            raw[:, col : col + 2] = d.view(np.uint8).reshape(-1, 2)

        if qtype == T.Q8_0:
            put_f16(0)
        elif qtype in (T.Q4_K, T.Q5_K):
            put_f16(0)
            put_f16(2)
        elif qtype == T.Q6_K:
            put_f16(208)
        elif qtype in (T.F16, T.BF16, T.F32):
            vals = rng.standard_normal(n_blocks * elems).astype(np.float32)
            dt = {T.F16: np.float16, T.F32: np.float32}.get(qtype)
            if dt is None:  # bf16: the top half of float32
                raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            else:
                raw = vals.astype(dt).view(np.uint8)
    return raw.reshape(-1)


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    """Equal float32 bit patterns, NaN payloads included."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{bad.size} mismatches, first at {i}: {got[i]!r} != {want[i]!r}")


TYPES = [T.MXFP4, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32]


def test_supported_types_are_the_ones_tested():
    assert set(TYPES) == set(SUPPORTED)


@pytest.mark.parametrize("sane", [True, False], ids=["sane-scales", "raw-bytes"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_torch_matches_scalar_reference_bitwise(qtype, sane):
    rng = np.random.default_rng(int(qtype) * 7 + sane)
    elems, _ = block_size(qtype)
    n_blocks = max(1, 2048 // elems)  # 2048 values per type
    raw = random_blocks(qtype, n_blocks, rng, sane)
    n_in = elems * n_blocks // 2 if n_blocks % 2 == 0 else elems * n_blocks
    shape = (n_in, n_blocks * elems // n_in)
    got = dequantize(raw, qtype, shape)
    assert got.shape == (shape[1], shape[0]) and got.dtype == torch.float32
    assert_bitwise(got.numpy().reshape(-1), reference(qtype, raw))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_gguf_py_dequant(qtype):
    """A second, independent implementation: gguf-py's numpy dequantizers."""
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(100 + int(qtype))
    elems, bb = block_size(qtype)
    n_blocks = 8192 // elems
    raw = random_blocks(qtype, n_blocks, rng, sane_scales=True)
    with np.errstate(all="ignore"):
        want = gguf_dequantize(raw.reshape(4, -1), qtype).astype(np.float32).reshape(-1)
    got = dequantize(torch.from_numpy(raw), qtype, (n_blocks * elems // 4, 4)).numpy().reshape(-1)
    assert_bitwise(got, want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_k3kit_numpy_codecs(qtype):
    """Cross-check with the project's numpy codecs when they exist (k3kit.gguf.quants)."""
    quants = pytest.importorskip("k3kit.gguf.quants")
    if not hasattr(quants, "dequantize"):
        pytest.skip("k3kit.gguf.quants.dequantize not written yet")
    rng = np.random.default_rng(200 + int(qtype))
    elems, _ = block_size(qtype)
    n_blocks = 4096 // elems
    raw = random_blocks(qtype, n_blocks, rng, sane_scales=True)
    with np.errstate(all="ignore"):
        want = np.asarray(quants.dequantize(raw, qtype, n_blocks * elems), dtype=np.float32).reshape(-1)
    assert_bitwise(dequantize(raw, qtype, (n_blocks * elems,)).numpy(), want)


def test_mxfp4_edge_exponents():
    """e = 0 and 1 are subnormal scales in ggml; 255 overflows the largest values to inf."""
    raw = np.zeros((3, 17), dtype=np.uint8)
    raw[:, 0] = [0, 1, 255]
    raw[:, 1:] = np.arange(16, dtype=np.uint8) * 17  # byte j: both nibbles = j
    got = dequantize(raw, T.MXFP4, (96,)).numpy()
    assert_bitwise(got, reference(T.MXFP4, raw.reshape(-1)))
    assert got[1] == np.float32(2.0**-128) and got[32 + 7] == np.float32(12 * 2.0**-127)
    assert np.isinf(got[64 + 7]) and got[64 + 1] == np.float32(2.0**127)


def test_compute_dtype_is_one_rounding_of_float32():
    rng = np.random.default_rng(5)
    raw = random_blocks(T.Q4_K, 4, rng, sane_scales=True)
    f32 = dequantize(raw, T.Q4_K, (1024,))
    bf = dequantize(raw, T.Q4_K, (1024,), dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, f32.to(torch.bfloat16))


def test_accepts_unaligned_tensor_slices():
    rng = np.random.default_rng(6)
    raw = rng.standard_normal(65).astype(np.float32).view(np.uint8)
    buf = torch.from_numpy(np.concatenate([np.zeros(1, np.uint8), raw]))
    got = dequantize(buf[1 + 4 :], T.F32, (64,))  # starts 5 bytes into the buffer
    assert_bitwise(got.numpy(), raw[4:].view(np.float32))


def test_rejects_wrong_sizes_and_types():
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(np.zeros(33, np.uint8), T.Q8_0, (32,))
    with pytest.raises(ValueError, match="multiple"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (16, 2))
    with pytest.raises(ValueError, match="no torch dequant kernel"):
        dequantize(np.zeros(18, np.uint8), T.Q4_0, (32,))
    assert nbytes_for(T.MXFP4, 64) == 34 and nbytes_for(T.Q6_K, 512) == 420


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_chunked_equals_reference(monkeypatch, qtype):
    """Several kernel chunks, the last one partial, in float32 and through the bf16 scratch."""
    import k3kit.runtime.dequant as dq

    rng = np.random.default_rng(7 + int(qtype))
    elems, _ = block_size(qtype)
    n_blocks = 7 * 1024 // elems + 1
    raw = random_blocks(qtype, n_blocks, rng, sane_scales=True)
    monkeypatch.setattr(dq, "CHUNK_ELEMS", 2 * 256)  # 2 K-quant blocks, 16 MXFP4/Q8_0 blocks
    got = dequantize(raw, qtype, (n_blocks * elems,))
    assert_bitwise(got.numpy(), reference(qtype, raw))
    bf = dequantize(raw, qtype, (n_blocks * elems,), dtype=torch.bfloat16)
    assert torch.equal(bf, got.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [T.MXFP4, T.Q8_0], ids=lambda t: t.name)
def test_direct_narrow_output_is_one_rounding_of_float32(qtype, dtype):
    """MXFP4 writes 2-byte outputs from a table of pre-rounded values, Q8_0 through the float32
    scratch: every bit must equal float32 -> dtype, over all scale bytes (MXFP4 e = 0..255,
    subnormal and overflowing ones included; Q8_0 raw f16 scales, NaN and inf included)."""
    rng = np.random.default_rng(11 + int(qtype))
    elems, bb = block_size(qtype)
    raw = rng.integers(0, 256, size=(512, bb), dtype=np.uint8)
    raw[:256, 0] = np.arange(256)  # MXFP4: every e; Q8_0: every low byte of the f16 scale
    raw[256:, 1 if qtype == T.Q8_0 else 0] = np.arange(256)  # Q8_0: every high byte (sign, exp)
    shape = (elems * 4, 128)
    f32 = dequantize(raw.reshape(-1), qtype, shape)
    assert_bitwise(f32.numpy().reshape(-1), reference(qtype, raw.reshape(-1)))
    got = dequantize(raw.reshape(-1), qtype, shape, dtype=dtype)
    assert got.dtype == dtype and got.shape == f32.shape
    assert torch.equal(got.view(torch.int16), f32.to(dtype).view(torch.int16))


def test_mxfp4_table_kernel_across_chunks_and_dtypes(monkeypatch):
    """The table kernel on several chunks (last one partial) into float32 and bf16 outputs."""
    import k3kit.runtime.dequant as dq

    rng = np.random.default_rng(12)
    raw = rng.integers(0, 256, size=(37, 17), dtype=np.uint8).reshape(-1)
    monkeypatch.setattr(dq, "CHUNK_ELEMS", 8 * 32)
    want = reference(T.MXFP4, raw)
    got = dequantize(raw, T.MXFP4, (37 * 32,))
    assert_bitwise(got.numpy(), want)
    bf = dequantize(raw, T.MXFP4, (37 * 32,), dtype=torch.bfloat16)
    assert torch.equal(bf.view(torch.int16), torch.from_numpy(want).to(torch.bfloat16).view(torch.int16))
