"""Dequantizers and lookup tables taken from gguf-py (`gguf.quants`), run in bounded chunks.

gguf-py 0.19 carries numpy dequantizers for the legacy, K, IQ, ternary and FP4 types and the
IQ grids / sign table as data. They evaluate ggml's `dequantize_row_*` expressions in the same
float32 order, so they are bit-identical to libggml on every block whose scales are finite
(tests/interop/test_quants_ggml.py holds them to that). What they do not bound is memory: a
whole tensor at once makes IQ intermediates ~10x the output. Here each call runs on
CHUNK_ELEMS values at a time into one preallocated float32 array.

The tables (`grid`, `KSIGNS`, `KVALUES_IQ4NL`, ...) are what the torch kernels in
k3kit.kernels.dequant gather from, so both paths decode the same data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf.quants as gq
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

# Types whose gguf-py dequantizer k3kit uses (checked bit for bit against libggml).
# Q1_0 is absent from gguf-py 0.19 (own codec in q1_0.py); Q8_0, Q4_K..Q6_K and MXFP4 have
# k3kit's own codecs (they also quantize), so they are not routed here.
DELEGATED: frozenset[GGMLQuantizationType] = frozenset({
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K,
    T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
    T.TQ1_0, T.TQ2_0, T.NVFP4,
})

# Values per chunk: 256 Ki float32 outputs (1 MiB) keep gguf-py's temporaries in a few MiB.
CHUNK_ELEMS = 1 << 18


def _codec(qtype: GGMLQuantizationType) -> Any:  # a gguf.quants codec class
    cls = getattr(gq, qtype.name, None)
    if cls is None or getattr(cls, "qtype", None) != qtype:
        raise LookupError(f"gguf-py {gguf_version()} has no {qtype.name} codec")
    cls.init_grid()
    return cls


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


def dequantizer(qtype: GGMLQuantizationType) -> Callable[[np.ndarray], np.ndarray]:
    """flat uint8 bytes of whole blocks -> flat float32, gguf-py's arithmetic in chunks."""
    cls = _codec(qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    step = max(1, CHUNK_ELEMS // elems)

    def dequantize(raw: np.ndarray) -> np.ndarray:
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)
        out = np.empty((blocks.shape[0], elems), dtype=np.float32)
        with np.errstate(all="ignore"):  # non-finite scales give inf/NaN, as in ggml
            for i in range(0, blocks.shape[0], step):
                out[i : i + step] = cls.dequantize_blocks(blocks[i : i + step])
        return out.reshape(-1)

    dequantize.__name__ = f"dequantize_{qtype.name.lower()}"
    return dequantize


def grid(qtype: GGMLQuantizationType) -> np.ndarray:
    """The IQ codebook of `qtype` as float32 [entries, values per entry] (ggml's iq*_grid).

    IQ1_S and IQ1_M share iq1s_grid (entries -1/0/+1); IQ2_* hold 0x08/0x19/0x2b,
    IQ3_* odd values: exactly the bytes ggml multiplies by, as floats.
    """
    cls = _codec(qtype)
    if cls.grid is None:
        raise LookupError(f"{qtype.name} has no grid")
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


# ksigns_iq2xs: 7 stored sign bits plus an eighth that makes the count of minus signs even.
KSIGNS: np.ndarray = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()
# kvalues_iq4nl (int8), shared by IQ4_NL and IQ4_XS.
KVALUES_IQ4NL: np.ndarray = np.array(gq.IQ4_NL.kvalues, dtype=np.int8)
# kvalues_mxfp4: e2m1 doubled, shared by MXFP4 and NVFP4 (each pairs it with a halved scale).
KVALUES_FP4: np.ndarray = np.array(gq.NVFP4.kvalues, dtype=np.int8)
# IQ1S_DELTA: the +-1/8 offset of IQ1_S / IQ1_M grid values.
IQ1S_DELTA: np.float32 = np.float32(gq.IQ1_S.delta)


def sign_table() -> np.ndarray:
    """float32 [128, 8]: row i = the eight +-1 factors of sign index i (bit j set -> -1)."""
    bits = (KSIGNS[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 0, np.float32(1), np.float32(-1))


def ue4m3_table() -> np.ndarray:
    """float32 [256]: ggml_ue4m3_to_fp32 of every NVFP4 scale byte (halved, like kvalues)."""
    with np.errstate(all="ignore"):
        return np.asarray(gq.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)), dtype=np.float32)
