"""K3's FFNs: the dense FFN of the leading layers and the latent MoE of the rest.

Latent MoE, as llama.cpp's build_latent_moe + build_moe_ffn run it:
  router:  p = sigmoid(W_r x)  (full-width x); top-k by p + bias (bias picks, never weighs);
           w = p[top-k]; w /= max(sum w, 2^-14) if renormalising; w *= scale if scale not in {0, 1}
  routed:  xl = W_down x;  y = sum_j w_j * E_j(xl) in top-k order, E(z) = W2 situ(W1 z, W3 z)
           y = RMSNorm(y) (routed norm, latent space);  y = W_up y
  shared:  W2s situ(W1s x, W3s x) on the un-projected x, added last.
The routed sum is k3kit.layers.moe.RoutedMoE's (grouping, plan, provider, batched training
path); this module adds what is K3's: the router, the latent projections and routed norm, the
shared experts, SiTU, MXFP4 fake quantization of the experts (`mxfp4_fake_quant` per expert on
the reference path, `mxfp4_fake_quant_fast` per stack on the batched one: same values), ggml's
Q8_0 input rounding (parity checks) and the training balance term.

Next-layer expert prefetch (`set_expert_prefetch`): the residual stream changes little from
one layer to the next, so layer L+1's router applied to layer L's MoE input names most of the
experts L+1 will route to. Each LatentMoE with a successor computes that guess and passes it
to the provider's optional `prefetch` right after planning its own experts: an expert store
can then read L+1's experts while L's experts and L+1's attention compute. A guess only ever
starts reads; the experts used are always the real router's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from k3kit.kernels import fused as kfused
from k3kit.layers.moe import ExpertProvider, ExpertWeights, RoutedMoE
from k3kit.layers.norm import rms_norm
from k3kit.layers.quantized_linear import fused_products

from .activations import situ
from .config import K3ModelConfig
from .mxfp4 import ggml_input_round, mxfp4_fake_quant, mxfp4_fake_quant_fast, q8_0_round

# ggml clamps the routing weight sum to the smallest normal float16
_WEIGHT_SUM_MIN = 6.103515625e-5


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
        return route(torch.sigmoid(ggml_input_round(x, self.ggml_input) @ self.weight.t()), self.bias, cfg)


def route(probs: Tensor, bias: Tensor, cfg: K3ModelConfig) -> tuple[Tensor, Tensor]:
    """The router's sigmoid scores probs [N, E] -> (expert ids [N, k] best first by probs + bias,
    their weights [N, k]: renormalised and scaled as the config says). The one routing every
    path takes (Router, the batched pass, the row steps), so they keep the same floats."""
    ids = torch.topk(probs + bias, cfg.num_experts_per_tok, dim=-1, sorted=True).indices
    native = _native_weights(probs, ids, cfg)
    if native is not None:
        return ids, native
    w = torch.gather(probs, -1, ids)
    if cfg.moe_renormalize:
        w = w / weight_sum(w).clamp_min(_WEIGHT_SUM_MIN)
    if cfg.routed_scaling_factor not in (0.0, 1.0):
        w = w * cfg.routed_scaling_factor
    return ids, w


def _native_weights(probs: Tensor, ids: Tensor, cfg: K3ModelConfig) -> Tensor | None:
    """route's weights from probs [N, E] (float32, contiguous, on the CPU, no gradient) and the
    chosen ids [N, k], in one native call with the same IEEE operations as the torch ops below
    (gather, weight_sum, clamp_min, divide, scale; tests/models/test_k3_moe.py compares them
    bit for bit); None elsewhere."""
    fn = getattr(kfused._fused, "route_weights", None) if kfused.available() else None
    if fn is None or probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.dim() != 2 \
            or not probs.is_contiguous() or (probs.requires_grad and torch.is_grad_enabled()) \
            or ids.dtype != torch.int64 or not ids.is_contiguous():
        return None
    n, k = ids.shape
    w = torch.empty(n, k)
    fn(probs.data_ptr(), ids.data_ptr(), w.data_ptr(), n, k, probs.shape[1], int(cfg.moe_renormalize),
       _WEIGHT_SUM_MIN, float(cfg.routed_scaling_factor))
    return w


def weight_sum(w: Tensor) -> Tensor:
    """The routing weights' sums [N, 1] as ggml's sum_rows takes them on the CPU: accumulated in
    double in slot order, rounded once to float. torch's CPU cumsum accumulates float32 that way
    (its sum's order follows the CPU's vector width: AVX2 and AVX-512 machines gave other bits for
    8 experts), so every CPU path, the row steps' own on the host included
    (k3kit.models.kimi_k3.row_ffn.host_weights), gets the same floats."""
    if w.device.type == "cpu" and w.dtype == torch.float32:
        return torch.cumsum(w, dim=-1)[..., -1:]
    return w.sum(dim=-1, keepdim=True)


class DenseFFN(nn.Module):
    def __init__(self, cfg: K3ModelConfig, width: int):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        gu = fused_products((self.gate_proj, self.up_proj), x)     # quantized: one call, the same bits
        if gu is not None:
            g, u = gu.unbind(0)
            y = self.down_proj(situ(g, u, cfg.situ_beta, cfg.situ_linear_beta))
            return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), cfg.situ_beta, cfg.situ_linear_beta))


class LatentMoE(RoutedMoE):
    def __init__(self, cfg: K3ModelConfig, layer: int, with_experts: bool = True):
        """`with_experts=False` leaves the routed experts out: an ExpertProvider must supply them."""
        d_in = cfg.moe_in_dim
        super().__init__(cfg.num_experts, d_in, cfg.moe_intermediate_size, layer, with_experts)
        self.cfg = cfg
        self.router = Router(cfg)
        if cfg.expert_latent_size > 0:
            self.routed_down: nn.Linear | None = nn.Linear(cfg.hidden_size, d_in, bias=False)
            self.routed_up: nn.Linear | None = nn.Linear(d_in, cfg.hidden_size, bias=False)
            self.routed_norm = nn.Parameter(torch.ones(d_in)) if cfg.routed_expert_norm else None
        else:
            self.routed_down = self.routed_up = None
            self.routed_norm = None
        self.shared = DenseFFN(cfg, cfg.shared_intermediate_size) if cfg.num_shared_experts > 0 else None
        # training (batched path, train mode): the balance term for the trainer, see balance_loss
        self.balance_loss: Tensor | None = None
        # (layer, router) of the next MoE layer whose experts to guess (set_expert_prefetch);
        # a tuple, so the router is not registered a second time as a submodule
        self.next_router: tuple[int, Router] | None = None

    @property
    def ggml_q8_inputs(self) -> bool:
        """Emulate ggml-cpu's Q8_0 rounding of expert inputs (llama.cpp parity checks only)."""
        return self.input_round is not None

    @ggml_q8_inputs.setter
    def ggml_q8_inputs(self, on: bool) -> None:
        self.input_round = q8_0_round if on else None

    def act(self, gate: Tensor, up: Tensor) -> Tensor:
        return situ(gate, up, self.cfg.situ_beta, self.cfg.situ_linear_beta)

    def expert_weights(self, expert: int) -> ExpertWeights:
        """The module's expert, MXFP4-rounded when the model is."""
        g, u, d = self.gate_exps[expert], self.up_exps[expert], self.down_exps[expert]
        if self.cfg.experts_mxfp4:
            return ExpertWeights(mxfp4_fake_quant(g), mxfp4_fake_quant(u), mxfp4_fake_quant(d))
        return ExpertWeights(g, u, d)

    def stacked_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        g, u, d = super().stacked_weights()
        if self.cfg.experts_mxfp4:
            return mxfp4_fake_quant_fast(g), mxfp4_fake_quant_fast(u), mxfp4_fake_quant_fast(d)
        return g, u, d

    def forward(self, x: Tensor, experts: ExpertProvider | None = None) -> tuple[Tensor, Tensor]:
        """x [..., hidden] (ffn-normed) -> (output [..., hidden], expert ids [..., k])."""
        cfg = self.cfg
        lead = x.shape[:-1]
        xf = x.reshape(-1, x.shape[-1])
        ids, w = self.router(xf)
        if self.training and self.batched_for(experts):
            self.balance_loss = balance_loss(self.router.weight, xf, ids, cfg.num_experts)
        xl = self.routed_down(xf) if self.routed_down is not None else xf
        guess = self.guess_next(xf, experts)
        home = self.experts_device(experts, xl)
        shared: Tensor | None = None
        if home != xl.device:
            # routed experts in RAM under a trunk on a GPU (--cpu-moe): the rows cross first (the
            # layer's one wait for the GPU), then the shared expert is queued on the GPU, where it
            # runs while the CPU multiplies the routed ones
            xh, ih, wh = xl.to(home), ids.to(home), w.to(home)
            shared = self.shared(xf) if self.shared is not None else None
            y = self.run_experts(xh, ih, wh, experts, guess).to(xl.device)
        else:
            y = self.run_experts(xl, ids, w, experts, guess)
        if self.routed_norm is not None:
            y = rms_norm(y, self.routed_norm, cfg.rms_norm_eps)
        if self.routed_up is not None:
            y = self.routed_up(y)
        if self.shared is not None:
            y = y + (shared if shared is not None else self.shared(xf))
        if y.dim() == 2 and len(lead) == 1:       # decode and verify rows: no view ops
            return y, ids
        return y.reshape(*lead, -1), ids.reshape(*lead, -1)


    def guess_next(self, xf: Tensor, experts: ExpertProvider | None) -> tuple[int, list[int]] | None:
        """The next MoE layer's router on this layer's input: (layer, distinct experts), or None
        when prefetch is off or the provider cannot use it."""
        if self.next_router is None or getattr(experts, "prefetch", None) is None or self.training:
            return None
        layer, router = self.next_router
        with torch.no_grad():
            ids, _ = router(xf.to(router.weight.device))    # a layer split may place it elsewhere
        return layer, torch.unique(ids).tolist()


