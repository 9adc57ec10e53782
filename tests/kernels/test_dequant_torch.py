"""Torch dequant kernels vs a scalar numpy transcription of ggml's dequantize_row_* (bitwise).

The reference below walks each block element by element in np.float32, mirroring the C
loops (products in C evaluation order, each rounded to float32). It is deliberately slow
and obvious; the torch kernels are the fast, vectorised side under test. The IQ grids, the
ksigns table and kvalues_iq4nl are gguf-py's data (the same the kernels use; their match
with libggml is tests/interop's job).
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings

from k3kit.gguf import quants
from k3kit.kernels.dequant import SUPPORTED, block_size, dequantize, nbytes_for

F = np.float32
KVALUES_MXFP4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
# Types added for issue 12: every other quantized type gguf 0.19 lists.
NEW_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q1_0, T.Q2_K, T.Q3_K, T.TQ1_0, T.TQ2_0,
             T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
             T.NVFP4]
# Their sign is applied as a float product `* (+-1.f)`; ggml's compiled loop flips the sign
# bit instead, which differs only for NaNs (a NaN block scale). Such blocks are corrupt
# (quants.check_finite rejects them), so for these types NaN signs are not compared.
NAN_SIGN_FREE = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S})


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


def _u32(b: np.ndarray) -> int:
    return int.from_bytes(bytes(b[:4]), "little")


def _u16s(b: np.ndarray) -> list[int]:
    return [int(b[2 * i]) | (int(b[2 * i + 1]) << 8) for i in range(len(b) // 2)]


def _sign(signs: int, j: int) -> np.float32:
    return F(-1.0) if signs & (1 << j) else F(1.0)


def _c_add(a: np.float32, b: np.float32) -> np.float32:
    """a + b with C's NaN rule (both NaN: a's payload); numpy's scalar add returns b's."""
    return (np.array([a], F) + np.array([b], F))[0]


def _ue4m3(x: int) -> np.float32:
    """ggml_ue4m3_to_fp32, transcribed."""
    if x in (0, 0x7F):
        return F(0)
    e, m = (x >> 3) & 0xF, x & 7
    raw = F(math.ldexp(m, -9)) if e == 0 else F(math.ldexp(1.0 + m / 8.0, e - 7))
    return raw * F(0.5)


def _tables():
    from k3kit.gguf.quants import gguf_py

    iq = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S)
    g = {t: gguf_py.grid(t).astype(np.int64).tolist() for t in iq}
    return g, [int(v) for v in gguf_py.KSIGNS], [int(v) for v in gguf_py.KVALUES_IQ4NL]


def ref_block(qtype: T, b: np.ndarray) -> list[np.float32]:
    """One block of `qtype`, ggml's dequantize_row_* loop by loop in float32 scalars."""
    y: list[np.float32] = []
    if qtype in NEW_TYPES:
        return _ref_new(qtype, b)
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


