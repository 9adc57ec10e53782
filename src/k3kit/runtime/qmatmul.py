"""Quantized weights that multiply themselves: `x @ W.T` straight from ggml blocks.

A routed expert is used by one row per decode step and a handful per verify pass. Turning
its 11M MXFP4 values into a bf16 matrix for that costs 20-40 ms on a CPU core; multiplying
the 17-byte blocks directly (the `_mxfp4` extension, built from `_mxfp4.c` at install) costs
about one pass over the quantized bytes (~1.5 ms for a K3 expert matrix and one row here).
So the expert store can keep experts as their quantized bytes, 4x as many per MiB as bf16,
and each use picks the cheaper way to multiply:

* up to `NATIVE_MAX_ROWS` rows: the native kernel (float32 products and sums), its output
  columns split over torch's thread count (each column's sum is the same for any split);
* more rows (prefill): dequantize once for this call and use torch's matmul, whose blocked
  GEMM amortises the dequant over the rows.

Without the extension (no C compiler at install, or a non-MXFP4 type) every call takes the
second way. `native_available()` says which build is in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from k3kit.runtime.dequant import dequantize, nbytes_for

try:
    from k3kit.runtime import _mxfp4
except ImportError:  # built without a C compiler: torch dequant only
    _mxfp4 = None

T = GGMLQuantizationType
NATIVE_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.MXFP4})
# Rows above which dequantize + torch GEMM beats the native kernel for a K3 expert matrix
# (7168 x 2048, bf16 GEMM, 1 thread; benchmarks/bench_qmatmul.py): 32 rows take 17 ms
# natively (AVX-512) against 38 ms for dequant + GEMM, 64 rows 60 ms against 39 ms.
NATIVE_MAX_ROWS = 32


def native_available() -> bool:
    return _mxfp4 is not None


def native_simd() -> str:
    """'avx512', 'avx2', 'scalar', or 'none' (extension not built)."""
    return _mxfp4.simd() if _mxfp4 is not None else "none"


@dataclass(frozen=True, eq=False)
class QuantizedMatrix:
    """A ggml matrix of ggml shape (n_in, n_out) kept as its bytes; multiplies as [n_out, n_in].

    `dtype` is the compute dtype its dequantized form and products come out in.
    """

    raw: torch.Tensor            # uint8, contiguous, exactly the tensor's bytes
    qtype: GGMLQuantizationType
    shape: tuple[int, int]       # ggml order: (n_in, n_out)
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(f"QuantizedMatrix needs a 2-D ggml shape, got {self.shape}")
        if self.raw.dtype != torch.uint8 or not self.raw.is_contiguous():
            raise ValueError("QuantizedMatrix bytes must be a contiguous uint8 tensor")
        need = nbytes_for(self.qtype, self.shape[0] * self.shape[1])
        if self.raw.numel() != need:
            raise ValueError(f"{T(self.qtype).name} matrix {self.shape} needs {need} bytes, "
                             f"got {self.raw.numel()}")
        object.__setattr__(self, "_raw_np", self.raw.numpy())   # the kernel's view, made once

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
        return _mxfp4 is not None and self.qtype in NATIVE_TYPES

    def dequantize(self) -> torch.Tensor:
        """[n_out, n_in] in the compute dtype (a fresh tensor each call)."""
        return dequantize(self.raw, self.qtype, self.shape, self.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, n_in] -> x @ W.T [m, n_out], in x's dtype."""
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"matmul: x {tuple(x.shape)} does not fit a [{self.out_features}, "
                             f"{self.in_features}] weight")
        m = x.shape[0]
        if self.native and 0 < m <= NATIVE_MAX_ROWS and x.device.type == "cpu":
            xf = x.detach().to(torch.float32).contiguous()
            y = torch.empty(m, self.out_features, dtype=torch.float32)
            _mxfp4.matmul(self._raw_np, xf.numpy(), y.numpy(), self.out_features, self.in_features, m,
                          -1, torch.get_num_threads())
            return y.to(x.dtype)
        w = self.dequantize().to(x.device)
        if m == 1 and not torch.is_grad_enabled():
            return torch.mv(w, x[0].to(w.dtype)).unsqueeze(0).to(x.dtype)
        return (x.to(w.dtype) @ w.t()).to(x.dtype)
