"""The elementwise pieces of K3: situ and the delta-rule L2 norm (float32).

Written in llama.cpp's operation order (src/models/kimi-k3.cpp, models.h) so a float32
run here and a float32 ggml run differ only by summation order. RMSNorm is the shared
k3kit.layers.norm.rms_norm (its default "ggml" order).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3kit.kernels import fused


def situ(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """situ(g, u) = beta*tanh(g/beta)*sigmoid(g) * lb*tanh(u/lb); lb <= 0 leaves u as is.

    Both branches are soft clamps: the gate saturates at +-beta, the linear branch at +-lb.
    Float32 on the CPU without a gradient: one native pass (k3kit.kernels.fused).
    """
    if (y := fused.situ(gate, up, beta, linear_beta)) is not None:
        return y
    a = torch.tanh(gate * (1.0 / beta)) * beta
    a = a * torch.sigmoid(gate)
    if linear_beta > 0.0:
        up = torch.tanh(up * (1.0 / linear_beta)) * linear_beta
    return a * up


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim.

    llama.cpp builds it as rms_norm(x, eps/n) / sqrt(n) (build_gdn_l2_norm), which is this
    with eps inside the root; the eps is the model's RMS eps, not a separate constant.
    Float32 on the CPU without a gradient: one native pass, the sum in double.
    """
    if (y := fused.l2_norm(x, eps)) is not None:
        return y
    return x * torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps).reciprocal()   # = 1.0 / sqrt
