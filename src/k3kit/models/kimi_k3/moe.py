"""K3's FFNs: the dense FFN of the leading layers and the latent MoE of the rest.

Latent MoE, as llama.cpp's build_latent_moe + build_moe_ffn run it:
  router:  p = sigmoid(W_r x)  (full-width x); top-k by p + bias (bias picks, never weighs);
           w = p[top-k]; w /= max(sum w, 2^-14) if renormalising; w *= scale if scale not in {0, 1}
  routed:  xl = W_down x;  y = sum_j w_j * E_j(xl) in top-k order, E(z) = W2 situ(W1 z, W3 z)
           y = RMSNorm(y) (routed norm, latent space);  y = W_up y
  shared:  W2s situ(W1s x, W3s x) on the un-projected x, added last.
Routed experts are MXFP4; `ExpertProvider` lets an engine supply their weights from its
own store while this module keeps the math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from .activations import rms_norm, situ
from .config import K3ModelConfig
from .mxfp4 import ggml_input_round, mxfp4_fake_quant, q8_0_round

# ggml clamps the routing weight sum to the smallest normal float16
_WEIGHT_SUM_MIN = 6.103515625e-5


class MatmulWeight(Protocol):
    """A weight that multiplies itself (e.g. one kept quantized by the engine's expert store)."""

    def matmul(self, x: Tensor) -> Tensor:
        """x [n, in] -> x @ W.T [n, out] in x's dtype."""
        ...


@dataclass
class ExpertWeights:
    """One routed expert in torch Linear layout ([out, in]): float tensors or MatmulWeights."""

    gate: Tensor | MatmulWeight   # [ff, d_in]  (HF w1)
    up: Tensor | MatmulWeight     # [ff, d_in]  (HF w3)
    down: Tensor | MatmulWeight   # [d_in, ff]  (HF w2)


class ExpertProvider(Protocol):
    """Source of routed-expert weights. The MoE asks once per distinct expert per forward.

    A provider may also have `plan(layer, experts)`: the MoE then says, before the first
    `get` of a layer, which experts it will ask for and in what order (a store can read the
    next one while the current one computes)."""

    def get(self, layer: int, expert: int) -> ExpertWeights: ...


class Router(nn.Module):
    def __init__(self, cfg: K3ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        # selection bias (e_score_correction_bias): balanced by a controller, not by gradients
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.ggml_input: str | None = None     # see K3Model.set_ggml_q8_inputs

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, hidden] -> (expert ids [N, k] best first, routing weights [N, k])."""
        cfg = self.cfg
        probs = torch.sigmoid(ggml_input_round(x, self.ggml_input) @ self.weight.t())
        ids = torch.topk(probs + self.bias, cfg.num_experts_per_tok, dim=-1, sorted=True).indices
        w = torch.gather(probs, -1, ids)
        if cfg.moe_renormalize:
            w = w / w.sum(dim=-1, keepdim=True).clamp_min(_WEIGHT_SUM_MIN)
        if cfg.routed_scaling_factor not in (0.0, 1.0):
            w = w * cfg.routed_scaling_factor
        return ids, w


class DenseFFN(nn.Module):
    def __init__(self, cfg: K3ModelConfig, width: int):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), cfg.situ_beta, cfg.situ_linear_beta))


class ModuleExperts:
    """The default provider: the MoE module's own parameters, MXFP4-rounded when the model is."""

    def __init__(self, moe: LatentMoE):
        self.moe = moe

    def get(self, layer: int, expert: int) -> ExpertWeights:
        m = self.moe
        w = ExpertWeights(m.gate_exps[expert], m.up_exps[expert], m.down_exps[expert])
        if m.cfg.experts_mxfp4:
            w = ExpertWeights(mxfp4_fake_quant(w.gate), mxfp4_fake_quant(w.up), mxfp4_fake_quant(w.down))
        return w


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3ModelConfig, layer: int, with_experts: bool = True):
        """`with_experts=False` leaves the routed experts out: an ExpertProvider must supply them."""
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        E, d_in, ff = cfg.num_experts, cfg.moe_in_dim, cfg.moe_intermediate_size
        self.router = Router(cfg)
        self.has_experts = with_experts
        if with_experts:
            self.gate_exps = nn.Parameter(torch.zeros(E, ff, d_in))
            self.up_exps = nn.Parameter(torch.zeros(E, ff, d_in))
            self.down_exps = nn.Parameter(torch.zeros(E, d_in, ff))
        if cfg.expert_latent_size > 0:
            self.routed_down = nn.Linear(cfg.hidden_size, d_in, bias=False)
            self.routed_up = nn.Linear(d_in, cfg.hidden_size, bias=False)
            self.routed_norm = nn.Parameter(torch.ones(d_in)) if cfg.routed_expert_norm else None
        else:
            self.routed_down = self.routed_up = None
            self.routed_norm = None
        self.shared = DenseFFN(cfg, cfg.shared_intermediate_size) if cfg.num_shared_experts > 0 else None
        # emulate ggml-cpu's Q8_0 rounding of expert inputs (llama.cpp parity checks only)
        self.ggml_q8_inputs = False

    def forward(self, x: Tensor, experts: ExpertProvider | None = None) -> tuple[Tensor, Tensor]:
        """x [..., hidden] (ffn-normed) -> (output [..., hidden], expert ids [..., k])."""
        cfg = self.cfg
        lead = x.shape[:-1]
        xf = x.reshape(-1, x.shape[-1])
        ids, w = self.router(xf)
        xl = self.routed_down(xf) if self.routed_down is not None else xf
        if experts is None:
            if not self.has_experts:
                raise ValueError(f"layer {self.layer}: built without routed experts; pass an ExpertProvider")
            experts = ModuleExperts(self)
        y = self.run_experts(xl, ids, w, experts)
        if self.routed_norm is not None:
            y = rms_norm(y, self.routed_norm, cfg.rms_norm_eps)
        if self.routed_up is not None:
            y = self.routed_up(y)
        if self.shared is not None:
            y = y + self.shared(xf)
        return y.reshape(*lead, -1), ids.reshape(*lead, -1)

    def run_experts(self, xl: Tensor, ids: Tensor, w: Tensor, experts: ExpertProvider) -> Tensor:
        """sum_j w[n, j] * E_{ids[n, j]}(xl[n]); each distinct expert is fetched and run once."""
        cfg = self.cfg
        N, k = ids.shape
        slots = xl.new_zeros(N, k, xl.shape[-1])
        # group the (row, slot) pairs by expert with one stable sort: each expert's pairs come
        # out in row-major order, as nonzero(ids == e) would give them
        order = torch.argsort(ids.reshape(-1), stable=True)
        uniq, counts = torch.unique_consecutive(ids.reshape(-1)[order], return_counts=True)
        all_rows, all_cols = order // k, order % k
        start = 0
        experts_in_order = uniq.tolist()
        plan = getattr(experts, "plan", None)
        if plan is not None:
            plan(self.layer, experts_in_order)
        for e, c in zip(experts_in_order, counts.tolist(), strict=True):
            rows, cols = all_rows[start:start + c], all_cols[start:start + c]
            start += c
            ew = experts.get(self.layer, e)
            z = q8_0_round(xl[rows]) if self.ggml_q8_inputs else xl[rows]
            h = situ(_matmul(z, ew.gate), _matmul(z, ew.up), cfg.situ_beta, cfg.situ_linear_beta)
            if self.ggml_q8_inputs:
                h = q8_0_round(h)
            slots.index_put_((rows, cols), _matmul(h, ew.down) * w[rows, cols, None])
        y = slots[:, 0]
        for j in range(1, k):     # ggml adds the k expert outputs one after another
            y = y + slots[:, j]
        return y


def _matmul(x: Tensor, weight: Tensor | MatmulWeight) -> Tensor:
    """x [n, in] @ weight[out, in].T. One row (decode: each expert sees one token) goes through
    a matrix-vector product, ~30% faster than the 1-row matmul for K3-sized bf16 experts."""
    if not isinstance(weight, Tensor):
        return weight.matmul(x)
    if x.shape[0] == 1 and not torch.is_grad_enabled():
        return torch.mv(weight, x[0]).unsqueeze(0)
    return x @ weight.t()
