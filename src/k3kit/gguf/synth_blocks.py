"""Random valid quantized blocks for `k3kit synth`, generated directly in ggml's byte layouts.

A synthetic K3 with IQ2_XXS experts or a Q4_K trunk needs hundreds of megabytes of blocks
that llama.cpp and k3kit decode to sensible weights. Quantizing random floats would need a
quantizer per type (ggml's i-quant quantizers need an importance matrix and run at ~0.1
Melem/s), and nothing here needs the blocks to approximate given floats. Every code field
(grid indices, sign patterns, nibbles, high bits) is valid with any bit pattern, so a block is
random bytes with only the scale fields chosen:

* the fp16 super-block scale `d` is set so dequantized weights have a standard deviation of
  about TARGET_STD (0.012 ~ 1/sqrt(7168), what the Q8_0 and MXFP4 pools of synth.py give),
  drawn per block from [0.75, 1.25] x that value, always a normal (not subnormal) fp16;
* sub-block scales are kept small enough that `d` stays normal (Q6_K's int8 scales in +-1..8);
* the types with a subtracted minimum (Q2_K, Q4_K, Q5_K) get min = scale per sub-block and
  dmin = mean code x d, so every sub-block is centred on zero as a real quantized weight is;
* TQ2_0's 2-bit codes are ternary (0, 1, 2 -> -1, 0, 1), as ggml's quantizer writes them.

Layouts are the block_* structs of ggml-common.h (offsets in the comments). Floats are not
here: synth.py draws F32/F16/BF16 weights from a normal distribution.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

TARGET_STD = 0.012

# Standard deviation of the dequantized weights at d = 1 (dmin tied to d as below), measured
# with gguf.quants.dequantize over 2^16 blocks of each generator (d drawn as below, around 1);
# d = TARGET_STD / UNIT_STD then gives weights of std TARGET_STD.
UNIT_STD: dict[GGMLQuantizationType, float] = {
    T.Q2_K: 10.27, T.Q3_K: 43.79, T.Q4_K: 85.33, T.Q5_K: 84.82, T.Q6_K: 94.25,
    T.IQ1_S: 7.268, T.IQ1_M: 7.278, T.IQ2_XXS: 53.92, T.IQ2_XS: 56.45, T.IQ2_S: 56.91,
    T.IQ3_XXS: 143.9, T.IQ3_S: 141.7, T.TQ1_0: 0.8257, T.TQ2_0: 0.7145,
}

# Q4_K / Q5_K sub-block scales (6-bit) and Q2_K's (4-bit) are drawn from 1..SUB_MAX; Q6_K's
# int8 scales from +-1..8. Smaller sub-scales mean a larger `d` for the same weights.
SUB_MAX = {T.Q2_K: 15, T.Q4_K: 31, T.Q5_K: 15}
Q6_K_SUB_MAX = 8

# A byte whose four 2-bit fields are all in {0, 1, 2}: field value 3 becomes 1, so each field
# is -1, 0, +1 with probabilities 1/4, 1/2, 1/4 (mean 0).
_TERNARY = np.array([sum((((b >> s) & 3) if ((b >> s) & 3) != 3 else 1) << s for s in (0, 2, 4, 6))
                     for b in range(256)], dtype=np.uint8)


def random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniformly random bytes (raw generator output: ~5x faster than rng.bytes)."""
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n].copy()


def _raw(rng: np.random.Generator, qtype: GGMLQuantizationType, n_blocks: int) -> np.ndarray:
    _, nbytes = GGML_QUANT_SIZES[qtype]
    return random_bytes(rng, n_blocks * nbytes).reshape(n_blocks, nbytes)


def _d(rng: np.random.Generator, qtype: GGMLQuantizationType, n_blocks: int) -> np.ndarray:
    """float32 super-block scales around TARGET_STD / UNIT_STD, exactly representable in fp16."""
    d = TARGET_STD / UNIT_STD[qtype] * rng.uniform(0.75, 1.25, n_blocks)
    return d.astype(np.float16).astype(np.float32)


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset:offset + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins (get_scale_min_k4)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _q2_k(rng: np.random.Generator, n: int) -> np.ndarray:
    # scales[16] (low nibble scale, high nibble min), qs[64], d @80, dmin @82; w = d*sc*q - dmin*m
    b = _raw(rng, T.Q2_K, n)
    s = rng.integers(1, SUB_MAX[T.Q2_K] + 1, (n, 16), dtype=np.uint8)
    b[:, 0:16] = s | (s << 4)
    d = _d(rng, T.Q2_K, n)
    _put_f16(b, 80, d)
    _put_f16(b, 82, 1.5 * d)  # mean of q in 0..3
    return b


