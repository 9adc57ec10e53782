"""Triton tile decoders: one ggml type's bytes -> a float32 weight tile, in registers.

Every kernel of this package walks a weight row in tiles of TILE_K = 256 values (one K-quant
super-block, eight Q8_0/MXFP4 blocks, 256 floats) and asks `tile()` for a [BN, G, S] tile of BN
rows: G scale groups of S values each, so a group's scale is loaded once ([BN, G, 1]) and
broadcast over its S values. `tile()` also returns each value's column in the row ([1, G, S]):
a type whose bytes interleave its values (nibbles) is decoded in byte order and the kernels read
x, or write the output, at those columns, so no tile is ever permuted in registers.

The arithmetic is the CPU dequantizer's (k3kit.kernels.dequant, ggml's dequantize_row_*) product
by product, each rounded to float32, so a kernel compiled without FP contraction gives the
same bits (kernels/gpu/kernels.py's dequantize launches it so). NaN payloads are not kept: GPU
arithmetic makes every NaN canonical (a corrupt block still dequantizes to NaN).

This module imports triton; k3kit.kernels.gpu imports it only when a kernel first runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3kit.gguf.quants import gguf_py

TILE_K = 256
# ggml type ids (GGMLQuantizationType values): jit code reads globals only as constexprs
F16 = tl.constexpr(1)
Q8_0 = tl.constexpr(8)
Q5_K = tl.constexpr(13)
Q4_K = tl.constexpr(12)
Q6_K = tl.constexpr(14)
BF16 = tl.constexpr(30)
MXFP4 = tl.constexpr(39)
IQ4_NL = tl.constexpr(20)
IQ4_XS = tl.constexpr(23)
# (G, S) of each type's tile: G * S == TILE_K; S is the values that share one scale
GROUPS = {1: (8, 32), 8: (8, 32), 12: (8, 32), 13: (8, 32), 14: (16, 16), 30: (8, 32), 39: (8, 32),
          20: (8, 32), 23: (8, 32)}


def _packed_kvalues() -> list[int]:
    """kvalues_iq4nl + 128 as four little-endian words of 4 bytes (< 2^32: int64 constants, no
    table argument for the kernels to carry)."""
    kv = [int(v) + 128 for v in gguf_py.KVALUES_IQ4NL]
    return [sum(kv[4 * w + i] << (8 * i) for i in range(4)) for w in range(4)]


_W = _packed_kvalues()
KV4_0, KV4_1, KV4_2, KV4_3 = (tl.constexpr(w) for w in _W)


@triton.jit
def _byte(p, mask):
    """uint8 at `p` as int32 (0 where masked)."""
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The little-endian fp16 at `p` (two bytes, any alignment) as float32: an exact conversion."""
    h = _byte(p, mask) | (_byte(p + 1, mask) << 8)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _columns(t, G: tl.constexpr, S: tl.constexpr):
    """Group index g [1, G, 1], index in group s [1, 1, S] and row column t*256 + g*S + s [1, G, S]."""
    g = tl.arange(0, G)[None, :, None]
    s = tl.arange(0, S)[None, None, :]
    return g, s, t * (G * S) + g * S + s


