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
Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q5_1 = tl.constexpr(7)
Q2_K = tl.constexpr(10)
Q3_K = tl.constexpr(11)
Q5_K = tl.constexpr(13)
TQ1_0 = tl.constexpr(34)
TQ2_0 = tl.constexpr(35)
IQ2_XXS = tl.constexpr(16)
IQ2_XS = tl.constexpr(17)
IQ3_XXS = tl.constexpr(18)
IQ1_S = tl.constexpr(19)
IQ3_S = tl.constexpr(21)
IQ2_S = tl.constexpr(22)
IQ1_M = tl.constexpr(29)
Q4_K = tl.constexpr(12)
Q6_K = tl.constexpr(14)
BF16 = tl.constexpr(30)
MXFP4 = tl.constexpr(39)
IQ4_NL = tl.constexpr(20)
IQ4_XS = tl.constexpr(23)
# (G, S) of each type's tile: G * S == TILE_K; S is the values that share one scale
GROUPS = {
    1: (8, 32), 30: (8, 32),                                   # F16, BF16
    2: (8, 32), 3: (8, 32), 6: (8, 32), 7: (8, 32), 8: (8, 32),  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
    10: (16, 16), 11: (16, 16), 12: (8, 32), 13: (8, 32), 14: (16, 16),  # Q2_K .. Q6_K
    39: (8, 32), 20: (8, 32), 23: (8, 32), 34: (8, 32), 35: (8, 32),     # MXFP4, IQ4_NL/XS, TQ1_0/TQ2_0
    16: (8, 32), 17: (16, 16), 22: (16, 16), 18: (8, 32), 21: (8, 32),   # IQ2_XXS/XS/S, IQ3_XXS/S
    19: (8, 32), 29: (16, 16)}                                           # IQ1_S, IQ1_M

# The IQ grids (gguf-py's, as float32 rows of 8 or 4 values) one after another in one table that
# every kernel is given (`tab`): (type id, first float, values per entry) of each.
GRIDS = ((16, 256, 8), (17, 512, 8), (22, 1024, 8), (18, 256, 4), (21, 512, 4), (19, 2048, 8))
_OFF = {}
_at = 0
for _qt, _n, _w in GRIDS:
    _OFF[_qt] = _at
    _at += _n * _w
GRID_FLOATS = _at
OFF_IQ2XXS, OFF_IQ2XS, OFF_IQ2S = tl.constexpr(_OFF[16]), tl.constexpr(_OFF[17]), tl.constexpr(_OFF[22])
OFF_IQ3XXS, OFF_IQ3S, OFF_IQ1S = tl.constexpr(_OFF[18]), tl.constexpr(_OFF[21]), tl.constexpr(_OFF[19])
IQ1S_DELTA = tl.constexpr(float(gguf_py.IQ1S_DELTA))