def _q3_k(rng: np.random.Generator, n: int) -> np.ndarray:
    # hmask[32], qs[64], scales[12] (6-bit, minus 32), d @108; codes already centred
    b = _raw(rng, T.Q3_K, n)
    _put_f16(b, 108, _d(rng, T.Q3_K, n))
    return b


def _q45_k(qtype: GGMLQuantizationType, mean_code: float) -> Callable[[np.random.Generator, int], np.ndarray]:
    def gen(rng: np.random.Generator, n: int) -> np.ndarray:
        # d @0, dmin @2, scales[12], then (Q5_K: qh[32]) qs[128]; w = d*sc*q - dmin*m
        b = _raw(rng, qtype, n)
        s = rng.integers(1, SUB_MAX[qtype] + 1, (n, 8), dtype=np.uint8)
        b[:, 4:16] = _pack_k_scales(s, s)
        d = _d(rng, qtype, n)
        _put_f16(b, 0, d)
        _put_f16(b, 2, mean_code * d)
        return b
    return gen


def _q6_k(rng: np.random.Generator, n: int) -> np.ndarray:
    # ql[128], qh[64], scales int8[16], d @208; w = d*sc*(q - 32)
    b = _raw(rng, T.Q6_K, n)
    sc = rng.integers(1, Q6_K_SUB_MAX + 1, (n, 16)) * rng.choice(np.array([-1, 1]), (n, 16))
    b[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    _put_f16(b, 208, _d(rng, T.Q6_K, n))
    return b


def _d_first(qtype: GGMLQuantizationType) -> Callable[[np.random.Generator, int], np.ndarray]:
    def gen(rng: np.random.Generator, n: int) -> np.ndarray:
        # the i-quants: d @0, then grid indices / signs / 4-bit or 3-bit sub-scales
        b = _raw(rng, qtype, n)
        _put_f16(b, 0, _d(rng, qtype, n))
        return b
    return gen


def _iq1_m(rng: np.random.Generator, n: int) -> np.ndarray:
    # qs[32], qh[16], scales uint16[4]: bits 0-11 are 3-bit sub-scales, the four top nibbles
    # (scales[0] lowest) together are the fp16 d
    b = _raw(rng, T.IQ1_M, n)
    d = _d(rng, T.IQ1_M, n).astype(np.float16).view(np.uint16)
    sc = b[:, 48:56].copy().view("<u2")
    for k in range(4):
        sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
    b[:, 48:56] = sc.view(np.uint8)
    return b


def _tq1_0(rng: np.random.Generator, n: int) -> np.ndarray:
    # qs[48] (5 base-3 digits per byte), qh[4] (4 digits per byte), d @52
    b = _raw(rng, T.TQ1_0, n)
    _put_f16(b, 52, _d(rng, T.TQ1_0, n))
    return b


def _tq2_0(rng: np.random.Generator, n: int) -> np.ndarray:
    # qs[64] (four 2-bit codes per byte, code - 1), d @64
    b = _raw(rng, T.TQ2_0, n)
    b[:, :64] = _TERNARY[b[:, :64]]
    _put_f16(b, 64, _d(rng, T.TQ2_0, n))
    return b


GENERATORS: dict[GGMLQuantizationType, Callable[[np.random.Generator, int], np.ndarray]] = {
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q45_k(T.Q4_K, 7.5), T.Q5_K: _q45_k(T.Q5_K, 15.5),
    T.Q6_K: _q6_k, T.IQ1_S: _d_first(T.IQ1_S), T.IQ1_M: _iq1_m, T.IQ2_XXS: _d_first(T.IQ2_XXS),
    T.IQ2_XS: _d_first(T.IQ2_XS), T.IQ2_S: _d_first(T.IQ2_S), T.IQ3_XXS: _d_first(T.IQ3_XXS),
    T.IQ3_S: _d_first(T.IQ3_S), T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0,
}


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n_blocks, block_bytes] of valid blocks whose weights have std ~TARGET_STD."""
    gen = GENERATORS.get(qtype)
    if gen is None:
        raise ValueError(f"no random block generator for {qtype.name}")
    return gen(rng, n_blocks)


__all__ = ["GENERATORS", "TARGET_STD", "UNIT_STD", "random_blocks", "random_bytes"]
