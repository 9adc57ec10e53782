"""Q8_0: 32 weights per 34-byte block, fp16 scale d = amax/127 then 32 int8 = roundf(x/d).

ggml multiplies by the float32 reciprocal `1/d` (not divides by d), rounds half away from
zero with `roundf`, and stores the fp16 of the float32 d; all three matter for bit equality.
When d is so small that 1/d overflows to inf, every x*inf is inf or NaN and the x86 float->int
conversion ggml relies on yields 0x80000000, whose low byte is 0: those blocks store zeros.
"""

from __future__ import annotations

import numpy as np

from .float import fp16_bits_to_fp32, fp32_to_fp16_bits

BLOCK = 32
BLOCK_BYTES = 34
_HALF_DOWN = np.float32(0.5) - np.float32(2.0**-25)  # largest float below 0.5
_HALF_DOWN_BITS = _HALF_DOWN.view(np.uint32)
CHUNK_BLOCKS = 8192  # blocks per pass: 1 MiB of float32, stays in L2


def roundf(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero) for |v| < 2**23, in place on a float32 array.

    Adding the largest float below 0.5 and truncating is exact here: ties reach the next
    integer through round-to-even of the sum, and 0.49999997 stays below 1.
    """
    v += np.copysign(_HALF_DOWN, v)
    out: np.ndarray = np.trunc(v, out=v)
    return out


def quantize(x: np.ndarray) -> np.ndarray:
    """float32 (..., n) with n % 32 == 0 -> uint8 (..., n // 32 * 34)."""
    lead = x.shape[:-1]
    xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, BLOCK)
    out = np.empty((xb.shape[0], BLOCK_BYTES), dtype=np.uint8)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        for s in range(0, xb.shape[0], CHUNK_BLOCKS):
            _quantize_chunk(xb[s : s + CHUNK_BLOCKS], out[s : s + CHUNK_BLOCKS])
    return out.reshape(*lead, x.shape[-1] // BLOCK * BLOCK_BYTES)


def _quantize_chunk(xb: np.ndarray, out: np.ndarray) -> None:
    # element-major (32, n): per-block scalars broadcast along rows, and the block max is a
    # reduction over axis 0, both far faster in numpy than along a 32-wide inner axis
    xt = np.ascontiguousarray(xb.T)
    v = np.abs(xt)
    amax = np.maximum.reduce(v, axis=0)
    d = amax / np.float32(127)
    zero = d == 0
    inv = np.float32(1) / np.where(zero, np.float32(1), d)
    inv[zero] = 0
    np.multiply(xt, inv, out=v)
    # roundf: add the largest float below 0.5 with v's sign, then the int cast truncates
    half = (v.view(np.uint32) & np.uint32(0x80000000)) | _HALF_DOWN_BITS
    v += half.view(np.float32)
    out[:, 2:] = v.astype(np.int8).T.view(np.uint8)
    odd = ~(np.isfinite(amax) & np.isfinite(inv))
    if odd.any():
        d[odd], q = _odd_blocks(xb[odd])
        out[odd, 2:] = q.view(np.uint8)
    out[:, 0:2] = fp32_to_fp16_bits(d)[:, None].view(np.uint8)


def _odd_blocks(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks holding inf/NaN or with an overflowing 1/d, done element by element like C.

    ggml's `MAX(amax, |v|)` lets a NaN through only until the next element; the x86 float->int
    conversion maps every non-finite or out-of-range value to 0x80000000, whose low byte is 0.
    """
    amax = np.zeros(xb.shape[0], dtype=np.float32)
    a = np.abs(xb)
    for j in range(BLOCK):
        amax = np.where(amax > a[:, j], amax, a[:, j])
    d = amax / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0))
    v = roundf(xb * inv[:, None])
    v[~(np.abs(v) < np.float32(2.0**31))] = 0
    return d, v.astype(np.int64).astype(np.int8)


@np.errstate(over="ignore", invalid="ignore")
def dequantize(raw: np.ndarray) -> np.ndarray:
    """uint8 blocks -> flat float32: y = q * d, both in float32."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, BLOCK_BYTES)
    d = fp16_bits_to_fp32(blocks[:, 0:2].copy().view(np.uint16)[:, 0])
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    q *= d[:, None]
    return q.reshape(-1)
