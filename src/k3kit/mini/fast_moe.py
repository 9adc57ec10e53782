"""A training-speed latent MoE: one MXFP4 fake-quant per weight tensor and batched expert matmuls.

The reference `LatentMoE.run_experts` fetches each routed expert, fake-quantizes it and runs
its rows on its own; `mxfp4_fake_quant` finds each code by scanning all 16 candidates. That is
right for checking llama.cpp and too slow to train with. Here:

* `mxfp4_fake_quant_fast` rounds |x|/d (exact: d is a power of two) arithmetically on the
  three spacings of the e2m1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} instead of scanning 16
  error columns. It returns exactly what `mxfp4_fake_quant` returns: the two grid values
  bracketing |x| are within a factor 2 of x, so ggml's float32 errors |kv*d - x| are exact
  (Sterbenz) and its "first code wins a tie" means "the smaller magnitude wins", which the
  ceil(. - 1/2) rounding does. A test checks equality, ties included.
* the experts' (token, slot) rows are grouped by expert into a zero-padded [E, capacity, d]
  batch (capacity = the busiest expert's load, so nothing is dropped) and run with three bmm;
  slot outputs are then summed in top-k order as the reference does.

The hook: `use_fast_moe(model)` rebinds `forward` of every LatentMoE that holds its own experts;
with an ExpertProvider passed in, the reference path runs. In training mode the fast path
leaves `balance_loss` (see there) on the module for the trainer.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from k3kit.models.kimi_k3.activations import rms_norm, situ
from k3kit.models.kimi_k3.moe import LatentMoE

BLOCK = 32


def mxfp4_round(w: Tensor) -> Tensor:
    """`w` rounded to ggml's MXFP4 grid along its last dim (blocks of 32), as float32."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {BLOCK}, got {w.shape[-1]}")
    x = w.detach().to(torch.float32).reshape(-1, BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True)
    lg = torch.log2(amax.to(torch.float64)).to(torch.float32).to(torch.float64)
    e = torch.where(amax > 0, torch.floor(lg) - 2 + 127, torch.zeros_like(lg)).clamp(0, 255)
    d = torch.ldexp(torch.ones_like(e), e - 127).to(torch.float32)      # 2^(e-127), exact
    y = x.abs() / d                                                      # in [0, 8), exact
    # nearest grid value, ties to the smaller: steps of 0.5 below 2, 1 below 4, then {4, 6}
    mag = torch.where(y < 2, torch.ceil(2 * y - 0.5) * 0.5,
                      torch.where(y < 4, torch.ceil(y - 0.5),
                                  torch.clamp(torch.ceil(0.5 * y - 0.5) * 2, max=6.0))) * d
    return torch.where(x < 0, -mag, mag).reshape(w.shape)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor) -> Tensor:  # type: ignore[override]
        return mxfp4_round(w).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad      # straight-through estimator


def mxfp4_fake_quant_fast(w: Tensor) -> Tensor:
    return _FakeQuant.apply(w)


def run_experts_batched(xl: Tensor, ids: Tensor, w: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                        beta: float, linear_beta: float) -> Tensor:
    """sum_j w[n, j] * E_{ids[n, j]}(xl[n]) with experts gate/up [E, ff, d], down [E, d, ff]."""
    N, k = ids.shape
    E, d = gate.shape[0], xl.shape[-1]
    flat = ids.reshape(-1)                                   # slot s = n * k + j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    cap = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    pos = torch.arange(order.numel(), device=xl.device) - starts[sorted_e]
    xin = xl.new_zeros(E, cap, d)
    xin[sorted_e, pos] = xl[order // k]
    h = situ(torch.bmm(xin, gate.transpose(1, 2)), torch.bmm(xin, up.transpose(1, 2)), beta, linear_beta)
    yout = torch.bmm(h, down.transpose(1, 2))                # [E, cap, d]
    slots = xl.new_zeros(N * k, d)
    slots = slots.index_copy(0, order, yout[sorted_e, pos]) * w.reshape(-1, 1)
    slots = slots.view(N, k, d)
    y = slots[:, 0]
    for j in range(1, k):                                    # top-k order, as ggml adds them
        y = y + slots[:, j]
    return y


def balance_loss(router_w: Tensor, x: Tensor, ids: Tensor, n_experts: int) -> Tensor:
    """Switch/DeepSeek-style balance term E * sum_e f_e * P_e (1.0 when perfectly balanced):
    f_e = share of the top-k slots routed to e, P_e = mean over tokens of e's normalised
    sigmoid score. It complements the selection-bias controller, which alone is too slow to
    stop an early collapse onto a few experts in a run of a few hundred steps."""
    probs = torch.sigmoid(x @ router_w.t())
    probs = probs / probs.sum(dim=-1, keepdim=True)
    f = torch.bincount(ids.reshape(-1), minlength=n_experts).to(probs.dtype) / ids.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


def moe_forward(self: LatentMoE, x: Tensor, experts=None) -> tuple[Tensor, Tensor]:
    """LatentMoE.forward with batched experts; the reference path when a provider is given."""
    if experts is not None or not self.has_experts or self.ggml_q8_inputs:
        return LatentMoE.forward(self, x, experts)
    cfg = self.cfg
    lead = x.shape[:-1]
    xf = x.reshape(-1, x.shape[-1])
    ids, w = self.router(xf)
    if self.training:
        self.balance_loss = balance_loss(self.router.weight, xf, ids, cfg.num_experts)
    xl = self.routed_down(xf) if self.routed_down is not None else xf
    q = mxfp4_fake_quant_fast if cfg.experts_mxfp4 else (lambda t: t)
    y = run_experts_batched(xl, ids, w, q(self.gate_exps), q(self.up_exps), q(self.down_exps),
                            cfg.situ_beta, cfg.situ_linear_beta)
    if self.routed_norm is not None:
        y = rms_norm(y, self.routed_norm, cfg.rms_norm_eps)
    if self.routed_up is not None:
        y = self.routed_up(y)
    if self.shared is not None:
        y = y + self.shared(xf)
    return y.reshape(*lead, -1), ids.reshape(*lead, -1)


def use_fast_moe(model: torch.nn.Module) -> int:
    """Route every LatentMoE of `model` through `moe_forward`; returns how many were switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, LatentMoE):
            m.forward = types.MethodType(moe_forward, m)
            n += 1
    return n
