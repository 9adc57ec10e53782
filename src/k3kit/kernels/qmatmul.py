"""Quantized weights that multiply themselves: `x @ W.T` straight from ggml blocks.

A routed expert is used by one row per decode step and a handful per verify pass, and a trunk
matrix by one row per decode step and hundreds per prefill chunk. Turning a K3 expert's 11M
values into a bf16 matrix for that costs 20-40 ms on a CPU core; multiplying the blocks directly
(the `_qmatmul` extension, built from `native/*.c` at install) costs about one pass over the
quantized bytes. So weights can stay as their file bytes (a quantized trunk, an expert cache of
quantized bytes, 2-8x as many per MiB as bf16), and each use picks the cheaper way to multiply:

* the native kernel (float32 weights exactly as ggml dequantizes them, float32 sums), its output
  columns split over torch's thread count (each column's sum is the same for any split, and a
  row's result the same for any number of rows: few rows run per-row tiles, many rows decode
  each block once into a panel that every row reuses, with the same arithmetic per row);
* dequantize + torch's GEMM beyond `native_max_rows(qtype, dtype)` rows: with a 16-bit compute
  dtype from ~16 rows (`NATIVE_MAX_ROWS`: bf16 GEMM outruns float32 FMAs), with float32 only
  for the types whose kernels scale partial sums, from 64 rows (`NATIVE_MAX_ROWS_F32`). W's rows
  are dequantized chunk by chunk (natively where the extension has the type) into a buffer of
  at most `GEMM_CHUNK_BYTES`, each chunk multiplied as it is made, so a product never holds W
  whole in the compute dtype.

That is the "float" arithmetic (float32 activations). A matrix made with `arith="ggml"` runs
ggml-cpu's own instead, for every row count: each row of x rounded to Q8_0 / Q8_K blocks as
ggml does, integer dot products (AVX512-VNNI), so a row's bits never depend on the other rows
and llama.cpp's rounding is reproduced; see ARITHS.

`NATIVE_TYPES` are the ggml types the extension multiplies (MXFP4, Q8_0, Q2_K..Q6_K, IQ1_S,
IQ1_M, IQ2_XXS, IQ2_XS, IQ3_XXS); without the extension (no C compiler at install) it is empty
and every call takes the second way. `native_available()` says which build is in use.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType

from k3kit.gguf.quants import gguf_py
from k3kit.kernels import threads as kthreads
from k3kit.kernels.dequant import block_size, dequantize, nbytes_for

try:
    from k3kit.kernels import _qmatmul
except ImportError:  # built without a C compiler: torch dequant only
    _qmatmul = None  # type: ignore[assignment]

T = GGMLQuantizationType


def _grid_bytes(qtype: GGMLQuantizationType, dtype: type) -> np.ndarray:
    """gguf-py's IQ grid of `qtype` as the integer bytes ggml multiplies by."""
    g = gguf_py.grid(qtype)
    q: np.ndarray = g.astype(dtype)
    if not np.array_equal(q.astype(np.float32), g):
        raise ValueError(f"{qtype.name} grid is not integral in {np.dtype(dtype).name}")
    return np.ascontiguousarray(q).view(np.uint8)


def _init_tables(ext: ModuleType) -> None:
    """Hand the extension its IQ grids and sign table: data from gguf-py, not typed in C."""
    ext.init_tables(_grid_bytes(T.IQ2_XXS, np.uint8), _grid_bytes(T.IQ2_XS, np.uint8),
                    _grid_bytes(T.IQ3_XXS, np.uint8), _grid_bytes(T.IQ1_S, np.int8),
                    np.ascontiguousarray(gguf_py.KSIGNS, dtype=np.uint8))


if _qmatmul is not None:
    _init_tables(_qmatmul)

NATIVE_TYPES: frozenset[GGMLQuantizationType] = (
    frozenset(T(t) for t in _qmatmul.types()) if _qmatmul is not None else frozenset())
