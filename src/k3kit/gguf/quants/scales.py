"""Where each block type keeps its scales: finiteness checks and random valid blocks.

Every block type except the FP4 ones scales its values by fp16 fields (`d`, and `dmin`/`m`
for the types with offsets). A finite fp16 scale always decodes to finite values (the
largest product, Q6_K's 65504 * 127 * 32, is far below FLT_MAX), so a block decodes to
non-finite values exactly when one of its fp16 scales is inf or NaN. MXFP4's e8m0 exponent
can overflow instead (e >= 253 with a large nibble); NVFP4's ue4m3 scales are always finite.
Checking the scale bytes alone is therefore both exact and cheap (one or two byte columns).

The same layout table generates random *valid* blocks: random bytes everywhere (every grid
index, sign pattern, sub-scale and nibble equally likely) with the scale fields set to finite
values, which is what tests and synthetic files need.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

# Byte offsets of the fp16 scale fields inside one block (ggml-common.h layouts).
F16_SCALES: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q1_0: (0,),
    T.Q2_K: (80, 82),  # scales[16], qs[64], d, dmin
    T.Q3_K: (108,),  # hmask[32], qs[64], scales[12], d
    T.Q4_K: (0, 2), T.Q5_K: (0, 2),
    T.Q6_K: (208,),  # ql[128], qh[64], scales[16], d
    T.TQ1_0: (52,),  # qs[48], qh[4], d
    T.TQ2_0: (64,),  # qs[64], d
    T.IQ1_S: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}
IQ1_M_SCALES = 48  # qs[32], qh[16], then 4 uint16 whose top nibbles together are the fp16 d
FLOATS = {T.F32: np.uint32, T.F16: np.uint16, T.BF16: np.uint16}
_EXP_MASK = {T.F32: 0x7F800000, T.F16: 0x7C00, T.BF16: 0x7F80}
CHECKED: frozenset[GGMLQuantizationType] = frozenset(
    {*F16_SCALES, T.IQ1_M, T.MXFP4, T.NVFP4, *FLOATS}
)

# MXFP4: the smallest exponent byte at which some nibble decodes to inf (12 * 2^(e-128)).
_MXFP4_MIN_E_INF = 253


def iq1_m_scale_bits(blocks: np.ndarray) -> np.ndarray:
    """The assembled fp16 bit pattern of each IQ1_M block's d (iq1m_scale_t in ggml)."""
    sc = blocks[:, IQ1_M_SCALES : IQ1_M_SCALES + 8].copy().view("<u2").astype(np.uint16)
    return ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0)
            | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000))


def _mxfp4_overflows(blocks: np.ndarray) -> np.ndarray:
    """True for MXFP4 blocks where some value is +-inf: e >= 253 and a big enough nibble."""
    e = blocks[:, 0].astype(np.int32)
    bad = np.zeros(blocks.shape[0], dtype=bool)
    hot = np.flatnonzero(e >= _MXFP4_MIN_E_INF)
    if hot.size:
        q = blocks[hot, 1:]
        mag = np.maximum(q & 7, (q >> 4) & 7).max(axis=1)  # index into 0,1,2,3,4,6,8,12
        kv = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float64)[mag]
        with np.errstate(over="ignore"):
            bad[hot] = ~np.isfinite((kv * 2.0 ** (e[hot] - 128)).astype(np.float32))
    return bad


