"""Q4_K: 256 weights per 144-byte super-block, bit-exact with ggml's `quantize_row_q4_K_ref`.

Layout: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles
(byte 32*c + l holds element 64*c + l in the low nibble and 64*c + 32 + l in the high one).
Weight = d*sc*q - dmin*m for each 32-weight sub-block.

Each sub-block gets ggml's `make_qkx2_quants` (nmax 15, weights sqrt(mean x^2) + |x|, a
21-step search of the inverse scale that refits scale and min by weighted least squares).
To match ggml to the bit every float32 operation happens in C's order:

* Sub-blocks are laid out element-major, (32, n): element i of every sub-block is one
  contiguous row. A C loop `s += f(x[i])` is then a reduction over axis 0, which numpy does
  row after row in order (never pairwise: that only applies along the contiguous axis).
* The search moves `min` (and so the grid `iscale*(x - min)`) as soon as a step improves.
* `nearest_int` is a float32 add of 1.5*2^23 and a read of the mantissa bits. Inside its
  range it is round-half-even (`np.rint`); outside (possible for degenerate data) the bits
  are reproduced literally.
* No fused multiply-adds: ggml-base is built without -march, so x86-64 baseline, no FMA.

Checked against libggml on finite data of every kind and on inf/NaN inputs. Not reproduced:
blocks holding several NaNs with different payloads (which payload survives a C `a + b` of
two NaNs depends on the compiler's operand order).
"""

from __future__ import annotations

import numpy as np

from .float import fp16_bits_to_fp32, fp32_to_fp16_bits

BLOCK = 256
BLOCK_BYTES = 144
SUB = 32
CHUNK_BLOCKS = 256  # super-blocks per pass: keeps the (32, n) work arrays in L2

_F = np.float32
_MAGIC = _F(12582912.0)  # 1.5 * 2^23
_NI_LIMIT = _F(4194303.0)  # |v| up to this, nearest_int(v) == rint(v)
# iscale numerators of the 21 search steps, rmin + rdelta*is + nmax evaluated in float32
_STEPS = [(_F(-1.0) + _F(0.1) * _F(i)) + _F(15) for i in range(21)]


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int, literally: float32 add of 1.5*2^23, low 23 mantissa bits - 2^22."""
    t = (np.asarray(v, dtype=_F) + _MAGIC).view(np.int32)
    return (t & 0x007FFFFF) - 0x00400000


def _levels(xs: np.ndarray, mn: np.ndarray, iscale: np.ndarray, bound: np.ndarray,
            out: np.ndarray) -> np.ndarray:
    """clamp(nearest_int(iscale*(x - min)), 0, 15) as float32 into `out`.

    `bound` is max|x - min| per sub-block (float32 rounding is monotone, so every
    |iscale*(x - min)| is at most |iscale|*bound); when all of them are in nearest_int's
    exact range a plain rint does, otherwise the mantissa trick runs on the whole chunk.
    """
    np.subtract(xs, mn, out=out)
    out *= iscale
    reach = np.abs(iscale) * bound
    if np.all((reach <= _NI_LIMIT) | (bound == 0)):
        np.rint(out, out=out)
        np.clip(out, 0, 15, out=out)
    else:
        li = nearest_int(out)
        np.clip(li, 0, 15, out=li)
        out[...] = li
    return out


def _search(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants on the (32, n) sub-blocks: returns (L as float32 (32, n), scale, min).

    `min` is returned as ggml's `the_min` (= -min, a non-negative offset). The winning levels
    are not copied at every improving step (a masked copy of the whole array costs more than
    the step); the step's inputs (iscale, min) are kept and the levels recomputed once.
    """
    w = xs * xs
    sum_x2 = np.add.reduce(w, axis=0)
    av_x = np.sqrt(sum_x2 / _F(32))
    np.abs(xs, out=w)
    w += av_x  # weights[l] = av_x + |x|
    xmin = xs.min(axis=0)
    xmax = xs.max(axis=0)
    if np.isnan(xmin).any():  # C's `if (x < min)` skips NaNs after x[0]
        xmin, xmax = xs[0].copy(), xs[0].copy()
        for row in xs[1:]:
            np.copyto(xmin, row, where=row < xmin)
            np.copyto(xmax, row, where=row > xmax)
    tmp = w * xs
    sum_w = np.add.reduce(w, axis=0)
    sum_x = np.add.reduce(tmp, axis=0)
    mn = np.where(xmin > 0, _F(0), xmin)
    flat = xmax == mn
    mn0 = mn

    def bound(m: np.ndarray) -> np.ndarray:
        # flat sub-blocks (results discarded) get 0 so they never force the slow path
        return np.where(flat, _F(0), np.maximum(np.abs(xmax - m), np.abs(m - xmin)))

    iscale = _F(15) / (xmax - mn)
    scale = _F(1) / iscale
    la = _levels(xs, mn, iscale, bound(mn), np.empty_like(xs))
    np.multiply(la, scale, out=tmp)
    tmp += mn
    tmp -= xs
    tmp *= tmp
    tmp *= w
    best = np.add.reduce(tmp, axis=0)
    best_iscale, best_from = iscale, mn  # what the current best levels were made of

    wl = np.empty_like(xs)
    for step in _STEPS:
        iscale = step / (xmax - mn)
        _levels(xs, mn, iscale, bound(mn), la)
        np.multiply(w, la, out=wl)
        sum_l = np.add.reduce(wl, axis=0)
        np.multiply(wl, xs, out=tmp)
        sum_xl = np.add.reduce(tmp, axis=0)
        wl *= la
        sum_l2 = np.add.reduce(wl, axis=0)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        if pos.any():
            this_min[pos] = 0
            this_scale[pos] = sum_xl[pos] / sum_l2[pos]
        np.multiply(la, this_scale, out=tmp)
        tmp += this_min
        tmp -= xs
        tmp *= tmp
        tmp *= w
        cur = np.add.reduce(tmp, axis=0)
        better = (D > 0) & (cur < best)
        best = np.where(better, cur, best)
        best_iscale = np.where(better, iscale, best_iscale)
        best_from = np.where(better, mn, best_from)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)

    L = _levels(xs, best_from, best_iscale, bound(best_from), la)
    if flat.any():
        L[:, flat] = 0
        scale[flat] = 0
        mn[flat] = mn0[flat]
    return L, scale, -mn