# Rows up to which the native kernel multiplies; beyond, dequantize (natively, GEMM_CHUNK_BYTES
# at a time) + torch's GEMM in the compute dtype is faster. Measured with
# benchmarks/bench_qmatmul.py (1 thread, CPU time; 7168 x 2048 and 7168 x 16384; 4-512 rows) on an
# AMD EPYC (Zen 4, AVX-512 and AVX512_BF16; torch's GEMM is MKL): the native kernels run 55-90
# GFLOP/s in float32 from ~16 rows, bf16 GEMM 80-210 GFLOP/s, float32 GEMM 20-85.
# With a 16-bit compute dtype (bf16/f16):
NATIVE_MAX_ROWS: dict[GGMLQuantizationType, int] = {
    T.Q8_0: 16, T.Q4_K: 20, T.Q5_K: 16, T.Q6_K: 16, T.Q2_K: 16, T.Q3_K: 20, T.IQ2_XXS: 12,
    T.IQ2_XS: 20, T.IQ3_XXS: 16, T.IQ1_S: 16, T.IQ1_M: 24, T.MXFP4: 16,
}
# With float32 compute: the types whose kernels scale each 32-value partial sum (3 FMA-unit
# operations per 32 products instead of 2: ~65 GFLOP/s) lose to float32 GEMM beyond 64 rows; the
# others match it at 256-512 rows and win below, so they have no limit.
NATIVE_MAX_ROWS_F32: dict[GGMLQuantizationType, int] = {
    T.MXFP4: 64, T.IQ2_XXS: 64, T.IQ3_XXS: 64, T.IQ1_S: 64}
# The activation type ggml-cpu rounds x to before multiplying each weight type (its
# vec_dot_type), which the "ggml" mode reproduces.
ACT_TYPE: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    t: (T.Q8_0 if t in (T.Q8_0, T.MXFP4) else T.Q8_K) for t in NATIVE_TYPES}
# The arithmetic of QuantizedMatrix.matmul (fixed per matrix, so per model load: a row's result
# must not depend on which other rows share the call, or greedy speculative decoding and batch
# invariance break):
#   "float": float32 activations times the weights exactly as ggml dequantizes them (native
#            kernels up to native_max_rows rows, dequantize + torch GEMM beyond);
#   "ggml":  ggml's own arithmetic: each row of x rounded to Q8_0 / Q8_K blocks as ggml-cpu does,
#            integer dot products (AVX512-VNNI / AVX2 / scalar), for every row count. About 2x
#            the float kernels' throughput from ~8 rows, the same as them for one row, and
#            llama.cpp's rounding (lower KL against it).
ARITHS = ("float", "ggml")
# What a QuantizedMatrix made without `arith` uses (read at construction). Loads never rely on it:
# LoadOptions resolves `--arith auto` (ggml on the CPU with the extension, else float) and passes it.
DEFAULT_ARITH = "float"
# matmul_q8's path argument for the "ggml" arithmetic: -1 chooses by the row count (the same bits on
# every path). Benchmarks set 3 to time the 256-bit direct path that preceded the 512-bit one, 5 the
# folding 512-bit direct path alone (before the transposed one took 2-64 rows).
I8_PATH = -1
# The most bytes of dequantized weights a product beyond NATIVE_MAX_ROWS holds at once (a chunk
# of W's rows in the compute dtype; 8 MiB measured as fast as the whole matrix, and stays in L3).
GEMM_CHUNK_BYTES = 8 << 20


# glibc's mallopt parameters and what keep_freed_heap sets them to.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 32 << 20      # allocations below come from the heap (glibc's dynamic ceiling)
HEAP_TRIM_THRESHOLD = 256 << 20     # free heap kept before any is handed back to the OS
_heap_kept: bool | None = None


def keep_freed_heap() -> bool:
    """Have glibc keep freed heap memory instead of trimming it back to the OS; True if set.

    A decode step allocates and frees the same transient tensors every token (a K3 KDA layer's
    recurrent state is 4 MiB, made three times a step). By default glibc returns free memory at
    the top of the heap to the OS once it passes a (dynamic) trim threshold, so the next token's
    tensors page-fault fresh zeroed pages in again: 10-15 ms of a ~150 ms token on the 2-layer
    K3 slice, one thread (benchmarks/bench_slice.py). Process-wide and set once; a no-op without
    glibc's mallopt (other C libraries, other systems)."""
    global _heap_kept
    if _heap_kept is None:
        _heap_kept = False
        if sys.platform.startswith("linux"):
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):
                return False
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            _heap_kept = bool(mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
                              and mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD))
    return _heap_kept


_BUF_TYPES: dict[int, type[ctypes.Array[ctypes.c_char]]] = {}


