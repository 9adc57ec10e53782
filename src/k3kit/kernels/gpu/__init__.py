"""GPU products on ggml bytes (Triton): what a CUDA QuantizedLinear runs instead of dequantizing W.

Without them a CUDA layer dequantizes its whole weight with torch ops on every product
(k3kit.kernels.dequant) and runs torch's GEMM: it reads the bytes, writes and reads back a float
copy, every step. The kernels here (kernels/gpu/kernels.py) decode 256-value tiles of the file's
bytes in registers instead: a GEMV-like kernel for up to GEMV_MAX_ROWS rows (decode, verify;
each weight byte read once, row-invariant), a tl.dot GEMM for more (prefill), and a dequantizer
bitwise equal to the CPU one (embedding rows).

Triton is optional (the `gpu` extra) and imported only when a kernel first runs, so neither the
CPU path nor `import k3kit` pays for it. The same kernels run on the CPU under Triton's
interpreter (TRITON_INTERPRET=1), which is how CI checks them against the CPU dequantizer.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import torch
from gguf import GGMLQuantizationType

T = GGMLQuantizationType

# ggml types with a Triton decoder (kernels/gpu/decode.py)
SUPPORTED: frozenset[GGMLQuantizationType] = frozenset({
    T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.MXFP4,
    T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
    T.TQ1_0, T.TQ2_0, T.F16, T.BF16})
# Rows up to which `matmul` runs the row-invariant GEMV kernel (kept equal to kernels.GEMV_MAX_ROWS,
# here so that asking does not import triton).
GEMV_MAX_ROWS = 16
# How `matmul` multiplies more rows: "dequant" = W dequantized by the Triton kernel into chunks of
# at most PREFILL_CHUNK_BYTES in the compute dtype, each multiplied by torch's GEMM; "dot" = the
# tl.dot kernel on tiles decoded in registers (no chunk in memory). Measured on an H200 (7168 x
# 18432, 256 rows, bf16): see benchmarks/RESULTS.md.
PREFILL = "dequant"
PREFILL_CHUNK_BYTES = 64 << 20

_notified = False


def interpreted() -> bool:
    """Is Triton's CPU interpreter switched on (TRITON_INTERPRET=1, read when kernels are defined)?"""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str | None = None) -> bool:
    """Can the Triton kernels run on `device` (default: CUDA)? Needs triton importable, and
    CUDA for a CUDA device, TRITON_INTERPRET=1 for the CPU. K3KIT_GPU_KERNELS=torch in the
    environment turns them off (the torch dequantization then runs: for comparisons)."""
    dev = torch.device("cuda" if device is None else device)
    if os.environ.get("K3KIT_GPU_KERNELS") == "torch" or importlib.util.find_spec("triton") is None:
        return False
    if dev.type == "cuda":
        return torch.cuda.is_available()
    return dev.type == "cpu" and interpreted()


def supports(qtype: int) -> bool:
    return int(qtype) in {int(t) for t in SUPPORTED}


def notify_fallback(qtype: int, device: torch.device) -> None:
    """Say once per process that a GPU product dequantizes with torch ops instead (no triton, or a
    type without a Triton decoder): the slow path, worth knowing about, not worth repeating."""
    global _notified
    if _notified:
        return
    _notified = True
    why = ("triton is not installed (pip install 'k3kit[gpu]')" if importlib.util.find_spec("triton") is None
           else f"no Triton kernel for {T(qtype).name}")
    warnings.warn(f"quantized products on {device} dequantize the weights with torch ops: {why}",
                  RuntimeWarning, stacklevel=3)


def _kernels() -> ModuleType:
    return importlib.import_module("k3kit.kernels.gpu.kernels")      # imports triton


def _check(raw: torch.Tensor, qtype: int, n_in: int, n_out: int) -> None:
    if not supports(qtype):
        raise ValueError(f"no Triton kernel for ggml type {T(qtype).name}")
    if raw.dtype != torch.uint8 or not raw.is_contiguous():
        raise ValueError("weight bytes must be a contiguous uint8 tensor")
    elems, nbytes = _block(qtype)
    if n_in % elems or raw.numel() != n_in // elems * nbytes * n_out:
        raise ValueError(f"{T(qtype).name} [{n_in}, {n_out}] needs {n_in // elems * nbytes * n_out} bytes "
                         f"in whole blocks of {elems}, got {raw.numel()}")


