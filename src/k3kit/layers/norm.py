"""RMSNorm over the last dimension, in the two operation orders k3kit's references use.

Both compute x / sqrt(mean(x^2) + eps) * weight, but they round differently in float32, and
each architecture is tested bit for bit against its own reference, so both orders are kept:

  "ggml": x * (1 / sqrt(mean(x^2) + eps)), then * weight   (llama.cpp's ggml_rms_norm; K3)
  "hf":   x * rsqrt(mean(x^2) + eps) * weight              (transformers' Qwen3-style RMSNorm;
                                                            the DFlash / DSpark draft)
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from k3kit.kernels import fused

Style = Literal["ggml", "hf"]


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, style: Style = "ggml") -> Tensor:
    """RMS-normalise the last dim of `x`, then scale by `weight` (None: no weight).

    "ggml" rows of float32 on the CPU without a gradient take the native step (ggml's arithmetic:
    the squares summed in double; k3kit.kernels.fused), everything else these torch ops."""
    if style == "ggml" and (y := fused.rms_norm(x, weight, eps)) is not None:
        return y
    var = x.pow(2).mean(dim=-1, keepdim=True)
    # `.reciprocal()`, not `1.0 / t`: Python's reflected division is reciprocal() * 1.0, the same
    # floats and one op more (a decode step runs ~50 of these norms)
    scale = torch.rsqrt(var + eps) if style == "hf" else torch.sqrt(var + eps).reciprocal()
    y = x * scale
    return y if weight is None else y * weight


class RMSNorm(nn.Module):
    """rms_norm with its weight as a parameter (initialised to ones)."""

    def __init__(self, dim: int, eps: float, style: Style = "ggml"):
        super().__init__()
        self.eps = eps
        self.style: Style = style
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.style)
