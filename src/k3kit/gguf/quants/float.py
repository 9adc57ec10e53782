"""F32, F16 and BF16: the plain float types, with ggml's exact rounding and NaN rules.

F16 rounds to nearest-even (what ggml's portable fp32->fp16 computes); every NaN becomes the
quiet NaN 0x7E00 with the input's sign, because that is what ggml writes and a requantized
file must be byte-identical to one llama.cpp would write. BF16 rounds to nearest-even on the
bit pattern and quietens NaNs by setting bit 6 of the truncated word, like ggml's
`ggml_compute_fp32_to_bf16`. The helpers here are also the fp16 scale codecs of the block
quants (Q8_0 `d`, K-quant `d`/`dmin`).
"""

from __future__ import annotations

import numpy as np


def fp32_to_fp16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 fp16 bit patterns, round-to-nearest-even, NaN -> 0x7E00 | sign."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        h = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        sign = (x.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
        h = np.where(nan, sign | np.uint16(0x7E00), h)
    return h


def fp16_bits_to_fp32(h: np.ndarray) -> np.ndarray:
    """uint16 fp16 bit patterns -> float32 (exact; NaNs come out quiet, as ggml's do)."""
    h = np.asarray(h, dtype=np.uint16)
    f = h.view(np.float16).astype(np.float32)
    nan = (h & np.uint16(0x7C00)) == np.uint16(0x7C00)
    nan &= (h & np.uint16(0x03FF)) != 0
    if nan.any():
        f = np.where(nan, (f.view(np.uint32) | np.uint32(0x00400000)).view(np.float32), f)
    return f


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bit patterns: nearest-even on the bits, NaNs forced quiet."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded = np.where(nan, (u >> 16) | np.uint32(64), rounded)
    return rounded.astype(np.uint16)


def bf16_bits_to_fp32(h: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (a plain shift; NaN payloads kept)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def quantize_f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8)


def quantize_f16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(fp32_to_fp16_bits(x)).view(np.uint8)


def quantize_bf16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(fp32_to_bf16_bits(x)).view(np.uint8)


def dequantize_f32(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1).view(np.float32).copy()


def dequantize_f16(raw: np.ndarray) -> np.ndarray:
    return fp16_bits_to_fp32(np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1).view(np.uint16))


def dequantize_bf16(raw: np.ndarray) -> np.ndarray:
    return bf16_bits_to_fp32(np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1).view(np.uint16))