def grid_table() -> list[float]:
    """The GRIDS table's values, in order (what `tab` points to)."""
    from gguf import GGMLQuantizationType as T
    out: list[float] = []
    for qt, _, _ in GRIDS:
        out.extend(gguf_py.grid(T(qt)).reshape(-1).tolist())
    return out


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
def _legacy(row, t, nmask, K, MIN: tl.constexpr, FIVE: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    """Q4_0 (f16 d, qs[16]: (q - 8) * d), Q4_1 (f16 d, f16 m, qs[16]: q * d + m), Q5_0 (f16 d,
    qh[4], qs[16]: (q - 16) * d) and Q5_1 (f16 d, f16 m, qh[4], qs[16]: q * d + m): value j is the
    low nibble of qs[j], j + 16 its high nibble, | bit j of the little-endian qh << 4 for Q5."""
    g, s, k = _columns(t, G, S)
    blk = t * G + g
    ok = nmask & (blk * 32 < K)
    base = row + blk * (18 + 2 * MIN + 4 * FIVE)
    d = _f16(base, ok)
    qs = base + 2 + 2 * MIN + 4 * FIVE
    byte = _byte(qs + (s % 16), ok)
    q = tl.where(s < 16, byte & 15, byte >> 4)
    if FIVE:
        q = q | (((_byte(base + 2 + 2 * MIN + s // 8, ok) >> (s % 8)) & 1) << 4)
    if MIN:
        w = q.to(tl.float32) * d + _f16(base + 2, ok)
    else:
        w = (q - (16 if FIVE else 8)).to(tl.float32) * d
    return w, k


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
def _crumb(qs, g, s, nmask):
    """The 2-bit field of value 16 g + s of a Q2_K / Q3_K block (value 128 n + 32 j + 16 h + l,
    g = 8 n + 2 j + h): bits 2 j of qs[32 n + 16 h + l], as int32; also j and n."""
    n = g // 8
    j = (g % 8) // 2
    byte = _byte(qs + 32 * n + 16 * (g % 2) + s, nmask)
    return (byte >> (2 * j)) & 3, j, n


@triton.jit
def _q2_k(row, t, nmask, G: tl.constexpr, S: tl.constexpr):
    """scales[16] (4-bit scale | 4-bit min << 4), qs[64], f16 d, f16 dmin: (d * sc) * q - dmin * m
    per 16 values g."""
    g, s, k = _columns(t, G, S)
    base = row + t * 84
    sc = _byte(base + g, nmask)                         # [BN, G, 1]
    dl = _f16(base + 80, nmask) * (sc & 15).to(tl.float32)
    ml = _f16(base + 82, nmask) * (sc >> 4).to(tl.float32)
    q, j, n = _crumb(base + 16, g, s, nmask)
    return q.to(tl.float32) * dl - ml, k


@triton.jit
def _q3_k(row, t, nmask, G: tl.constexpr, S: tl.constexpr):
    """hmask[32], qs[64], scales[12] (16 six-bit values, -32), f16 d: (d * sc) * (q - 4 where the
    value's hmask bit is clear) per 16 values g; the bit is 4 n + j of hmask[16 h + l]. Scale g:
    low nibble (g // 8: high) of scales[g % 8], top bits 2 (g // 4) of scales[8 + g % 4]."""
    g, s, k = _columns(t, G, S)
    base = row + t * 110
    lo = (_byte(base + 96 + g % 8, nmask) >> (4 * (g // 8))) & 15
    hi = (_byte(base + 104 + g % 4, nmask) >> (2 * (g // 4))) & 3
    dl = _f16(base + 108, nmask) * ((lo | (hi << 4)) - 32).to(tl.float32)
    q, j, n = _crumb(base + 32, g, s, nmask)
    hm = _byte(base + 16 * (g % 2) + s, nmask)
    q = q - tl.where(((hm >> (4 * n + j)) & 1) == 0, 4, 0)
    return q.to(tl.float32) * dl, k


@triton.jit
def _tq2_0(row, t, nmask, G: tl.constexpr, S: tl.constexpr):
    """qs[64], f16 d: (q - 1) * d, q = bits 2 (g % 4) of qs[32 (g // 4) + s] (value 32 g + s)."""
    g, s, k = _columns(t, G, S)
    base = row + t * 66
    q = (_byte(base + 32 * (g // 4) + s, nmask) >> (2 * (g % 4))) & 3
    return (q - 1).to(tl.float32) * _f16(base + 64, nmask), k


@triton.jit
def _tq1_0(row, t, nmask, G: tl.constexpr, S: tl.constexpr):
    """qs[48], qh[4], f16 d: 5 trits a byte (4 in each qh byte), trit p of byte b is
    ((b * 3^p mod 256) * 3) >> 8; values 0-159 are trit v // 32 of qs[v % 32], 160-239 trit
    (v - 160) // 16 of qs[32 + v % 16], 240-255 trit (v - 240) // 4 of qh[v % 4]; (trit - 1) * d."""
    g, s, k = _columns(t, G, S)
    base = row + t * 54
    v = g * S + s                                       # value in the block, [1, G, S]
    first, mid = v < 160, v < 240
    at = tl.where(first, v % 32, tl.where(mid, 32 + (v - 160) % 16, 48 + (v - 240) % 4))
    p = tl.where(first, v // 32, tl.where(mid, (v - 160) // 16, (v - 240) // 4))
    pow3 = tl.where(p == 0, 1, tl.where(p == 1, 3, tl.where(p == 2, 9, tl.where(p == 3, 27, 81))))
    q = (_byte(base + at, nmask) * pow3) & 255
    trit = (q * 3) >> 8
    return (trit - 1).to(tl.float32) * _f16(base + 52, nmask), k


@triton.jit
def _u32(p, mask):
    """The little-endian uint32 at `p` (four bytes) as int64."""
    return (_byte(p, mask).to(tl.int64) | (_byte(p + 1, mask).to(tl.int64) << 8)
            | (_byte(p + 2, mask).to(tl.int64) << 16) | (_byte(p + 3, mask).to(tl.int64) << 24))


@triton.jit
def _ksign(idx7, j):
    """-1.0 or 1.0: bit j of ksigns_iq2xs[idx7] (bits 0-6 are idx7's, bit 7 its parity)."""
    par = idx7 ^ (idx7 >> 4)
    par = par ^ (par >> 2)
    par = (par ^ (par >> 1)) & 1
    bit = tl.where(j == 7, par, (idx7 >> tl.minimum(j, 6)) & 1)
    return tl.where(bit == 1, -1.0, 1.0)


@triton.jit
def _half_scale(d, nib, step: tl.constexpr):
    """IQ2/IQ3 `d * (0.5f + s) * step`, each product rounded to float32."""
    return (d * (nib.to(tl.float32) + 0.5)) * step


@triton.jit
def _iq2_xxs(row, t, nmask, tab, G: tl.constexpr, S: tl.constexpr):
    """f16 d, then per 32 values g 8 bytes: 4 grid indices (8 values each), a uint32 of 4 x 7-bit
    sign indices and a 4-bit scale (top bits): (d * (0.5 + s) * 0.25) * grid * sign."""
    g, s, k = _columns(t, G, S)
    base = row + t * 66
    q = base + 2 + 8 * g
    aux = _u32(q + 4, nmask)                             # [BN, G, 1]
    db = _half_scale(_f16(base, nmask), (aux >> 28).to(tl.int32), 0.25)
    l = s // 8
    idx = _byte(q + l, nmask)
    w = tl.load(tab + OFF_IQ2XXS + idx * 8 + s % 8, mask=nmask, other=0.0)
    sign = _ksign(((aux >> (7 * l).to(tl.int64)) & 127).to(tl.int32), s % 8)
    return db * w * sign, k


@triton.jit
def _iq2_xs(row, t, nmask, tab, G: tl.constexpr, S: tl.constexpr):
    """f16 d, uint16 qs[32] (9-bit grid index | 7-bit sign index << 9), scales[8] (a nibble per 16
    values g): (d * (0.5 + s) * 0.25) * grid * sign."""
    g, s, k = _columns(t, G, S)
    base = row + t * 74
    db = _half_scale(_f16(base, nmask), (_byte(base + 66 + g // 2, nmask) >> (4 * (g % 2))) & 15, 0.25)
    p = base + 2 + 2 * (2 * g + s // 8)
    w16 = _byte(p, nmask) | (_byte(p + 1, nmask) << 8)
    w = tl.load(tab + OFF_IQ2XS + (w16 & 511) * 8 + s % 8, mask=nmask, other=0.0)
    return db * w * _ksign(w16 >> 9, s % 8), k


@triton.jit
def _iq2_s(row, t, nmask, tab, G: tl.constexpr, S: tl.constexpr):
    """f16 d, qs[32] (grid index low bytes), signs[32], qh[8] (2 high index bits each), scales[8]
    (a nibble per 16 values g): (d * (0.5 + s) * 0.25) * grid * (bit j of the sign byte ? -1 : 1)."""
    g, s, k = _columns(t, G, S)
    base = row + t * 82
    db = _half_scale(_f16(base, nmask), (_byte(base + 74 + g // 2, nmask) >> (4 * (g % 2))) & 15, 0.25)
    ib = g // 2
    l = 2 * (g % 2) + s // 8                             # group of 8 values in its 32
    idx = _byte(base + 2 + 4 * ib + l, nmask) | (((_byte(base + 66 + ib, nmask) >> (2 * l)) & 3) << 8)
    w = tl.load(tab + OFF_IQ2S + idx * 8 + s % 8, mask=nmask, other=0.0)
    neg = (_byte(base + 34 + 4 * ib + l, nmask) >> (s % 8)) & 1
    return db * w * tl.where(neg == 1, -1.0, 1.0), k


@triton.jit
def _iq3_xxs(row, t, nmask, tab, G: tl.constexpr, S: tl.constexpr):
    """f16 d, qs[64] (grid indices of 4 values), 8 x uint32 (4 x 7-bit signs, 4-bit scale) per 32
    values g: (d * (0.5 + s) * 0.5) * grid * sign."""
    g, s, k = _columns(t, G, S)
    base = row + t * 98
    aux = _u32(base + 66 + 4 * g, nmask)
    db = _half_scale(_f16(base, nmask), (aux >> 28).to(tl.int32), 0.5)
    idx = _byte(base + 2 + 8 * g + s // 4, nmask)
    w = tl.load(tab + OFF_IQ3XXS + idx * 4 + s % 4, mask=nmask, other=0.0)
    l = s // 8
    return db * w * _ksign(((aux >> (7 * l).to(tl.int64)) & 127).to(tl.int32), s % 8), k


@triton.jit
def _iq3_s(row, t, nmask, tab, G: tl.constexpr, S: tl.constexpr):
    """f16 d, qs[64], qh[8] (the 9th bit of each index), signs[32], scales[4] (a nibble per 32
    values g): (d * (1 + 2 s)) * grid * (bit j of the sign byte ? -1 : 1)."""
    g, s, k = _columns(t, G, S)
    base = row + t * 110
    sc = (_byte(base + 106 + g // 2, nmask) >> (4 * (g % 2))) & 15
    db = _f16(base, nmask) * (1 + 2 * sc).to(tl.float32)
    m = s // 4                                           # index of the 8 in this 32
    idx = _byte(base + 2 + 8 * g + m, nmask) | (((_byte(base + 66 + g, nmask) >> m) & 1) << 8)
    w = tl.load(tab + OFF_IQ3S + idx * 4 + s % 4, mask=nmask, other=0.0)
    neg = (_byte(base + 74 + 4 * g + s // 8, nmask) >> (s % 8)) & 1
    return db * w * tl.where(neg == 1, -1.0, 1.0), k


@triton.jit
def _iq1_s(row, t, nmask, tab, G: tl.constexpr, S: tl.constexpr):
    """f16 d, qs[32], uint16 qh[8] (4 x 3 high index bits, a 3-bit scale, the delta's sign) per 32
    values g: (grid + delta) * (d * (2 s + 1))."""
    g, s, k = _columns(t, G, S)
    base = row + t * 50
    qh = _byte(base + 34 + 2 * g, nmask) | (_byte(base + 35 + 2 * g, nmask) << 8)
    dl = _f16(base, nmask) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    l = s // 8
    idx = _byte(base + 2 + 4 * g + l, nmask) | (((qh >> (3 * l)) & 7) << 8)
    w = tl.load(tab + OFF_IQ1S + idx * 8 + s % 8, mask=nmask, other=0.0)
    delta = tl.where((qh & 0x8000) != 0, -IQ1S_DELTA, IQ1S_DELTA)
    return (w + delta) * dl, k


@triton.jit
def _iq1_m(row, t, nmask, tab, G: tl.constexpr, S: tl.constexpr):
    """qs[32], qh[16] (a nibble per 8 values: 3 high index bits, the delta's sign), 4 x uint16 scales
    (3 bits per 16 values g; their top nibbles together are the f16 d): (grid + delta) * (d * (2 s + 1))."""
    g, s, k = _columns(t, G, S)
    base = row + t * 56
    sc0 = _byte(base + 48, nmask) | (_byte(base + 49, nmask) << 8)
    sc1 = _byte(base + 50, nmask) | (_byte(base + 51, nmask) << 8)
    sc2 = _byte(base + 52, nmask) | (_byte(base + 53, nmask) << 8)
    sc3 = _byte(base + 54, nmask) | (_byte(base + 55, nmask) << 8)
    bits = (sc0 >> 12) | ((sc1 >> 8) & 0xF0) | ((sc2 >> 4) & 0xF00) | (sc3 & 0xF000)
    d = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    w16 = _byte(base + 48 + 2 * (g // 4), nmask) | (_byte(base + 49 + 2 * (g // 4), nmask) << 8)
    sc = (w16 >> (3 * (g % 4))) & 7
    dl = d * (2 * sc + 1).to(tl.float32)
    grp = 2 * g + s // 8                                 # group of 8 values in the block
    nib = (_byte(base + 32 + grp // 2, nmask) >> (4 * (grp % 2))) & 15
    idx = _byte(base + grp, nmask) | ((nib & 7) << 8)
    w = tl.load(tab + OFF_IQ1S + idx * 8 + s % 8, mask=nmask, other=0.0)
    delta = tl.where((nib & 8) != 0, -IQ1S_DELTA, IQ1S_DELTA)
    return (w + delta) * dl, k


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
def tile(QT: tl.constexpr, row, t, nmask, K, G: tl.constexpr, S: tl.constexpr, tab):
    """Tile t (values t*256 .. t*256 + 255) of the rows at `row` (uint8 pointers [BN, 1, 1]) of
    ggml type QT: (float32 [BN, G, S], row columns [1, G, S]). Rows outside `nmask` and values
    at columns >= K come out 0 (K: the row length, a whole number of blocks). `tab`: the IQ grids
    (GRIDS, float32), read by the IQ types only."""
    if QT == Q8_0:
        w, k = _q8_0(row, t, nmask, K, G, S)
    elif QT == Q4_0:
        w, k = _legacy(row, t, nmask, K, False, False, G, S)
    elif QT == Q4_1:
        w, k = _legacy(row, t, nmask, K, True, False, G, S)
    elif QT == Q5_0:
        w, k = _legacy(row, t, nmask, K, False, True, G, S)
    elif QT == Q5_1:
        w, k = _legacy(row, t, nmask, K, True, True, G, S)
    elif QT == MXFP4:
        w, k = _mxfp4(row, t, nmask, K, G, S)
    elif QT == Q4_K:
        w, k = _q45_k(row, t, nmask, False, G, S)
    elif QT == Q5_K:
        w, k = _q45_k(row, t, nmask, True, G, S)
    elif QT == Q6_K:
        w, k = _q6_k(row, t, nmask, G, S)
    elif QT == Q2_K:
        w, k = _q2_k(row, t, nmask, G, S)
    elif QT == Q3_K:
        w, k = _q3_k(row, t, nmask, G, S)
    elif QT == TQ1_0:
        w, k = _tq1_0(row, t, nmask, G, S)
    elif QT == TQ2_0:
        w, k = _tq2_0(row, t, nmask, G, S)
    elif QT == IQ2_XXS:
        w, k = _iq2_xxs(row, t, nmask, tab, G, S)
    elif QT == IQ2_XS:
        w, k = _iq2_xs(row, t, nmask, tab, G, S)
    elif QT == IQ2_S:
        w, k = _iq2_s(row, t, nmask, tab, G, S)
    elif QT == IQ3_XXS:
        w, k = _iq3_xxs(row, t, nmask, tab, G, S)
    elif QT == IQ3_S:
        w, k = _iq3_s(row, t, nmask, tab, G, S)
    elif QT == IQ1_S:
        w, k = _iq1_s(row, t, nmask, tab, G, S)
    elif QT == IQ1_M:
        w, k = _iq1_m(row, t, nmask, tab, G, S)
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
