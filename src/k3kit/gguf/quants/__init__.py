"""Bit-exact ggml quant codecs in numpy: quantize, dequantize and block sizes by GGML type.

Quantizers match ggml's `quantize_row_*_ref` (what `ggml_quantize_chunk` runs without an
importance matrix) byte for byte, so a tensor requantized by k3kit is the file llama.cpp's
tools would write. Dequantizers match ggml's `dequantize_row_*` bit for bit in float32.
One module per codec; this module only dispatches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from k3kit.errors import K3Error

from . import float as _float
from . import kquant_dequant, mxfp4, q4_k, q8_0

T = GGMLQuantizationType


class QuantTypeError(K3Error):
    """A tensor type or shape the codecs cannot handle (unsupported type, ragged rows, bad size)."""


_QUANTIZE: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.F32: _float.quantize_f32,
    T.F16: _float.quantize_f16,
    T.BF16: _float.quantize_bf16,
    T.Q8_0: q8_0.quantize,
    T.Q4_K: q4_k.quantize,
    T.MXFP4: mxfp4.quantize,
}

_DEQUANTIZE: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    T.F32: _float.dequantize_f32,
    T.F16: _float.dequantize_f16,
    T.BF16: _float.dequantize_bf16,
    T.Q8_0: q8_0.dequantize,
    T.Q4_K: q4_k.dequantize,
    T.Q5_K: kquant_dequant.dequantize_q5_k,
    T.Q6_K: kquant_dequant.dequantize_q6_k,
    T.MXFP4: mxfp4.dequantize,
}

QUANTIZE_TYPES = frozenset(_QUANTIZE)
DEQUANTIZE_TYPES = frozenset(_DEQUANTIZE)


def _qtype(qtype: GGMLQuantizationType | int) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(int(qtype))
    except ValueError:
        raise QuantTypeError(f"unknown ggml type {qtype!r}") from None


def type_size(qtype: GGMLQuantizationType | int) -> tuple[int, int]:
    """(elements per block, bytes per block), as gguf.GGML_QUANT_SIZES."""
    return GGML_QUANT_SIZES[_qtype(qtype)]


def row_bytes(qtype: GGMLQuantizationType | int, n_per_row: int) -> int:
    """Bytes of one row of `n_per_row` elements; the row must be whole blocks."""
    t = _qtype(qtype)
    blk, nbytes = GGML_QUANT_SIZES[t]
    if n_per_row % blk:
        raise QuantTypeError(f"row of {n_per_row} elements is not a multiple of the {t.name} block ({blk})")
    return n_per_row // blk * nbytes


def quantize(data: np.ndarray, qtype: GGMLQuantizationType | int) -> np.ndarray:
    """float32 (..., n) -> uint8 (..., row_bytes(qtype, n)); bit-exact with ggml (no imatrix)."""
    t = _qtype(qtype)
    fn = _QUANTIZE.get(t)
    if fn is None:
        raise QuantTypeError(f"cannot quantize to {t.name} (supported: {_names(_QUANTIZE)})")
    data = np.asarray(data)
    if data.ndim == 0:
        raise QuantTypeError("cannot quantize a scalar: need at least one row")
    row_bytes(t, data.shape[-1])
    return fn(np.ascontiguousarray(data, dtype=np.float32))


def dequantize(raw: np.ndarray | bytes, qtype: GGMLQuantizationType | int, n_elements: int) -> np.ndarray:
    """ggml bytes of `n_elements` values -> flat float32 array of n_elements, bit-exact with ggml."""
    t = _qtype(qtype)
    fn = _DEQUANTIZE.get(t)
    if fn is None:
        raise QuantTypeError(f"cannot dequantize {t.name} (supported: {_names(_DEQUANTIZE)})")
    if n_elements < 0:
        raise QuantTypeError(f"negative element count {n_elements}")
    want = row_bytes(t, n_elements)
    buf = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, bytes | bytearray | memoryview) else raw
    buf = np.asarray(buf)
    if buf.dtype != np.uint8:
        raise QuantTypeError(f"{t.name} data must be uint8 bytes, got {buf.dtype}")
    if buf.size != want:
        raise QuantTypeError(f"{t.name} data of {buf.size} bytes for {n_elements} elements (expected {want})")
    return fn(buf.reshape(-1))


def quantize_rows(data: np.ndarray, qtype: GGMLQuantizationType | int, chunk_rows: int = 256) -> np.ndarray:
    """quantize() a 2-D (rows, n) array `chunk_rows` rows at a time into one preallocated output.

    Bounds the float32 temporaries of a big tensor (requant of a 7168 x 18432 matrix) to a
    few chunks instead of the whole tensor; the bytes are the same as one quantize() call.
    """
    t = _qtype(qtype)
    if data.ndim != 2:
        raise QuantTypeError(f"quantize_rows needs a 2-D array, got shape {data.shape}")
    if chunk_rows < 1:
        raise QuantTypeError(f"chunk_rows must be >= 1, got {chunk_rows}")
    out = np.empty((data.shape[0], row_bytes(t, data.shape[1])), dtype=np.uint8)
    for r in range(0, data.shape[0], chunk_rows):
        out[r : r + chunk_rows] = quantize(data[r : r + chunk_rows], t)
    return out


def _names(table: dict) -> str:
    return ", ".join(t.name for t in table)