def _quantize_chunk(x: np.ndarray, out: np.ndarray) -> None:
    nb = x.shape[0]
    xs = np.ascontiguousarray(x.reshape(nb * 8, SUB).T)  # (32, 8*nb) element-major
    L, scales, mins = _search(xs)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)

    max_scale = np.where(scales > 0, scales, _F(0)).max(axis=1)
    max_min = np.where(mins > 0, mins, _F(0)).max(axis=1)
    inv_scale = np.where(max_scale > 0, _F(63) / np.where(max_scale > 0, max_scale, _F(1)), _F(0))
    inv_min = np.where(max_min > 0, _F(63) / np.where(max_min > 0, max_min, _F(1)), _F(0))
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d16 = fp32_to_fp16_bits(max_scale / _F(63))
    m16 = fp32_to_fp16_bits(max_min / _F(63))

    # final levels against the fp16-rounded, 6-bit-quantized scales
    d = (fp16_bits_to_fp32(d16)[:, None] * ls.astype(_F)).reshape(-1)
    dm = (fp16_bits_to_fp32(m16)[:, None] * lm.astype(_F)).reshape(-1)
    live = d != 0  # ggml: `if (!d) continue;` keeps search levels
    v = xs + dm
    v /= np.where(live, d, _F(1))
    q = nearest_int(v)
    np.clip(q, 0, 15, out=q)
    q = np.where(live, q, L.astype(np.int32)).astype(np.uint8)
    q = q.T.reshape(nb, 4, 2, SUB)

    out[:, 0:2] = d16[:, None].view(np.uint8)
    out[:, 2:4] = m16[:, None].view(np.uint8)
    sc = out[:, 4:16]
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    out[:, 16:].reshape(nb, 4, SUB)[...] = q[:, :, 0, :] | (q[:, :, 1, :] << 4)


def quantize(x: np.ndarray) -> np.ndarray:
    """float32 (..., n) with n % 256 == 0 -> uint8 (..., n // 256 * 144)."""
    lead = x.shape[:-1]
    xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, BLOCK)
    out = np.empty((xb.shape[0], BLOCK_BYTES), dtype=np.uint8)
    with np.errstate(all="ignore"):
        for s in range(0, xb.shape[0], CHUNK_BLOCKS):
            _quantize_chunk(xb[s : s + CHUNK_BLOCKS], out[s : s + CHUNK_BLOCKS])
    return out.reshape(*lead, x.shape[-1] // BLOCK * BLOCK_BYTES)


def scales_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed scale bytes (nb, 12) -> 6-bit (scale, min) pairs, each (nb, 8) uint8.

    Shared by Q4_K and Q5_K (ggml's get_scale_min_k4).
    """
    s = np.empty((sc.shape[0], 8), dtype=np.uint8)
    m = np.empty((sc.shape[0], 8), dtype=np.uint8)
    s[:, :4] = sc[:, 0:4] & 63
    m[:, :4] = sc[:, 4:8] & 63
    s[:, 4:] = (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)
    m[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return s, m


@np.errstate(over="ignore", invalid="ignore")
def dequantize(raw: np.ndarray) -> np.ndarray:
    """uint8 super-blocks -> flat float32: (d*sc)*q - dmin*m, in float32 like ggml."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, BLOCK_BYTES)
    nb = b.shape[0]
    d = fp16_bits_to_fp32(b[:, 0:2].copy().view(np.uint16)[:, 0])
    dmin = fp16_bits_to_fp32(b[:, 2:4].copy().view(np.uint16)[:, 0])
    s, m = scales_mins(b[:, 4:16])
    d1 = (d[:, None] * s.astype(_F))[:, :, None]  # (nb, 8, 1)
    m1 = (dmin[:, None] * m.astype(_F))[:, :, None]
    qs = b[:, 16:].reshape(nb, 4, 1, SUB)
    nibbles = np.empty((nb, 4, 2, SUB), dtype=_F)  # (.., low/high nibble, ..)
    nibbles[:, :, 0:1] = qs & 0xF
    nibbles[:, :, 1:2] = qs >> 4
    q = nibbles.reshape(nb, 8, SUB)
    q *= d1
    q -= m1
    return q.reshape(-1)