def _block(qtype: int) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[T(qtype)]


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, n_in: int, n_out: int,
           dtype: torch.dtype = torch.float32, prefill: str = "") -> torch.Tensor:
    """x [M, n_in] @ W.T, W the ggml [n_in, n_out] tensor whose bytes are `raw` (on x's device).
    Up to GEMV_MAX_ROWS rows: float32 products and sums, each output row independent of the
    others; float32 [M, n_out]. More rows (`prefill`, default PREFILL): W rounded to `dtype` (the
    compute dtype, as a float trunk in that dtype would hold it) times x in `dtype`; float32 sums,
    float32 result ("dot") or `dtype` ("dequant": torch's GEMM output)."""
    _check(raw, qtype, n_in, n_out)
    k = _kernels()
    if x.shape[0] <= GEMV_MAX_ROWS:
        return k.gemv(x.float().contiguous(), raw, int(qtype), n_in, n_out)
    how = prefill or PREFILL
    if how == "dot":
        return k.gemm(x.to(dtype), raw, int(qtype), n_in, n_out)
    if how != "dequant":
        raise ValueError(f"prefill {how!r}: expected 'dequant' or 'dot'")
    xc = x.to(dtype)
    rows = max(1, min(n_out, PREFILL_CHUNK_BYTES // (n_in * dtype.itemsize)))
    if rows == n_out:
        return xc @ k.dequantize(raw, int(qtype), n_in, n_out, dtype).t()
    row_bytes = raw.numel() // n_out
    y = torch.empty(x.shape[0], n_out, dtype=dtype, device=x.device)
    for r0 in range(0, n_out, rows):
        r1 = min(n_out, r0 + rows)
        w = k.dequantize(raw[r0 * row_bytes:r1 * row_bytes], int(qtype), n_in, r1 - r0, dtype)
        y[:, r0:r1] = xc @ w.t()
        del w                        # freed before the next chunk is made
    return y


def grouped_gemv(x: torch.Tensor, mats: list[torch.Tensor], pair_mat: list[int], pair_row: list[int],
                 qtype: int, n_in: int, n_out: int) -> torch.Tensor:
    """y[p] = x[pair_row[p]] @ W_{pair_mat[p]}.T for every pair p in one launch (a MoE layer's routed
    rows, each against its expert's matrix): `mats` ggml [n_in, n_out] matrices of one `qtype` on
    x's device. float32 [pairs, n_out]; each row bitwise what `matmul` gives that row alone."""
    for m in mats:
        _check(m, qtype, n_in, n_out)
    if any(not 0 <= i < len(mats) for i in pair_mat) or len(pair_row) != len(pair_mat) \
            or any(not 0 <= r < x.shape[0] for r in pair_row):
        raise ValueError("grouped_gemv: a pair names no matrix or no row")
    return _kernels().grouped_gemv(x.float().contiguous(), mats, pair_mat, pair_row, int(qtype), n_in, n_out)


class TritonMatrix:
    """A ggml matrix kept as its bytes on a device and multiplied there by these kernels (a
    MatmulWeight, k3kit.layers.moe): a routed expert's projection in VRAM (or, under Triton's
    interpreter, in RAM) at the file's size, not dequantized."""

    def __init__(self, raw: torch.Tensor, qtype: int, shape: tuple[int, int], dtype: torch.dtype):
        _check(raw, qtype, shape[0], shape[1])
        self.raw, self.qtype, self.dtype = raw, int(qtype), dtype
        self.in_features, self.out_features = shape

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def to(self, device: torch.device) -> TritonMatrix:
        if self.raw.device == device:
            return self
        shape = (self.in_features, self.out_features)
        return TritonMatrix(self.raw.to(device), self.qtype, shape, self.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] -> x @ W.T [n, out] in x's dtype (GEMV float32 sums up to GEMV_MAX_ROWS rows)."""
        y = matmul(x, self.raw, self.qtype, self.in_features, self.out_features, self.dtype)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ggml [n_in, n_out] tensor's bytes -> [n_out, n_in] in `dtype`: bitwise what
    k3kit.kernels.dequant.dequantize gives for blocks with finite scales (float32 decoded, then
    one rounding to `dtype`)."""
    n_in, n_out = shape
    _check(raw, qtype, n_in, n_out)
    return _kernels().dequantize(raw, int(qtype), n_in, n_out, dtype)