def buf(t: torch.Tensor) -> ctypes.Array[ctypes.c_char]:
    """A buffer over a contiguous CPU tensor's memory, for the extension's `y*` / `w*` arguments.

    `t.numpy()` is an aten op (a detach) and costs twice as much host time; a decode step passes
    ~200 buffers. The caller keeps `t` alive for the call (the buffer does not own it)."""
    n = t.numel() * t.element_size()
    kind = _BUF_TYPES.get(n)
    if kind is None:
        kind = _BUF_TYPES.setdefault(n, ctypes.c_char * n)
    return kind.from_address(t.data_ptr())


def native_max_rows(qtype: GGMLQuantizationType, dtype: torch.dtype) -> int:
    """Rows up to which `QuantizedMatrix.matmul` runs the native kernel for this compute dtype
    (0: never, the type has no kernel or the extension is not built)."""
    if _qmatmul is None or qtype not in NATIVE_TYPES:
        return 0
    if dtype.itemsize >= 4:
        return NATIVE_MAX_ROWS_F32.get(T(qtype), sys.maxsize)
    return NATIVE_MAX_ROWS.get(T(qtype), 0)


def invariant_rows(qtype: GGMLQuantizationType, dtype: torch.dtype, arith: str) -> int:
    """Rows per CPU call up to which each output row of a product with this weight type is bitwise
    independent of the others: every row count in the ggml arithmetic (the int8 products never
    leave the native kernel, whose per-pair operations do not depend on the row count), else the
    native float kernel's limit (0: none)."""
    if arith == "ggml" and _qmatmul is not None and qtype in NATIVE_TYPES:
        return sys.maxsize
    return native_max_rows(qtype, dtype)


def native_available() -> bool:
    return _qmatmul is not None


def native_simd() -> str:
    """'avx512', 'avx2', 'scalar', or 'none' (extension not built)."""
    return _qmatmul.simd() if _qmatmul is not None else "none"


def native_amx() -> bool:
    """Whether the ggml-arithmetic products of many rows (Q8_0, MXFP4; from 12 rows) run on AMX-INT8:
    the CPU has it, Linux granted the tile state, and K3KIT_NO_AMX was not set when the extension
    loaded (K3KIT_NO_AMX=1 keeps the AVX512-VNNI paths, for A/B runs; the bits are the same)."""
    return bool(_qmatmul.amx()[0]) if _qmatmul is not None and hasattr(_qmatmul, "amx") else False


# types whose ggml-arithmetic products of AMX_FROM_ROWS or more rows take the AMX-INT8 path
AMX_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4})
AMX_FROM_ROWS = 12


def kernel_label(qtype: GGMLQuantizationType, arith: str) -> str:
    """What multiplies a native matrix of this type, for `--stats` / `--json`: 'native-avx512 ggml',
    plus ' (AMX from 12 rows)' where the many-row products run on AMX-INT8."""
    label = f"native-{native_simd()} {arith}"
    if arith == "ggml" and qtype in AMX_TYPES and native_amx():
        label += f" (AMX from {AMX_FROM_ROWS} rows)"
    return label