def _ref_new(qtype: T, b: np.ndarray) -> list[np.float32]:
    """The types added for issue 12 (grids, signs and kvalues are gguf-py's data)."""
    grids, ksigns, kv_iq4 = _tables()
    y: list[np.float32] = []
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        d = _f16(b[0:2])
        m = _f16(b[2:4]) if qtype in (T.Q4_1, T.Q5_1) else None
        qh = _u32(b[2 + (m is not None) * 2 :]) if qtype in (T.Q5_0, T.Q5_1) else None
        qs = b[len(b) - 16 :]
        out = [F(0)] * 32
        for j in range(16):
            x0, x1 = int(qs[j]) & 0xF, int(qs[j]) >> 4
            if qh is not None:
                x0 |= ((qh >> j) << 4) & 0x10
                x1 |= (qh >> (j + 12)) & 0x10
            off = 0 if m is not None else (16 if qh is not None else 8)
            for k, x in ((j, x0), (j + 16, x1)):
                v = F(x - off) * d
                out[k] = _c_add(v, m) if m is not None else v
        return out
    if qtype == T.Q1_0:
        d = _f16(b[0:2])
        return [d if (int(b[2 + j // 8]) >> (j % 8)) & 1 else -d for j in range(128)]
    if qtype == T.Q2_K:
        d, dmin = _f16(b[80:82]), _f16(b[82:84])
        is_ = 0
        for n in range(2):
            q = b[16 + 32 * n :]
            for shift in (0, 2, 4, 6):
                for half in range(2):
                    sc = int(b[is_])
                    is_ += 1
                    dl, ml = d * F(sc & 0xF), dmin * F(sc >> 4)
                    y += [dl * F((int(q[16 * half + l]) >> shift) & 3) - ml for l in range(16)]
        return y
    if qtype == T.Q3_K:
        d = _f16(b[108:110])
        aux = [_u32(b[96 + 4 * i :]) for i in range(3)] + [0]
        tmp, km1, km2 = aux[2], 0x03030303, 0x0F0F0F0F
        aux[2] = ((aux[0] >> 4) & km2) | (((tmp >> 4) & km1) << 4)
        aux[3] = ((aux[1] >> 4) & km2) | (((tmp >> 6) & km1) << 4)
        aux[0] = (aux[0] & km2) | (((tmp >> 0) & km1) << 4)
        aux[1] = (aux[1] & km2) | (((tmp >> 2) & km1) << 4)
        scales = np.array(aux, dtype=np.uint32).view(np.int8).tolist()
        hm, is_, m = b[0:32], 0, 1
        for n in range(2):
            q = b[32 + 32 * n :]
            for shift in (0, 2, 4, 6):
                for half in range(2):
                    dl = d * F(scales[is_] - 32)
                    is_ += 1
                    for l in range(16):
                        k = 16 * half + l
                        y.append(dl * F(((int(q[k]) >> shift) & 3) - (0 if int(hm[k]) & m else 4)))
                m <<= 1
        return y
    if qtype == T.TQ1_0:
        d = _f16(b[52:54])
        trit = lambda v, n: ((((v * 3**n) & 0xFF) * 3) >> 8) - 1  # noqa: E731
        for j, w in ((0, 32), (32, 16)):
            y += [F(trit(int(b[j + m]), n)) * d for n in range(5) for m in range(w)]
        y += [F(trit(int(b[48 + j]), n)) * d for n in range(4) for j in range(4)]
        return y
    if qtype == T.TQ2_0:
        d = _f16(b[64:66])
        return [F(((int(b[j + m]) >> (2 * l)) & 3) - 1) * d
                for j in (0, 32) for l in range(4) for m in range(32)]
    if qtype in (T.IQ2_XXS, T.IQ3_XXS):
        d = _f16(b[0:2])
        grid = grids[qtype]
        for ib in range(8):
            if qtype == T.IQ2_XXS:
                idx, aux = [int(v) for v in b[2 + 8 * ib : 6 + 8 * ib]], _u32(b[6 + 8 * ib :])
                db = d * (F(0.5) + F(aux >> 28)) * F(0.25)
            else:
                idx, aux = [int(v) for v in b[2 + 8 * ib : 10 + 8 * ib]], _u32(b[66 + 4 * ib :])
                db = d * (F(0.5) + F(aux >> 28)) * F(0.5)
            for l in range(4):
                signs = ksigns[(aux >> (7 * l)) & 127]
                vals = grid[idx[l]] if qtype == T.IQ2_XXS else grid[idx[2 * l]] + grid[idx[2 * l + 1]]
                y += [db * F(vals[j]) * _sign(signs, j) for j in range(8)]
        return y
    if qtype in (T.IQ2_XS, T.IQ2_S):
        d = _f16(b[0:2])
        grid = grids[qtype]
        scales = b[66:74] if qtype == T.IQ2_XS else b[74:82]
        words = _u16s(b[2:66]) if qtype == T.IQ2_XS else None
        for ib in range(8):
            db = [d * (F(0.5) + F((int(scales[ib]) >> s) & 0xF)) * F(0.25) for s in (0, 4)]
            for l in range(4):
                if words is not None:
                    w = words[4 * ib + l]
                    vals, signs = grid[w & 511], ksigns[w >> 9]
                else:
                    qh = int(b[66 + ib])
                    vals = grid[int(b[2 + 4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300)]
                    signs = int(b[34 + 4 * ib + l])
                y += [db[l // 2] * F(vals[j]) * _sign(signs, j) for j in range(8)]
        return y
    if qtype == T.IQ3_S:
        d = _f16(b[0:2])
        grid = grids[qtype]
        for ib in range(8):
            db = d * F(1 + 2 * ((int(b[106 + ib // 2]) >> (4 * (ib % 2))) & 0xF))
            qh = int(b[66 + ib])
            for l in range(4):
                g1 = grid[int(b[2 + 8 * ib + 2 * l]) | ((qh << (8 - 2 * l)) & 256)]
                g2 = grid[int(b[2 + 8 * ib + 2 * l + 1]) | ((qh << (7 - 2 * l)) & 256)]
                signs = int(b[74 + 4 * ib + l])
                y += [db * F((g1 + g2)[j]) * _sign(signs, j) for j in range(8)]
        return y
    if qtype in (T.IQ1_S, T.IQ1_M):
        grid, delta = grids[T.IQ1_S], F(0.125)
        if qtype == T.IQ1_S:
            d, qh = _f16(b[0:2]), _u16s(b[34:50])
            for ib in range(8):
                dl = d * F(2 * ((qh[ib] >> 12) & 7) + 1)
                dt = -delta if qh[ib] & 0x8000 else delta
                for l in range(4):
                    vals = grid[int(b[2 + 4 * ib + l]) | (((qh[ib] >> (3 * l)) & 7) << 8)]
                    y += [dl * (F(vals[j]) + dt) for j in range(8)]
            return y
        sc = _u16s(b[48:56])
        bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000)
        d = F(np.array([bits], dtype=np.uint16).view(np.float16)[0])
        for ib in range(8):
            s = sc[ib // 2] >> (6 * (ib % 2))
            dl = [d * F(2 * (s & 7) + 1), d * F(2 * ((s >> 3) & 7) + 1)]
            qh = [int(b[32 + 2 * ib]), int(b[33 + 2 * ib])]
            for l in range(4):
                nib = (qh[l // 2] >> (4 * (l % 2))) & 0xF
                vals = grid[int(b[4 * ib + l]) | ((nib & 7) << 8)]
                dt = -delta if nib & 8 else delta
                y += [dl[l // 2] * (F(vals[j]) + dt) for j in range(8)]
        return y
    if qtype == T.IQ4_NL:
        d = _f16(b[0:2])
        return [d * F(kv_iq4[int(v) & 0xF]) for v in b[2:18]] + [d * F(kv_iq4[int(v) >> 4]) for v in b[2:18]]
    if qtype == T.IQ4_XS:
        d, sh = _f16(b[0:2]), _u16s(b[2:4])[0]
        for ib in range(8):
            ls = ((int(b[4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)
            dl = d * F(ls - 32)
            qs = b[8 + 16 * ib : 24 + 16 * ib]
            y += [dl * F(kv_iq4[int(v) & 0xF]) for v in qs] + [dl * F(kv_iq4[int(v) >> 4]) for v in qs]
        return y
    if qtype == T.NVFP4:
        for s in range(4):
            d = _ue4m3(int(b[s]))
            qs = b[4 + 8 * s : 12 + 8 * s]
            y += [F(KVALUES_MXFP4[int(v) & 0xF]) * d for v in qs]
            y += [F(KVALUES_MXFP4[int(v) >> 4]) * d for v in qs]
        return y
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
    if sane_scales and qtype in NEW_TYPES:  # finite scales over the whole fp16 range
        return quants.random_blocks(qtype, n_blocks, rng).reshape(-1)
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


def assert_bitwise(got: np.ndarray, want: np.ndarray, nan_sign: bool = True) -> None:
    """Equal float32 bit patterns, NaN payloads included (and their signs unless nan_sign=False)."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    g, w = got.view(np.uint32), want.view(np.uint32)
    if not nan_sign:
        g, w = np.where(np.isnan(got), g & 0x7FFFFFFF, g), np.where(np.isnan(want), w & 0x7FFFFFFF, w)
    bad = np.flatnonzero(g != w)
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{bad.size} mismatches, first at {i}: {got[i]!r} != {want[i]!r}")


TYPES = [T.MXFP4, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32, *NEW_TYPES]


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
    nan_sign = sane or qtype not in NAN_SIGN_FREE
    assert_bitwise(got.numpy().reshape(-1), reference(qtype, raw), nan_sign=nan_sign)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_gguf_py_dequant(qtype):
    """A second, independent implementation: gguf-py's numpy dequantizers."""
    from gguf.quants import dequantize as gguf_dequantize

    if qtype == T.Q1_0:
        pytest.skip("gguf-py 0.19 has no Q1_0 codec")

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
        dequantize(np.zeros(292, np.uint8), T.Q8_K, (256,))  # ggml has no to_float for Q8_K
    assert nbytes_for(T.MXFP4, 64) == 34 and nbytes_for(T.Q6_K, 512) == 420


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_chunked_equals_reference(monkeypatch, qtype):
    """Several kernel chunks, the last one partial, in float32 and through the bf16 scratch."""
    import k3kit.kernels.dequant as dq

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
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_narrow_output_is_one_rounding_of_float32(qtype, dtype):
    """bf16 / f16 outputs are the float32 result rounded once, for every type (valid blocks,
    values up to fp16-scale * grid: some overflow f16 to inf, as the cast does)."""
    rng = np.random.default_rng(21 + int(qtype))
    elems, _ = block_size(qtype)
    n_blocks = 4096 // elems
    raw = random_blocks(qtype, n_blocks, rng, sane_scales=True)
    f32 = dequantize(raw, qtype, (n_blocks * elems,))
    got = dequantize(raw, qtype, (n_blocks * elems,), dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.int16), f32.to(dtype).view(torch.int16))


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
    import k3kit.kernels.dequant as dq

    rng = np.random.default_rng(12)
    raw = rng.integers(0, 256, size=(37, 17), dtype=np.uint8).reshape(-1)
    monkeypatch.setattr(dq, "CHUNK_ELEMS", 8 * 32)
    want = reference(T.MXFP4, raw)
    got = dequantize(raw, T.MXFP4, (37 * 32,))
    assert_bitwise(got.numpy(), want)
    bf = dequantize(raw, T.MXFP4, (37 * 32,), dtype=torch.bfloat16)
    assert torch.equal(bf.view(torch.int16), torch.from_numpy(want).to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_new_types_chunked_raw_bytes(monkeypatch, qtype):
    """Random bytes (NaN/inf scales included) across several chunks, the last one partial:
    equal to the scalar reference and to the numpy codecs."""
    import k3kit.kernels.dequant as dq

    rng = np.random.default_rng(31 + int(qtype))
    elems, bb = block_size(qtype)
    n_blocks = 7 * 512 // elems + 1
    raw = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8).reshape(-1)
    monkeypatch.setattr(dq, "CHUNK_ELEMS", 2 * 256)
    got = dequantize(raw, qtype, (n_blocks * elems,)).numpy()
    assert_bitwise(got, reference(qtype, raw), nan_sign=qtype not in NAN_SIGN_FREE)
    with np.errstate(all="ignore"):
        assert_bitwise(got, quants.dequantize(raw, qtype, n_blocks * elems))


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(TYPES), n_blocks=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
       chunk_blocks=st.integers(1, 9))
def test_torch_equals_numpy_on_valid_blocks(qtype, n_blocks, seed, chunk_blocks):
    """Any number of valid blocks, any chunking: torch float32 == k3kit's numpy bit for bit."""
    import k3kit.kernels.dequant as dq

    elems, _ = block_size(qtype)
    raw = quants.random_blocks(qtype, n_blocks, np.random.default_rng(seed)).reshape(-1)
    old = dq.CHUNK_ELEMS
    dq.CHUNK_ELEMS = chunk_blocks * elems
    try:
        got = dequantize(raw, qtype, (n_blocks * elems,)).numpy()
    finally:
        dq.CHUNK_ELEMS = old
    assert np.isfinite(got).all()
    assert_bitwise(got, quants.dequantize(raw, qtype, n_blocks * elems))


@pytest.mark.parametrize("qtype", [T.Q1_0, T.IQ4_NL, T.IQ2_XXS, T.NVFP4], ids=lambda t: t.name)
def test_hand_blocks(qtype):
    """A few blocks whose values follow from the layout by hand."""
    elems, bb = block_size(qtype)
    raw = np.zeros(bb, np.uint8)
    if qtype == T.Q1_0:  # d = 2, bits 1010...: +2, -2, +2, ... low bit first
        raw[0:2] = np.frombuffer(np.float16(2.0).tobytes(), np.uint8)
        raw[2:] = 0b01010101
        want = np.tile(np.array([2.0, -2.0], F), 64)
    elif qtype == T.IQ4_NL:  # d = 0.5, byte j = (15 - j) << 4 | j
        raw[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        raw[2:] = (np.arange(16) | ((15 - np.arange(16)) << 4)).astype(np.uint8)
        kv = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], F)
        want = np.concatenate([kv, kv[::-1]]) * F(0.5)
    elif qtype == T.IQ2_XXS:  # d = 4, every scale nibble 1 -> db = 4 * 1.5 * 0.25 = 1.5
        raw[0:2] = np.frombuffer(np.float16(4.0).tobytes(), np.uint8)
        q = raw[2:].reshape(8, 8)
        q[:, 0:4] = 0  # grid entry 0: all 0x08
        q[:, 4:8] = [1, 0, 0, 0x10]  # sign index 1 in group 0 (ksigns[1] = 0x81: lanes 0, 7)
        want = np.full(256, 1.5 * 8, F)
        for ib in range(8):
            want[32 * ib + 0] = want[32 * ib + 7] = -12.0
    else:  # NVFP4: scale bytes 0x38 (1.0 * 0.5), 0x40 (2.0 * 0.5), 0, 0x7F (0); nibble j
        raw[0:4] = [0x38, 0x40, 0x00, 0x7F]
        raw[4:] = np.tile((np.arange(8) | ((np.arange(8) + 8) << 4)).astype(np.uint8), 4)
        kv = np.array(KVALUES_MXFP4, F)
        want = np.concatenate([kv * F(0.5), kv * F(1.0), kv * F(0), kv * F(0)])
    got = dequantize(raw, qtype, (elems,)).numpy()
    assert_bitwise(got, want)
    assert_bitwise(quants.dequantize(raw, qtype, elems), want)


@pytest.mark.parametrize("qtype", [T.F16, T.Q5_K, T.Q4_1, T.IQ4_NL], ids=lambda t: t.name)
def test_nan_scale_in_the_tail_keeps_its_payload(qtype):
    """torch's fp16 -> fp32 tail loop turns some NaNs into 0x7fffffff (1171 values, index
    1169): the kernels rebuild NaNs from their bits, as ggml does."""
    elems, bb = block_size(qtype)
    raw = random_blocks(qtype, 1171, np.random.default_rng(41), sane_scales=True).reshape(1171, bb)
    col = {T.F16: 0, T.Q5_K: 2, T.Q4_1: 2, T.IQ4_NL: 0}[qtype]  # F16 value, dmin, m, d
    raw[1169, col : col + 2] = np.array([0x7E3A], "<u2").view(np.uint8)
    raw[3, col : col + 2] = np.array([0xFD01], "<u2").view(np.uint8)  # signalling: comes out quiet
    got = dequantize(raw.reshape(-1), qtype, (1171 * elems,)).numpy()
    assert_bitwise(got, reference(qtype, raw.reshape(-1)))
    assert got.view(np.uint32)[1169 * elems] == 0x7FC74000
