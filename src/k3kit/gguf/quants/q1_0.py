"""Q1_0 dequantizer (gguf-py 0.19 lists the type but has no codec for it).

Block of 128 values, 18 bytes: f16 d, then 16 bytes of sign bits. ggml's
`dequantize_row_q1_0`: element j is +d when bit (j % 8) of byte j // 8 is set, else -d
(`-d` is a sign flip, exact). Nothing is computed, so float32 equality with ggml is by
construction; tests/interop/test_quants_ggml.py checks it anyway.
"""

from __future__ import annotations

import numpy as np

from .float import fp16_bits_to_fp32

BLOCK = 128
BLOCK_BYTES = 18


def dequantize(raw: np.ndarray) -> np.ndarray:
    """uint8 blocks -> flat float32: +d or -d per bit, low bit first."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, BLOCK_BYTES)
    d = fp16_bits_to_fp32(b[:, 0:2].copy().view(np.uint16)[:, 0])[:, None]
    bits = np.unpackbits(b[:, 2:], axis=1, bitorder="little").astype(bool)
    return np.where(bits, d, -d).reshape(-1)