@triton.jit
def _q8_0(row, t, nmask, K, G: tl.constexpr, S: tl.constexpr):
    """8 blocks of f16 d, int8 qs[32]: q * d."""
    g, s, k = _columns(t, G, S)
    blk = t * G + g                                     # block of the row
    ok = nmask & (blk * 32 < K)
    base = row + blk * 34
    d = _f16(base, ok)                                  # [BN, G, 1]
    q = tl.load(base + 2 + s, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return q * d, k


@triton.jit
def _mxfp4(row, t, nmask, K, G: tl.constexpr, S: tl.constexpr):
    """8 blocks of e8m0 e, qs[16] (value j: low nibble of byte j, j + 16: its high nibble):
    kvalues_mxfp4[nibble] * ggml_e8m0_to_fp32_half(e)."""
    g, s, k = _columns(t, G, S)
    blk = t * G + g
    ok = nmask & (blk * 32 < K)
    base = row + blk * 17
    e = _byte(base, ok)
    bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
    d = bits.to(tl.float32, bitcast=True)               # 2^(e - 128), subnormal below e = 2
    byte = _byte(base + 1 + (s % 16), ok)
    nib = tl.where(s < 16, byte & 15, byte >> 4)
    mag = nib & 7                                       # e2m1 doubled: 0 1 2 3 4 6 8 12
    v = tl.where(mag < 4, mag, (2 + (mag & 1)) << ((mag >> 1) - 1))
    v = tl.where(nib >= 8, -v, v)
    return v.to(tl.float32) * d, k


@triton.jit
def _k_scale_min(sb, g, ok):
    """get_scale_min_k4 for sub-block g of the 12 packed bytes at `sb`: (scale, min) as float32."""
    lo = g < 4
    sj = _byte(sb + g, ok)
    sj4 = _byte(sb + g + 4, ok)
    sjm4 = _byte(sb + tl.where(lo, g, g - 4), ok)
    sc = tl.where(lo, sj & 63, (sj4 & 0xF) | ((sjm4 >> 6) << 4))
    m = tl.where(lo, sj4 & 63, (sj4 >> 4) | ((sj >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _q45_k(row, t, nmask, FIVE: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    """Q4_K (f16 d, f16 dmin, scales[12], qs[128]) and Q5_K (... scales[12], qh[32], qs[128]):
    (d * sc) * q - dmin * m per 32-value sub-block g; q is nibble g % 2 of qs[32 (g // 2) + s]
    (| bit g of qh[s] << 4 for Q5_K)."""
    g, s, k = _columns(t, G, S)
    base = row + t * (176 if FIVE else 144)
    d = _f16(base, nmask)                               # [BN, 1, 1]
    dmin = _f16(base + 2, nmask)
    sc, m = _k_scale_min(base + 4, g, nmask)            # [BN, G, 1]
    d1 = d * sc
    m1 = dmin * m
    qs = base + (48 if FIVE else 16)
    byte = _byte(qs + 32 * (g // 2) + s, nmask)
    q = tl.where(g % 2 == 0, byte & 15, byte >> 4)
    if FIVE:
        q = q | (((_byte(base + 16 + s, nmask) >> g) & 1) << 4)
    return q.to(tl.float32) * d1 - m1, k


@triton.jit
def _q6_k(row, t, nmask, G: tl.constexpr, S: tl.constexpr):
    """ql[128], qh[64], int8 scales[16], f16 d: d * sc[g] * (q6 - 32) per 16 values; value
    128 h + 32 j + l takes nibble j // 2 of ql[64 h + 32 (j % 2) + l] and bits 2j of qh[32 h + l]."""
    g, s, k = _columns(t, G, S)
    base = row + t * 210
    h = g // 8
    j = (g % 8) // 2
    lane = 16 * (g % 2) + s
    ql = _byte(base + 64 * h + 32 * (j % 2) + lane, nmask)
    qh = _byte(base + 128 + 32 * h + lane, nmask)
    q = ((ql >> (4 * (j // 2))) & 15) | (((qh >> (2 * j)) & 3) << 4)
    sc = tl.load(base + 192 + g, mask=nmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d = _f16(base + 208, nmask)
    return (q - 32).to(tl.float32) * (d * sc), k


@triton.jit
def _half(row, t, nmask, K, BRAIN: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    """F16 / BF16 values, two bytes each: widened exactly to float32."""
    g, s, k = _columns(t, G, S)
    ok = nmask & (k < K)
    p = row + 2 * k
    h = _byte(p, ok) | (_byte(p + 1, ok) << 8)
    if BRAIN:
        w = (h << 16).to(tl.float32, bitcast=True)
    else:
        w = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return w, k


@triton.jit
def _kvalue(nib):
    """kvalues_iq4nl[nib] as float32 (nib: int32 0..15)."""
    q = nib >> 2
    word = tl.where(q == 0, KV4_0, tl.where(q == 1, KV4_1, tl.where(q == 2, KV4_2, KV4_3))).to(tl.int64)
    return (((word >> (8 * (nib & 3)).to(tl.int64)) & 0xFF).to(tl.int32) - 128).to(tl.float32)


@triton.jit
def _iq4_nl(row, t, nmask, K, G: tl.constexpr, S: tl.constexpr):
    """8 blocks of f16 d, qs[16] (value j: low nibble of byte j, j + 16: its high nibble):
    kvalues_iq4nl[nibble] * d."""
    g, s, k = _columns(t, G, S)
    blk = t * G + g
    ok = nmask & (blk * 32 < K)
    base = row + blk * 18
    d = _f16(base, ok)
    byte = _byte(base + 2 + (s % 16), ok)
    return _kvalue(tl.where(s < 16, byte & 15, byte >> 4)) * d, k


@triton.jit
def _iq4_xs(row, t, nmask, G: tl.constexpr, S: tl.constexpr):
    """f16 d, uint16 scales_h, scales_l[4], qs[128]: kvalues_iq4nl[nibble] * (d * (ls - 32)) per
    32 values g, ls = nibble g % 2 of scales_l[g // 2] | bits 2g of scales_h << 4; value j of g:
    low nibble of qs[16 g + j], j + 16: its high nibble."""
    g, s, k = _columns(t, G, S)
    base = row + t * 136
    d = _f16(base, nmask)
    sh = _byte(base + 2, nmask) | (_byte(base + 3, nmask) << 8)
    sl = _byte(base + 4 + g // 2, nmask)
    ls = ((sl >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4)
    dl = d * (ls - 32).to(tl.float32)
    byte = _byte(base + 8 + 16 * g + (s % 16), nmask)
    return _kvalue(tl.where(s < 16, byte & 15, byte >> 4)) * dl, k


@triton.jit
def tile(QT: tl.constexpr, row, t, nmask, K, G: tl.constexpr, S: tl.constexpr):
    """Tile t (values t*256 .. t*256 + 255) of the rows at `row` (uint8 pointers [BN, 1, 1]) of
    ggml type QT: (float32 [BN, G, S], row columns [1, G, S]). Rows outside `nmask` and values
    at columns >= K come out 0 (K: the row length, a whole number of blocks)."""
    if QT == Q8_0:
        w, k = _q8_0(row, t, nmask, K, G, S)
    elif QT == MXFP4:
        w, k = _mxfp4(row, t, nmask, K, G, S)
    elif QT == Q4_K:
        w, k = _q45_k(row, t, nmask, False, G, S)
    elif QT == Q5_K:
        w, k = _q45_k(row, t, nmask, True, G, S)
    elif QT == Q6_K:
        w, k = _q6_k(row, t, nmask, G, S)
    elif QT == F16:
        w, k = _half(row, t, nmask, K, False, G, S)
    elif QT == IQ4_NL:
        w, k = _iq4_nl(row, t, nmask, K, G, S)
    elif QT == IQ4_XS:
        w, k = _iq4_xs(row, t, nmask, G, S)
    else:
        tl.static_assert(QT == BF16, "no Triton decoder for this ggml type")
        w, k = _half(row, t, nmask, K, True, G, S)
    return w, k