def nonfinite_mask(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """bool [n_blocks]: blocks (uint8 [n, block_bytes]) that dequantize to some inf or NaN."""
    if qtype in F16_SCALES:
        bad = np.zeros(blocks.shape[0], dtype=bool)
        for off in F16_SCALES[qtype]:
            bad |= (blocks[:, off + 1] & 0x7C) == 0x7C  # high byte: sign, exponent all ones
        return bad
    if qtype == T.IQ1_M:
        inf_or_nan: np.ndarray = (iq1_m_scale_bits(blocks) & 0x7C00) == 0x7C00
        return inf_or_nan
    if qtype == T.MXFP4:
        return _mxfp4_overflows(blocks)
    if qtype == T.NVFP4:
        return np.zeros(blocks.shape[0], dtype=bool)
    if qtype in FLOATS:
        words = np.ascontiguousarray(blocks).view(FLOATS[qtype]).reshape(-1)
        exp_all_ones: np.ndarray = (words & _EXP_MASK[qtype]) == _EXP_MASK[qtype]
        return exp_all_ones
    raise KeyError(qtype)


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, rng: np.random.Generator,
                  scale_range: tuple[float, float] | None = None) -> np.ndarray:
    """uint8 [n_blocks, block_bytes] of random valid blocks: uniform bytes, finite scales.

    scale_range=None draws each fp16 scale uniformly from all finite fp16 bit patterns (both
    signs, zero, subnormals up to 65504: every exponent equally often); (lo, hi) draws |scale|
    log-uniformly from [lo, hi] with a random sign instead (for synthetic weights of a sane
    size). MXFP4 exponents are drawn from the bytes that cannot overflow (0..252, or the range
    holding [lo, hi] / 6), NVFP4 scale bytes from the unsigned E4M3 codes 0..0x7F.
    Floats (F32/F16/BF16) are random finite values.
    """
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    if qtype in FLOATS:
        n = n_blocks * elems
        if scale_range is None:
            words = rng.integers(0, 1 << (8 * np.dtype(FLOATS[qtype]).itemsize), n, dtype=np.uint64)
            words = words.astype(FLOATS[qtype])
            mask = np.array(_EXP_MASK[qtype], dtype=FLOATS[qtype])
            words[(words & mask) == mask] &= ~mask  # inf/NaN exponent -> zero exponent (subnormal)
            return words.view(np.uint8).reshape(n_blocks, nbytes)
        x = _log_uniform(rng, n, scale_range)
        if qtype == T.BF16:
            words = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            return words.view(np.uint8).reshape(n_blocks, nbytes)
        return x.astype(np.float32 if qtype == T.F32 else np.float16).view(np.uint8).reshape(n_blocks, nbytes)
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    if qtype in F16_SCALES:
        for off in F16_SCALES[qtype]:
            raw[:, off : off + 2] = _f16_scales(rng, n_blocks, scale_range).view(np.uint8).reshape(-1, 2)
    elif qtype == T.IQ1_M:
        d = _f16_scales(rng, n_blocks, scale_range).astype(np.uint16)
        sc = raw[:, IQ1_M_SCALES : IQ1_M_SCALES + 8].copy().view("<u2").astype(np.uint16)
        for k in range(4):  # nibble k of d is the top nibble of sc[k]
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, IQ1_M_SCALES : IQ1_M_SCALES + 8] = sc.astype("<u2").view(np.uint8).reshape(-1, 8)
    elif qtype == T.MXFP4:
        if scale_range is None:
            raw[:, 0] = rng.integers(0, _MXFP4_MIN_E_INF, n_blocks)
        else:  # element = kvalue * 2^(e-128), |kvalue| <= 12: the block's amax ~ 12 * 2^(e-128)
            lo, hi = (int(np.clip(np.floor(np.log2(v / 12)) + 128, 0, _MXFP4_MIN_E_INF - 1))
                      for v in scale_range)
            raw[:, 0] = rng.integers(lo, hi + 1, n_blocks)
    elif qtype == T.NVFP4:
        raw[:, 0:4] &= 0x7F
    else:
        raise KeyError(qtype)
    return raw


def _log_uniform(rng: np.random.Generator, n: int, scale_range: tuple[float, float]) -> np.ndarray:
    lo, hi = scale_range
    if not 0 < lo <= hi:
        raise ValueError(f"scale range must be 0 < lo <= hi, got {scale_range}")
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    return np.where(rng.random(n) < 0.5, -mag, mag)


def _f16_scales(rng: np.random.Generator, n: int, scale_range: tuple[float, float] | None) -> np.ndarray:
    """uint16 fp16 bit patterns, all finite."""
    if scale_range is None:
        bits = rng.integers(0, 0x7C00, n, dtype=np.uint16)  # every finite magnitude
        return bits | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
    if scale_range[1] > 65504:
        raise ValueError(f"fp16 scales cannot exceed 65504, got {scale_range}")
    return _log_uniform(rng, n, scale_range).astype(np.float16).view(np.uint16)
