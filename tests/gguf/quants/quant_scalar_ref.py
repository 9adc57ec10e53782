"""Scalar, one-element-at-a-time float32 transcriptions of ggml's reference quantizers.

Written from the algorithm as specified (ggml-quants.c's contract: operation order, float32
rounding, nearest_int, roundf), deliberately as plain loops with np.float32 scalars so they
share no code or vectorisation tricks with k3kit's codecs. Slow: use on a few blocks.
"""

from __future__ import annotations

import math
import struct

import numpy as np

F = np.float32


def nearest_int(v: np.float32) -> int:
    t = F(v) + F(12582912.0)
    (i,) = struct.unpack("<i", struct.pack("<f", float(t)))
    return (i & 0x007FFFFF) - 0x00400000


def fp16_bytes(v: np.float32) -> bytes:
    with np.errstate(over="ignore"):
        return np.array([v], dtype=np.float16).tobytes()


def fp16_value(b: bytes) -> np.float32:
    return F(np.frombuffer(b, dtype=np.float16)[0])


def c_roundf_to_int8(v: np.float32) -> int:
    """int8 of roundf(v) as ggml's x86 build does it: half away from zero, then a 32-bit
    truncating conversion whose out-of-range/NaN result 0x80000000 leaves a low byte of 0."""
    if not math.isfinite(float(v)):
        return 0
    a = abs(float(v))
    r = math.floor(a)
    if a - r >= 0.5:
        r += 1
    return int(math.copysign(r, float(v))) & 0xFF


def q8_0_block(x: np.ndarray) -> bytes:
    amax = F(0)
    for v in x:
        amax = max(amax, F(abs(v)))
    d = F(amax / F(127))
    with np.errstate(over="ignore", invalid="ignore"):
        inv = F(F(1) / d) if d != 0 else F(0)
        qs = bytes(c_roundf_to_int8(F(F(v) * inv)) for v in x)
    return fp16_bytes(d) + qs


KV = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


@np.errstate(all="ignore")
def mxfp4_block(x: np.ndarray) -> bytes:
    amax = F(0)
    for v in x:
        if amax < abs(v):
            amax = F(abs(v))
    if amax > 0:
        lg = F(math.log2(float(amax)))  # log2f: float32-rounded logarithm
        e = int(math.floor(lg)) - 2 + 127
    else:
        e = 0
    e &= 0xFF
    d = F(2.0 ** (e - 128))
    idx = []
    for v in x:
        best, best_err = 0, F(abs(F(F(KV[0]) * d) - F(v)))
        for i in range(1, 16):
            err = F(abs(F(F(KV[i]) * d) - F(v)))
            if err < best_err:
                best, best_err = i, err
        idx.append(best)
    return bytes([e]) + bytes(idx[j] | (idx[j + 16] << 4) for j in range(16))


def make_qkx2_quants(x, w):
    """nmax 15, rmin -1, rdelta 0.1, nstep 20, squared error: returns (scale, the_min, L)."""
    n, nmax = 32, 15
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = F(sum_w * x[0])
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w = F(sum_w + w[i])
        sum_x = F(sum_x + F(w[i] * x[i]))
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return F(0), F(-mn), [0] * n
    iscale = F(F(nmax) / F(mx - mn))
    scale = F(F(1) / iscale)
    L = []
    best_error = F(0)
    for i in range(n):
        lv = max(0, min(nmax, nearest_int(F(iscale * F(x[i] - mn)))))
        L.append(lv)
        diff = F(F(F(scale * F(lv)) + mn) - x[i])
        best_error = F(best_error + F(w[i] * F(diff * diff)))
    for step in range(21):
        iscale = F(F(F(F(-1.0) + F(F(0.1) * F(step))) + F(nmax)) / F(mx - mn))
        sum_l = sum_l2 = sum_xl = F(0)
        laux = []
        for i in range(n):
            lv = max(0, min(nmax, nearest_int(F(iscale * F(x[i] - mn)))))
            laux.append(lv)
            wl = F(w[i] * F(lv))
            sum_l = F(sum_l + wl)
            sum_l2 = F(sum_l2 + F(wl * F(lv)))
            sum_xl = F(sum_xl + F(wl * x[i]))
        D = F(F(sum_w * sum_l2) - F(sum_l * sum_l))
        if D > 0:
            this_scale = F(F(F(sum_w * sum_xl) - F(sum_x * sum_l)) / D)
            this_min = F(F(F(sum_l2 * sum_x) - F(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = F(0)
                this_scale = F(sum_xl / sum_l2)
            cur = F(0)
            for i in range(n):
                diff = F(F(F(this_scale * F(laux[i])) + this_min) - x[i])
                cur = F(cur + F(w[i] * F(diff * diff)))
            if cur < best_error:
                L = laux
                best_error = cur
                scale = this_scale
                mn = this_min
    return scale, F(-mn), L


@np.errstate(all="ignore")
def q4_k_block(x: np.ndarray) -> bytes:
    x = [F(v) for v in x]
    scales, mins, L = [], [], []
    for j in range(8):
        xs = x[32 * j : 32 * j + 32]
        sum_x2 = F(0)
        for v in xs:
            sum_x2 = F(sum_x2 + F(v * v))
        av_x = F(np.sqrt(F(sum_x2 / F(32))))
        w = [F(av_x + F(abs(v))) for v in xs]
        s, m, lv = make_qkx2_quants(xs, w)
        scales.append(s)
        mins.append(m)
        L.extend(lv)
    max_scale = F(0)
    max_min = F(0)
    for s, m in zip(scales, mins, strict=True):
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    inv_scale = F(F(63) / max_scale) if max_scale > 0 else F(0)
    inv_min = F(F(63) / max_min) if max_min > 0 else F(0)
    ls = [min(63, nearest_int(F(inv_scale * s)) & 0xFF) for s in scales]
    lm = [min(63, nearest_int(F(inv_min * m)) & 0xFF) for m in mins]
    sc = [0] * 12
    for j in range(8):
        if j < 4:
            sc[j] = ls[j]
            sc[j + 4] = lm[j]
        else:
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            sc[j - 4] |= (ls[j] >> 4) << 6
            sc[j] |= (lm[j] >> 4) << 6
    db = fp16_bytes(F(max_scale / F(63)))
    mb = fp16_bytes(F(max_min / F(63)))
    for j in range(8):
        d = F(fp16_value(db) * F(ls[j]))
        if d == 0:
            continue
        dm = F(fp16_value(mb) * F(lm[j]))
        for i in range(32):
            L[32 * j + i] = max(0, min(15, nearest_int(F(F(x[32 * j + i] + dm) / d))))
    qs = []
    for c in range(4):
        qs.extend(L[64 * c + i] | (L[64 * c + 32 + i] << 4) for i in range(32))
    return db + mb + bytes(sc) + bytes(qs)
