"""ctypes access to libggml-base from llama-cpp-python: the reference (de)quantizers.

`ggml_quantize_chunk` without an importance matrix runs ggml's `quantize_row_*_ref` (and the
plain fp16/bf16 row converters); a type's `to_float` trait is its `dequantize_row_*`. The
library is the one llama-cpp-python built, found in the installed `llama_cpp` package's lib
directory (K3KIT_LIBGGML_BASE overrides the path).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import numpy as np

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


def find_libggml_base() -> Path | None:
    env = os.environ.get("K3KIT_LIBGGML_BASE")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for cand in sorted(Path(root).rglob("libggml-base.so*")):
            return cand
    return None


class Ggml:
    """The entry points the codec tests need, typed."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        f = self.lib.ggml_quantize_chunk
        f.restype = ctypes.c_size_t
        f.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        r = self.lib.ggml_quantize_requires_imatrix
        r.restype = ctypes.c_bool
        r.argtypes = [ctypes.c_int]
        g = self.lib.ggml_get_type_traits
        g.restype = ctypes.POINTER(_TypeTraits)
        g.argtypes = [ctypes.c_int]
        self._to_float: dict[int, object] = {}

    def requires_imatrix(self, qtype: int) -> bool:
        return bool(self.lib.ggml_quantize_requires_imatrix(int(qtype)))

    def traits(self, qtype: int) -> _TypeTraits:
        return self.lib.ggml_get_type_traits(int(qtype)).contents

    def quantize(self, x: np.ndarray, qtype: int, imatrix: np.ndarray | None = None) -> np.ndarray:
        """float32 (rows, n) -> uint8 (rows, row_bytes), one ggml_quantize_chunk call.

        `imatrix` (float32 [n], per-column importance) is required by IQ2_XXS, IQ2_XS and IQ1_S
        (ggml_quantize_requires_imatrix); without one those types abort inside ggml.
        """
        x = np.ascontiguousarray(x, dtype=np.float32)
        x2 = x.reshape(-1, x.shape[-1])
        t = self.traits(qtype)
        row = x2.shape[1] // t.blck_size * t.type_size
        out = np.empty((x2.shape[0], row), dtype=np.uint8)
        if imatrix is None and self.requires_imatrix(qtype):
            raise ValueError(f"ggml type {qtype} needs an importance matrix to quantize")
        w = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
        if w is not None and w.shape != (x2.shape[1],):
            raise ValueError(f"imatrix of shape {w.shape} for rows of {x2.shape[1]}")
        n = self.lib.ggml_quantize_chunk(
            int(qtype), x2.ctypes.data, out.ctypes.data, 0, x2.shape[0], x2.shape[1],
            None if w is None else w.ctypes.data,
        )
        assert n == out.nbytes, (n, out.nbytes)
        return out.reshape(*x.shape[:-1], row)

    def dequantize(self, raw: np.ndarray, qtype: int, n_elements: int) -> np.ndarray:
        fn = self._to_float.get(int(qtype))
        if fn is None:
            ptr = self.traits(qtype).to_float
            assert ptr, f"type {qtype} has no to_float"
            fn = self._to_float[int(qtype)] = _TO_FLOAT(ptr)
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        y = np.empty(n_elements, dtype=np.float32)
        fn(raw.ctypes.data, y.ctypes.data, n_elements)
        return y


def load() -> Ggml | None:
    path = find_libggml_base()
    return Ggml(path) if path is not None and path.exists() else None


# ggml-cpu: the row quantizers and dot products llama.cpp's CPU backend runs (this CPU's SIMD build).
_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _CpuTraits(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


class GgmlCpu:
    """libggml-cpu's `from_float` (e.g. x86 quantize_row_q8_0) and `vec_dot` per type."""

    def __init__(self, path: Path, base: Ggml) -> None:
        self.base = base
        self.lib = ctypes.CDLL(str(path))
        self.lib.ggml_cpu_init.restype = None
        self.lib.ggml_cpu_init()
        g = self.lib.ggml_get_type_traits_cpu
        g.restype = ctypes.POINTER(_CpuTraits)
        g.argtypes = [ctypes.c_int]

    def traits(self, qtype: int) -> _CpuTraits:
        return self.lib.ggml_get_type_traits_cpu(int(qtype)).contents

    def vec_dot_type(self, qtype: int) -> int:
        return int(self.traits(qtype).vec_dot_type)

    def from_float(self, x: np.ndarray, qtype: int) -> np.ndarray:
        """float32 [rows, n] -> uint8 [rows, row_bytes] through the CPU backend's row quantizer."""
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        t = self.base.traits(qtype)
        row = x2.shape[1] // t.blck_size * t.type_size
        out = np.zeros((x2.shape[0], row), dtype=np.uint8)
        fn = _FROM_FLOAT(self.traits(qtype).from_float)
        for r in range(x2.shape[0]):
            fn(x2[r].ctypes.data, out[r].ctypes.data, x2.shape[1])
        return out

    def vec_dot(self, w_row: np.ndarray, x_row: np.ndarray, qtype: int, n: int) -> float:
        """One row of W (type `qtype`, bytes) dotted with one quantized activation row."""
        s = np.zeros(1, dtype=np.float32)
        w_row, x_row = np.ascontiguousarray(w_row), np.ascontiguousarray(x_row)
        dot = _VEC_DOT(self.traits(qtype).vec_dot)
        dot(n, s.ctypes.data, 0, w_row.ctypes.data, 0, x_row.ctypes.data, 0, 1)
        return float(s[0])


def load_cpu() -> GgmlCpu | None:
    base = load()
    path = find_libggml_base()
    if base is None or path is None:
        return None
    cpu = sorted(path.parent.glob("libggml-cpu.so*"))
    return GgmlCpu(cpu[0], base) if cpu else None


def quantize_row_ref(base: Ggml, x: np.ndarray, name: str, row_bytes: int) -> np.ndarray:
    """libggml-base's exported `quantize_row_<name>_ref` (e.g. q8_K, which ggml_quantize_chunk lacks)
    over each row of float32 x; out starts zeroed (q8_K leaves an all-zero block's bsums unwritten)."""
    fn = _FROM_FLOAT(ctypes.cast(getattr(base.lib, f"quantize_row_{name}_ref"), ctypes.c_void_p).value)
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.zeros((x2.shape[0], row_bytes), dtype=np.uint8)
    for r in range(x2.shape[0]):
        fn(x2[r].ctypes.data, out[r].ctypes.data, x2.shape[1])
    return out
