"""Single-row products as matrix-vector products, for the decode step of a loaded trunk.

A decode step multiplies one row by every trunk matrix. torch's `linear` sends a 1-row bf16
input through its GEMM path, which reads the weight at 7-9 GB/s on this machine's cores;
`torch.mv` reads it at 11-18 GB/s (benchmarks/RESULTS.md, 1 thread, K3 trunk shapes), and a
decode step is nothing but those reads. float32 gains little (11.5 vs 11.6 GB/s at 7168^2)
and is left alone, so f32 runs compute exactly what they did.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

ROW_DTYPES = (torch.bfloat16, torch.float16)


class RowLinear(nn.Linear):
    """nn.Linear that runs one row (any leading shape of one element) as `torch.mv` when no
    gradient is needed and the weight is bf16/f16; everything else is nn.Linear's."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (x.numel() == x.shape[-1] and w.dtype in ROW_DTYPES and x.dtype == w.dtype
                and not torch.is_grad_enabled()):
            y = torch.mv(w, x.reshape(-1))
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], w.shape[0])
        return super().forward(x)


def use_row_linear(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` into a RowLinear in place (same parameters and
    hooks; only forward changes). Returns how many were converted."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = RowLinear
            n += 1
    return n
