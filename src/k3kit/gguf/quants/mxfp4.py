"""MXFP4: 32 weights per 17-byte block, an E8M0 exponent byte and 32 e2m1 nibbles.

Element j goes to the low nibble of byte j, element j+16 to the high nibble. ggml keeps the
e2m1 values doubled as int8 (`kvalues_mxfp4` = 0,1,2,3,4,6,8,12 and negatives at 8..15) and
halves the scale instead: d = 2^(e-128), with e = floor(log2f(amax)) - 2 + 127.

Bit-exactness notes. `log2f` rounds to float32 before the floor, so amax just below a power of
two lands on the next exponent; we round a float64 log2 to float32 the same way. ggml picks the
first of the 16 values with the smallest float32 |v*d - x|. Rounding is monotone, so those
errors are unimodal along the sorted magnitudes and the winner is one of the two magnitudes
around |x| (lower one on a tie), taken negative for x < 0 unless it is 0. With d a normal
power of two that reduces to a table lookup on ceil(2|x|/d). For amax below 2^-125 the
exponent is negative and C converts it to uint8 through a 32-bit int: it wraps. Blocks whose
d is tiny, whose amax is inf (exponent byte 0) or whose top values overflow (e = 253) take
slower paths that compare the float32 errors as C does.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
BLOCK_BYTES = 17
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_MAGS = KVALUES[:8].astype(np.float32)
# index of the largest magnitude <= t for t in [0, 13): a table on floor(t)
_LOWER = np.searchsorted(_MAGS, np.arange(13, dtype=np.float32), side="right").astype(np.uint8) - 1


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 byte -> 2^(e-128) as float32 (ggml's GGML_E8M0_TO_FP32_HALF, subnormals for e < 2)."""
    e = np.asarray(e, dtype=np.uint8).astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23)
    return bits.astype(np.uint32).view(np.float32)


