"""compressed-tensors MXFP4 -> ggml MXFP4 blocks: a lossless move of bits, no arithmetic.

compressed-tensors `mxfp4-pack-quantized` stores, per expert matrix [rows, cols]:
  weight_packed uint8 [rows, cols/2]: element 2i in the low nibble of byte i, 2i+1 in the high;
  weight_scale  uint8 [rows, cols/32]: one E8M0 biased exponent per 32 consecutive elements.
ggml's block_mxfp4 is 17 bytes per 32 elements: the E8M0 byte, then 16 bytes where byte j
holds element j in the low nibble and element j+16 in the high one. Both index the same e2m1
code table (ggml doubles the values and halves the scale: the same numbers), so codes and
exponents are copied unchanged; only the nibble order inside a block differs.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
BLOCK_BYTES = 17


def repack_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """uint8 packed [rows, cols/2] + uint8 scale [rows, cols/32] -> ggml bytes [rows, cols/32*17]."""
    rows, half = packed.shape
    nb = half * 2 // BLOCK
    if half * 2 % BLOCK or scale.shape != (rows, nb):
        raise ValueError(f"MXFP4 packed {packed.shape} and scale {scale.shape} do not match")
    src = packed.view(np.uint8).reshape(rows, nb, BLOCK // 2)
    codes = np.empty((rows, nb, BLOCK), dtype=np.uint8)
    codes[..., 0::2] = src & 0x0F
    codes[..., 1::2] = src >> 4
    out = np.empty((rows, nb, BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = scale.view(np.uint8)
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(rows, nb * BLOCK_BYTES)