def set_expert_prefetch(modules: Iterable[nn.Module], on: bool = True) -> int:
    """Link (or unlink) every LatentMoE among `modules` (e.g. `model.modules()`) to the next
    one by layer index, so each guesses its successor's experts (module doc). Returns the
    number of links made."""
    moes = sorted((m for m in modules if isinstance(m, LatentMoE)), key=lambda m: m.layer)
    for m in moes:
        m.next_router = None
    if not on:
        return 0
    for m, nxt in zip(moes, moes[1:], strict=False):
        m.next_router = (nxt.layer, nxt.router)
    return max(len(moes) - 1, 0)


def balance_loss(router_w: Tensor, x: Tensor, ids: Tensor, n_experts: int) -> Tensor:
    """Switch/DeepSeek-style balance term E * sum_e f_e * P_e (1.0 when perfectly balanced):
    f_e = share of the top-k slots routed to e, P_e = mean over tokens of e's normalised
    sigmoid score. It complements the selection-bias controller, which alone is too slow to
    stop an early collapse onto a few experts in a run of a few hundred steps."""
    probs = torch.sigmoid(x @ router_w.t())
    probs = probs / probs.sum(dim=-1, keepdim=True)
    f = torch.bincount(ids.reshape(-1), minlength=n_experts).to(probs.dtype) / ids.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


def use_fast_moe(model: nn.Module) -> int:
    """Switch every LatentMoE of `model` to the batched training path (taken when it runs its
    own experts without a provider); returns how many were switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, LatentMoE):
            m.batched = True
            n += 1
    return n
