"""Q5_K and Q6_K dequantizers (read-only: k3kit never writes these types, but must read them).

Both reproduce ggml's `dequantize_row_q5_K` / `dequantize_row_q6_K` float32 expression order,
so a dequantized tensor is bitwise what llama.cpp computes.
"""

from __future__ import annotations

import numpy as np

from .float import fp16_bits_to_fp32
from .q4_k import scales_mins

BLOCK = 256
Q5_K_BYTES = 176  # d, dmin, scales[12], qh[32], qs[128]
Q6_K_BYTES = 210  # ql[128], qh[64], scales[16] (int8), d

_F = np.float32


def _fp16_at(b: np.ndarray, off: int) -> np.ndarray:
    return fp16_bits_to_fp32(b[:, off : off + 2].copy().view(np.uint16)[:, 0])


@np.errstate(over="ignore", invalid="ignore")
def dequantize_q5_k(raw: np.ndarray) -> np.ndarray:
    """(d*sc)*(low nibble + 16*high bit) - dmin*m; sub-block s takes bit s of qh[l]."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, Q5_K_BYTES)
    nb = b.shape[0]
    d = _fp16_at(b, 0)
    dmin = _fp16_at(b, 2)
    s, m = scales_mins(b[:, 4:16])
    qh = b[:, 16:48]  # (nb, 32)
    qs = b[:, 48:176].reshape(nb, 4, 1, 32)
    nibbles = np.empty((nb, 4, 2, 32), dtype=np.uint8)  # (.., low/high nibble, ..)
    nibbles[:, :, 0:1] = qs & 0xF
    nibbles[:, :, 1:2] = qs >> 4
    q = nibbles.reshape(nb, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    y = (q + (high << 4)).astype(_F)
    y *= (d[:, None] * s.astype(_F))[:, :, None]
    y -= (dmin[:, None] * m.astype(_F))[:, :, None]
    return y.reshape(-1)


@np.errstate(over="ignore", invalid="ignore")
def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """(d*sc)*(q - 32) with 6-bit q split into ql nibbles and qh bit pairs; 16 scales of 16."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, Q6_K_BYTES)
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 2, 32)  # [half, ql group (+0 / +32), l]
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)  # [half, -, l]
    sc = b[:, 192:208].view(np.int8).astype(_F)  # (nb, 16)
    d = _fp16_at(b, 208)
    # element 32*g + l of a 128-half, g = 0..3: ql nibble (g // 2) of ql group (g % 2),
    # qh bits 2g..2g+1
    q = np.empty((nb, 2, 4, 32), dtype=np.int16)
    q[:, :, 0:2] = ql & 0xF
    q[:, :, 2:4] = ql >> 4
    q |= ((qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).astype(np.int16) << 4
    q -= 32
    y = q.astype(_F).reshape(nb, 16, 16)
    y *= (d[:, None] * sc)[:, :, None]
    return y.reshape(-1)