@dataclass(frozen=True, eq=False)
class QuantizedMatrix:
    """A ggml matrix of ggml shape (n_in, n_out) kept as its bytes; multiplies as [n_out, n_in].

    `dtype` is the compute dtype its dequantized form and products come out in.
    """

    raw: torch.Tensor            # uint8, contiguous, exactly the tensor's bytes
    qtype: GGMLQuantizationType
    shape: tuple[int, int]       # ggml order: (n_in, n_out)
    dtype: torch.dtype = torch.float32
    arith: str = ""              # "float" or "ggml" (ARITHS); "" takes DEFAULT_ARITH at construction
    _raw_np: np.ndarray = field(init=False, repr=False)   # the kernel's view of `raw`, made once
    _qtype_id: int = field(init=False, repr=False)        # int(qtype), made once (~70 calls a token)
    # (type, shape) where experts_q8 can run it (native, ggml arithmetic), else None: one compare
    # tells whether several matrices fuse
    _fuse_key: tuple[int, tuple[int, int]] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.arith:
            object.__setattr__(self, "arith", DEFAULT_ARITH)
        if self.arith not in ARITHS:
            raise ValueError(f"QuantizedMatrix arith {self.arith!r} is not one of {ARITHS}")
        if len(self.shape) != 2:
            raise ValueError(f"QuantizedMatrix needs a 2-D ggml shape, got {self.shape}")
        if self.raw.dtype != torch.uint8 or not self.raw.is_contiguous():
            raise ValueError("QuantizedMatrix bytes must be a contiguous uint8 tensor")
        if self.shape[0] % block_size(self.qtype)[0]:
            raise ValueError(f"{T(self.qtype).name} matrix {self.shape}: rows of {self.shape[0]} values are "
                             f"not whole blocks")
        need = nbytes_for(self.qtype, self.shape[0] * self.shape[1])
        if self.raw.numel() != need:
            raise ValueError(f"{T(self.qtype).name} matrix {self.shape} needs {need} bytes, "
                             f"got {self.raw.numel()}")
        object.__setattr__(self, "_raw_np", self.raw.numpy())
        object.__setattr__(self, "_qtype_id", int(self.qtype))
        fusable = self.arith == "ggml" and self.native and hasattr(_qmatmul, "experts_q8")
        object.__setattr__(self, "_fuse_key", (self._qtype_id, tuple(self.shape)) if fusable else None)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def out_features(self) -> int:
        return self.shape[1]

    @property
    def in_features(self) -> int:
        return self.shape[0]

    @property
    def native(self) -> bool:
        return _qmatmul is not None and self.qtype in NATIVE_TYPES

    @property
    def invariant_rows(self) -> int:
        """Rows per CPU call up to which each output row is bitwise independent of the others:
        every row count in the ggml arithmetic, else the native kernel's limit (0: none)."""
        return invariant_rows(self.qtype, self.dtype, self.arith)

    def dequantize(self) -> torch.Tensor:
        """[n_out, n_in] in the compute dtype (a fresh tensor each call)."""
        return self._dequantize_rows(0, self.out_features)

    def _dequantize_rows(self, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows r0 .. r1 - 1 of W ([r1 - r0, n_in], compute dtype), bit-identical to dequantize():
        natively (threads as torch's) for float32 and bfloat16 where the extension has the type,
        else with the torch dequantizers. `out` (contiguous, that shape and dtype) is filled if given."""
        n, k = r1 - r0, self.in_features
        row_bytes = self.nbytes // self.out_features
        if self.native and self.dtype in (torch.float32, torch.bfloat16):
            if out is None:
                out = torch.empty(n, k, dtype=self.dtype)
            bf16 = self.dtype == torch.bfloat16
            _qmatmul.dequantize(int(self.qtype), self._raw_np[r0 * row_bytes:r1 * row_bytes],
                                (out.view(torch.int16) if bf16 else out).numpy(), n, k, int(bf16), -1,
                                kthreads.native())
            return out
        w = dequantize(self.raw[r0 * row_bytes:r1 * row_bytes], self.qtype, (k, n), self.dtype)
        return w if out is None else out.copy_(w)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, n_in] -> x @ W.T [m, n_out], in x's dtype. In the ggml arithmetic on the CPU x may
        have any leading shape ([..., n_in] -> [..., n_out]: rows are rows, and no view op is
        spent on flattening them)."""
        if x.dim() < 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"matmul: x {tuple(x.shape)} does not fit a [{self.out_features}, "
                             f"{self.in_features}] weight")
        if self.arith == "ggml" and self.native and x.device.type == "cpu":
            return self._matmul_q8(x)
        if x.dim() != 2:
            raise ValueError(f"matmul: x {tuple(x.shape)} must be 2-D outside the ggml arithmetic")
        m = x.shape[0]
        if 0 < m <= native_max_rows(self.qtype, self.dtype) and x.device.type == "cpu":
            xf = x.detach().to(torch.float32).contiguous()
            y = torch.empty(m, self.out_features, dtype=torch.float32)
            _qmatmul.matmul(int(self.qtype), self._raw_np, buf(xf), buf(y), self.out_features,
                            self.in_features, m, -1, kthreads.native())
            return y.to(x.dtype)
        return self._gemm(x)

    def _matmul_q8(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T in ggml's arithmetic (int8 activation blocks, integer dot products)."""
        xf = x.detach() if x.requires_grad else x      # detach is an op: only when needed
        if xf.dtype != torch.float32 or not xf.is_contiguous():
            xf = xf.to(torch.float32).contiguous()
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        # addresses, not buffers: both tensors are contiguous float32 of the sizes passed
        _qmatmul.matmul_q8(self._qtype_id, self._raw_np, xf.data_ptr(), y.data_ptr(), self.out_features,
                           self.in_features, x.numel() // self.in_features, -1, kthreads.native(), 1,
                           I8_PATH)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T through torch in the compute dtype, W dequantized GEMM_CHUNK_BYTES at a time."""
        n_out, k = self.out_features, self.in_features
        rows = max(1, min(n_out, GEMM_CHUNK_BYTES // (k * self.dtype.itemsize)))
        xc = x.to(self.dtype)
        one_row = x.shape[0] == 1 and not torch.is_grad_enabled()
        if rows == n_out:
            w = self._dequantize_rows(0, n_out).to(x.device)
            y = torch.mv(w, xc[0]).unsqueeze(0) if one_row else xc @ w.t()
            return y.to(x.dtype)
        y = torch.empty(x.shape[0], n_out, dtype=self.dtype, device=x.device)
        buf = torch.empty(rows, k, dtype=self.dtype)
        for r0 in range(0, n_out, rows):
            r1 = min(n_out, r0 + rows)
            w = self._dequantize_rows(r0, r1, buf[:r1 - r0]).to(x.device)
            y[:, r0:r1] = torch.mv(w, xc[0]).unsqueeze(0) if one_row else xc @ w.t()
        return y.to(x.dtype)


@dataclass(frozen=True, eq=False)
class QuantizedHeads:
    """A 3-D ggml tensor of ggml shape (n_in, n_out, heads) kept as its bytes: `heads` matrices
    [n_out, n_in], head h multiplying its own rows of x.

    Such stacks (e.g. a latent attention's per-head up-projections) are small per head, so one
    product per head pays more in call overhead than in arithmetic; `matmul` runs every head in
    one native call (threads over heads), each head's result bit for bit what a QuantizedMatrix
    over that head's bytes gives in the same arithmetic, for any row count: rows never influence
    each other.
    """

    raw: torch.Tensor                  # uint8, contiguous, exactly the tensor's bytes
    qtype: GGMLQuantizationType
    shape: tuple[int, int, int]        # ggml order: (n_in, n_out, heads)
    dtype: torch.dtype = torch.float32
    arith: str = ""                    # "float" or "ggml" (ARITHS); "" takes DEFAULT_ARITH
    _raw_np: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.arith:
            object.__setattr__(self, "arith", DEFAULT_ARITH)
        if self.arith not in ARITHS:
            raise ValueError(f"QuantizedHeads arith {self.arith!r} is not one of {ARITHS}")
        if len(self.shape) != 3:
            raise ValueError(f"QuantizedHeads needs a 3-D ggml shape, got {self.shape}")
        if self.raw.dtype != torch.uint8 or not self.raw.is_contiguous():
            raise ValueError("QuantizedHeads bytes must be a contiguous uint8 tensor")
        n_in, n_out, heads = self.shape
        if n_in % block_size(self.qtype)[0]:
            raise ValueError(f"{T(self.qtype).name} heads {self.shape}: rows of {n_in} values are not "
                             f"whole blocks")
        need = nbytes_for(self.qtype, n_in * n_out * heads)
        if self.raw.numel() != need:
            raise ValueError(f"{T(self.qtype).name} heads {self.shape} need {need} bytes, "
                             f"got {self.raw.numel()}")
        on_cpu = self.raw.device.type == "cpu"
        object.__setattr__(self, "_raw_np", self.raw.numpy() if on_cpu else np.empty(0, np.uint8))

    @property
    def heads(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def native(self) -> bool:
        """Whether `matmul` runs the extension (CPU bytes, a type it multiplies)."""
        return _qmatmul is not None and self.qtype in NATIVE_TYPES and self.raw.device.type == "cpu"

    def head(self, h: int) -> QuantizedMatrix:
        """Head h as a QuantizedMatrix over its bytes (no copy; CPU bytes)."""
        per = self.nbytes // self.heads
        return QuantizedMatrix(self.raw[h * per:(h + 1) * per], self.qtype, self.shape[:2], self.dtype,
                               self.arith)

    def dequantize(self) -> torch.Tensor:
        """[heads, n_out, n_in] in the compute dtype, on the bytes' device (a fresh tensor)."""
        n_in, n_out, heads = self.shape
        return dequantize(self.raw, self.qtype, (n_in, n_out * heads), self.dtype).view(heads, n_out, n_in)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [heads, m, n_in] -> [heads, m, n_out] (x[h] @ W_h.T), in x's dtype. Natively: one
        call, float32 sums ("float") or ggml's int8 arithmetic ("ggml"). Otherwise the stack
        is dequantized for this call and multiplied by torch.bmm (no row invariance)."""
        n_in, n_out, heads = self.shape
        if x.dim() != 3 or x.shape[0] != heads or x.shape[2] != n_in:
            raise ValueError(f"matmul: x {tuple(x.shape)} does not fit {heads} heads of [{n_out}, {n_in}]")
        if not (self.native and x.device.type == "cpu"):
            return torch.bmm(x.to(self.dtype), self.dequantize().to(x.device).transpose(1, 2)).to(x.dtype)
        xf = x.detach() if x.requires_grad else x      # detach is an op: only when needed
        if xf.dtype != torch.float32 or not xf.is_contiguous():
            xf = xf.to(torch.float32).contiguous()
        m = x.shape[1]
        y = torch.empty(heads, m, n_out, dtype=torch.float32)
        _qmatmul.matmul_heads(int(self.qtype), self._raw_np, buf(xf), buf(y), heads, n_out, n_in, m,
                              self.nbytes // heads, int(self.arith == "ggml"), -1, kthreads.native())
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def experts_fusable(mats: Sequence[object]) -> bool:
    """Whether `experts_matmul_q8` takes these matrices: QuantizedMatrix objects of one type and
    shape, in the ggml arithmetic, with a native kernel and CPU bytes (an old build without the
    entry point: never)."""
    if not mats:
        return False
    key = getattr(mats[0], "_fuse_key", None)      # None: not a QuantizedMatrix, or not native ggml
    if key is None:
        return False
    for m in mats:
        if getattr(m, "_fuse_key", None) != key:    # a QuantizedMatrix's bytes are always on the CPU
            return False
    return True


def experts_matmul_q8(mats: Sequence[Sequence[QuantizedMatrix]], x: torch.Tensor,
                      counts: Sequence[int], rows: Sequence[int] | None = None, *,
                      checked: bool = False) -> torch.Tensor:
    """Every segment's products in one native call: x [P, n_in] holds segments of counts[s] rows
    in order, mats[s] the `per` matrices (e.g. gate and up) that multiply segment s; returns
    float32 [per, P, n_out], y[j] at segment s's rows = x_s @ mats[s][j].T.

    `rows` (P row indices of x, any [X, n_in]): the segments' rows are x[rows], read in place
    (a routing's rows, without a gathered copy). `checked`: the caller has just asked
    `experts_fusable` of these matrices (a decode step asks once, not twice).

    Each segment's result has the bits of `mats[s][j].matmul(x_s)` (the kernels matmul_q8 picks
    for that row count); the call saves what one call per matrix repeats: quantizing x_s again
    for each matrix, and a fork and join of the threads (a decode step of K3 runs 3 x top-k
    expert products a layer, each a few tens of microseconds of arithmetic per thread)."""
    if len(mats) != len(counts) or not mats:
        raise ValueError(f"experts_matmul_q8: {len(mats)} segments of matrices for {len(counts)} row counts")
    per = len(mats[0])
    flat = [m for seg in mats for m in seg]
    if len(flat) != per * len(mats) or not (checked or experts_fusable(flat)):
        raise ValueError("experts_matmul_q8: needs `per` native ggml-arithmetic matrices of one type "
                         "and shape per segment")
    first = flat[0]
    xf = x.detach() if x.requires_grad else x      # detach is an op: only when needed
    if xf.dtype != torch.float32 or not xf.is_contiguous():
        xf = xf.to(torch.float32).contiguous()
    P = sum(counts)
    n_rows = xf.shape[0] if rows is None else len(rows)
    if xf.dim() != 2 or xf.shape[1] != first.in_features or n_rows != P:
        raise ValueError(f"experts_matmul_q8: x {tuple(x.shape)} does not fit {P} rows of "
                         f"{first.in_features}")
    y = torch.empty(per, P, first.out_features, dtype=torch.float32)
    _qmatmul.experts_q8(first._qtype_id, [m._raw_np for m in flat], buf(xf), buf(y), list(counts),
                        first.out_features, first.in_features, per, kthreads.native(), rows)
    return y
