"""Bit-exact ggml quant codecs in numpy: quantize, dequantize and block sizes by GGML type.

Quantizers match ggml's `quantize_row_*_ref` (what `ggml_quantize_chunk` runs without an
importance matrix) byte for byte, so a tensor requantized by k3kit is the file llama.cpp's
tools would write. Dequantizers match ggml's `dequantize_row_*` bit for bit in float32 for
every block type gguf 0.19 lists (Q1_0 through NVFP4); tests/interop/test_quants_ggml.py
checks each against libggml. k3kit's own codecs: the floats, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4
(these also quantize) and Q1_0 (absent from gguf-py); the rest run gguf-py's dequantizers,
which are already bit-exact, in bounded chunks (gguf_py.py). scales.py knows where each type
keeps its scales: `first_nonfinite_block` / `check_finite` find corrupt blocks cheaply and
`random_blocks` makes valid ones. One module per codec; this module only dispatches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from k3kit.errors import FormatError, K3Error

from . import float as _float
from . import gguf_py, kquant_dequant, mxfp4, q1_0, q4_k, q8_0, scales

T = GGMLQuantizationType


class QuantTypeError(K3Error):
    """A tensor type or shape the codecs cannot handle (unsupported type, ragged rows, bad size)."""


class CorruptBlockError(FormatError):
    """A block whose scale is inf/NaN (or overflows): it would dequantize to non-finite values."""

    def __init__(self, message: str, qtype: GGMLQuantizationType, block: int) -> None:
        super().__init__(message)
        self.qtype = qtype
        self.block = block


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
    T.Q1_0: q1_0.dequantize,
    **{t: gguf_py.dequantizer(t) for t in sorted(gguf_py.DELEGATED)},
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
    return fn(_bytes_of(raw, t, n_elements).reshape(-1))


def _bytes_of(raw: np.ndarray | bytes, t: GGMLQuantizationType, n_elements: int) -> np.ndarray:
    """The uint8 array of `raw`, checked to hold exactly `n_elements` values of type t."""
    if n_elements < 0:
        raise QuantTypeError(f"negative element count {n_elements}")
    want = row_bytes(t, n_elements)
    buf = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, bytes | bytearray | memoryview) else raw
    buf = np.asarray(buf)
    if buf.dtype != np.uint8:
        raise QuantTypeError(f"{t.name} data must be uint8 bytes, got {buf.dtype}")
    if buf.size != want:
        raise QuantTypeError(f"{t.name} data of {buf.size} bytes for {n_elements} elements (expected {want})")
    return buf


# Blocks scanned per step of first_nonfinite_block: bounds its temporaries to a few MiB.
_CHECK_BLOCKS = 1 << 20


def first_nonfinite_block(raw: np.ndarray | bytes, qtype: GGMLQuantizationType | int,
                          n_elements: int) -> int | None:
    """Index of the first block that would dequantize to inf/NaN, or None when all are finite.

    Reads only the scale bytes (fp16 d/dmin/m, IQ1_M's split d, MXFP4's exponent; F32/F16/BF16
    check every value, a "block" being one element): a few ms for a 4096 x 4096 matrix.
    """
    t = _qtype(qtype)
    if t not in scales.CHECKED:
        raise QuantTypeError(f"no finiteness check for {t.name}")
    buf = _bytes_of(raw, t, n_elements)
    nbytes = GGML_QUANT_SIZES[t][1]
    blocks = buf.reshape(-1, nbytes)
    for start in range(0, blocks.shape[0], _CHECK_BLOCKS):
        bad = np.flatnonzero(scales.nonfinite_mask(blocks[start : start + _CHECK_BLOCKS], t))
        if bad.size:
            return start + int(bad[0])
    return None


def check_finite(raw: np.ndarray | bytes, qtype: GGMLQuantizationType | int, n_elements: int,
                 what: str = "tensor") -> None:
    """Raise CorruptBlockError (one line naming `what` and the block) if a block is non-finite.

    `what` is the caller's name for the data, e.g. "model.gguf: blk.3.ffn_down_exps.weight".
    """
    t = _qtype(qtype)
    i = first_nonfinite_block(raw, t, n_elements)
    if i is not None:
        elems = GGML_QUANT_SIZES[t][0]
        kind = "value" if t in scales.FLOATS else "block"
        raise CorruptBlockError(
            f"{what}: {t.name} {kind} {i} (elements {i * elems}..{(i + 1) * elems - 1}) "
            f"is not finite (inf/NaN scale or value); the file is corrupt", t, i)


def random_blocks(qtype: GGMLQuantizationType | int, n_blocks: int, rng: np.random.Generator,
                  scale_range: tuple[float, float] | None = None) -> np.ndarray:
    """uint8 [n_blocks, block_bytes] of random valid blocks (see scales.random_blocks)."""
    t = _qtype(qtype)
    if t not in scales.CHECKED:
        raise QuantTypeError(f"cannot make random {t.name} blocks")
    return scales.random_blocks(t, n_blocks, rng, scale_range)


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


def _names(table: Iterable[GGMLQuantizationType]) -> str:
    return ", ".join(t.name for t in table)
