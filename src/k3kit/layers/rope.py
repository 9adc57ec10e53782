"""Rotary position embeddings (NeoX layout) with optional YaRN scaling.

Frequencies are computed in float64 and the angles too: cos/sin are rounded to the input's
dtype only at the end, so a float32 run matches llama.cpp's ggml_rope_ext to rounding.

YaRN keeps the high-frequency dims as trained (extrapolation), divides the low-frequency dims
by `factor` (interpolation) and ramps linearly between the dims that complete `beta_fast` and
`beta_slow` rotations over the original context; the cos/sin magnitude grows with the factor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from k3kit.kernels import fused

YARN_BETA_FAST = 32.0   # the defaults of HF's and llama.cpp's YaRN
YARN_BETA_SLOW = 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude for a context `scale` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(dim: int, base: float, *, factor: float | None = None, original_context: int = 0,
             beta_fast: float = YARN_BETA_FAST, beta_slow: float = YARN_BETA_SLOW,
             truncate: bool = True) -> Tensor:
    """Inverse frequencies [dim / 2] (float64) of `dim` rotary dims; YaRN-blended if `factor`."""
    # on the CPU even under a `torch.device("meta")` block (a model built there): there the factory
    # would go through torch._refs, whose first use imports torch._dynamo (1.5 s of a load)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    inv_extra = 1.0 / pos_freqs
    if factor is None:
        return inv_extra
    inv_inter = 1.0 / (factor * pos_freqs)

    def correction_dim(n_rot: float) -> float:
        return (dim * math.log(original_context / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_w = 1.0 - ramp
    return inv_inter * (1 - extra_w) + inv_extra * extra_w


def yarn_magnitude(factor: float, *, mscale: float = 0.0, mscale_all_dim: float = 0.0,
                   attention_factor: float | None = None) -> float:
    """The cos/sin magnitude under YaRN: an explicit attention factor, else the mscale ratio
    (DeepSeek style, when both are set), else yarn_mscale(factor)."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class RopeTable(NamedTuple):
    """cos and sin [n, 1, rd] of n positions, in the activations' dtype: made once for the rows
    of a pass and applied to every head of every layer that ropes those positions."""

    cos: Tensor
    sin: Tensor

    def apply(self, x: Tensor) -> Tensor:
        """NeoX-style rotation of the first rd dims of x [n, heads, head_dim]."""
        if (y := fused.rope_neox(x, self.cos, self.sin)) is not None:
            return y
        rd = self.cos.shape[-1]
        xr, xp = x[..., :rd], x[..., rd:]
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([-x2, x1], dim=-1)
        y = xr * self.cos + rot * self.sin
        return y if xp.shape[-1] == 0 else torch.cat([y, xp], dim=-1)


def rope_table(pos: Tensor, inv_freq: Tensor, mag: float, dtype: torch.dtype) -> RopeTable:
    """The cos/sin table of positions `pos` [n]: angles in float64, rounded to `dtype` at the end."""
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return RopeTable((ang.cos() * mag).to(dtype)[:, None, :], (ang.sin() * mag).to(dtype)[:, None, :])


def apply_rope(x: Tensor, pos: Tensor, inv_freq: Tensor, mag: float) -> Tensor:
    """NeoX-style rotary embedding on the first len(inv_freq)*2 dims of x [n, heads, head_dim]."""
    return rope_table(pos, inv_freq, mag, x.dtype).apply(x)