def block_exponent(amax: np.ndarray) -> np.ndarray:
    """amax (float32) -> E8M0 byte as ggml computes it, 0 for amax <= 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.log2(amax.astype(np.float64)).astype(np.float32)
        e = np.floor(lg) - np.float32(2) + np.float32(127)
        # C converts through a 32-bit int: out of range (inf) gives 0x80000000, low byte 0
        e = np.where((amax > 0) & np.isfinite(e), e, 0)
    return e.astype(np.int32).astype(np.uint8)


def _key_table() -> np.ndarray:
    """uint8 key -> e2m1 index. Key = int8(copysign(ceil(2|x|/d), x)) viewed as uint8.

    With d a normal power of two the candidate errors are exact multiples of d (or rounded
    monotonically), so ggml's choice is the exact nearest magnitude with ties going to the
    lower one: in units of d/2 the cut points are 1, 3, 5, 7, 10, 14, 20 and |x| picks the
    upper side only when strictly above, i.e. when ceil(2|x|/d) exceeds the cut.
    """
    cuts = np.array([1, 3, 5, 7, 10, 14, 20])
    table = np.zeros(256, dtype=np.uint8)
    for k in range(33):
        i = int(np.count_nonzero(cuts < k))
        table[k] = i
        if k:
            table[256 - k] = i + 8 if i else 0
    return table


_KEY_TABLE = _key_table()
CHUNK_BLOCKS = 8192  # blocks per pass: 1 MiB of float32, stays in L2
_MAX_SAFE_E = 252  # above (amax ~ FLT_MAX rounding log2f up to 128) 8*d overflows to inf
_SAFE_E = 32  # d >= 2^-96: every error above is a normal float, the table is exact


def quantize(x: np.ndarray) -> np.ndarray:
    """float32 (..., n) with n % 32 == 0 -> uint8 (..., n // 32 * 17)."""
    lead = x.shape[:-1]
    xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, BLOCK)
    out = np.empty((xb.shape[0], BLOCK_BYTES), dtype=np.uint8)
    with np.errstate(over="ignore", invalid="ignore"):
        for s in range(0, xb.shape[0], CHUNK_BLOCKS):
            _quantize_chunk(xb[s : s + CHUNK_BLOCKS], out[s : s + CHUNK_BLOCKS])
    return out.reshape(*lead, x.shape[-1] // BLOCK * BLOCK_BYTES)


def _quantize_chunk(xb: np.ndarray, out: np.ndarray) -> None:
    # element-major (32, n) so per-block scalars broadcast along rows (fast in numpy)
    xt = np.ascontiguousarray(xb.T)
    a = np.abs(xt)
    amax = np.maximum.reduce(a, axis=0)
    nan = np.isnan(amax)
    if nan.any():  # ggml's `amax < |v|` skips NaNs
        amax[nan] = np.where(np.isnan(xb[nan]), np.float32(0), np.abs(xb[nan])).max(axis=1)
    e = block_exponent(amax)
    out[:, 0] = e
    # 2/d = 2^(129-e) as float32 bits; exact scaling for the safe exponents
    a *= ((256 - np.maximum(e, 2).astype(np.uint32)) << 23).view(np.float32)
    np.ceil(a, out=a)
    np.copysign(a, xt, out=a)
    idx = np.take(_KEY_TABLE, a.astype(np.int8).view(np.uint8))
    q = idx[16:] << 4
    q |= idx[:16]
    out[:, 1:] = q.T
    odd = (e < _SAFE_E) | (e > _MAX_SAFE_E) | nan | np.isinf(amax)
    if odd.any():
        i = _quantize_exact(xb[odd], e[odd], amax[odd])
        out[odd, 1:] = i[:, :16] | (i[:, 16:] << 4)


def _quantize_exact(xb: np.ndarray, e: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """Indices for blocks whose d is subnormal or tiny, whose amax is inf/NaN, or e > 252."""
    a = np.abs(xb)
    d = e8m0_half(e)[:, None]
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        t = a / d  # exact: d is a power of two and t < 16 when normal
        np.minimum(t, np.float32(12), out=t)
        t[np.isnan(t)] = 0
        lo = _LOWER[t.astype(np.uint8)]
        lo_v = _MAGS[lo] * d
        hi = np.minimum(lo + 1, 7).astype(np.uint8)
        hi_v = _MAGS[hi] * d
        err_lo = a - lo_v
        err_hi = hi_v - a
    idx: np.ndarray = np.where(err_hi < err_lo, hi, lo)
    idx[~np.isfinite(a)] = 0  # every error is inf or NaN: ggml keeps index 0
    idx |= (np.signbit(xb) & (idx != 0)).astype(np.uint8) << 3
    scan = np.isinf(amax) | (e > _MAX_SAFE_E)
    if scan.any():
        idx[scan] = _best_index_scan(xb[scan], d[scan])
    return idx


def _best_index_scan(xb: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml's 16-way first-minimum scan, literally. Only for blocks whose amax is inf (their
    exponent byte is 0 as the int conversion overflows, d is tiny and many errors tie) or
    whose top candidates overflow to inf (e = 253)."""
    best = np.zeros(xb.shape, dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        best_err = np.abs(np.float32(KVALUES[0]) * d - xb)
        for i in range(1, 16):
            err = np.abs(np.float32(KVALUES[i]) * d - xb)
            better = err < best_err
            best[better] = i
            best_err = np.where(better, err, best_err)
    return best


@np.errstate(over="ignore", invalid="ignore")
def dequantize(raw: np.ndarray) -> np.ndarray:
    """uint8 blocks -> flat float32: kvalue (doubled e2m1) * 2^(e-128)."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, BLOCK_BYTES)
    d = e8m0_half(blocks[:, 0])[:, None]
    q = blocks[:, 1:]
    y = np.empty((blocks.shape[0], BLOCK), dtype=np.float32)
    y[:, :16] = KVALUES[q & 0x0F]
    y[:, 16:] = KVALUES[q >> 4]
    y *= d
    return y.reshape(-1)
