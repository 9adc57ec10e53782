"""A training-speed KDA: the chunkwise gated delta rule (WY / UT form), same numbers as kda.py.

The reference `k3kit.models.kimi_k3.kda.delta_rule` runs one Python step per token, which is
right for decode and for checking llama.cpp, and hopeless for training (T sequential steps, each
a few tiny ops, and autograd keeps all of them). Here the sequence is cut into chunks of C rows.
Inside a chunk, with G_t = sum_{i<=t} g_i (per key dim, relative to the chunk start) and the
state S at the chunk start, the recurrence
    S_t = (I - b_t k_t k_t^T) diag(exp g_t) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(d)
unrolls to (Kimi-Linear / flash-linear-attention's chunk_kda, derived independently):
    u    = the "pseudo values" b_t (v_t - S'_t^T k_t);   with Kt = k*exp(G), Kh = k*exp(-G)
    (I + diag(b) tril_strict(Kt Kh^T)) u = diag(b) (V - Kt S)      (unit lower-triangular)
    => u = Ubar - W S   with Ubar = A^-1 diag(b) V, W = A^-1 diag(b) Kt  (the UT transform)
    O    = (Qt S + tril(Qt Kh^T) u) / sqrt(d)                     with Qt = q*exp(G)
    S'   = diag(exp G_C) S + (k*exp(G_C - G))^T u
All chunks' Ubar, W and attention blocks are computed at once; only the C-times-shorter loop
over chunks carrying S stays sequential.

exp(-G) grows like exp(C * |lower bound|): with K3's gate lower bound -5 a chunk of 16 keeps
it below e^80, inside float32. `chunk_size()` picks C from the bound; without one (kimi-linear's
softplus gate, unbounded decay) there is no safe C and callers use the reference loop.

The hook: `use_fast_kda(model)` rebinds `forward` of the model's KDA modules (instance
attributes, the classes are untouched) to `kda_forward`, which takes this path when no
recurrent state is passed (training, scoring) and defers to the reference otherwise.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import Tensor

from k3kit.models.kimi_k3.activations import l2_norm, rms_norm
from k3kit.models.kimi_k3.kda import KDA, causal_conv

# largest |sum of log decays| inside one chunk: exp(80) ~ 5.5e34 stays finite in float32
_MAX_CHUNK_LOG_DECAY = 80.0


def chunk_size(gate_lower_bound: float | None, limit: int = 16) -> int | None:
    """Chunk length (a power of two) that keeps exp(-G) finite for this gate, or None if the
    decay is unbounded."""
    if gate_lower_bound is None:
        return None
    lb = abs(float(gate_lower_bound))
    c = limit
    while c > 1 and c * lb > _MAX_CHUNK_LOG_DECAY:
        c //= 2
    return c


def unit_lower_inverse(N: Tensor) -> Tensor:
    """(I + N)^-1 for strictly lower-triangular N [..., C, C], C a power of two.

    N is nilpotent (N^C = 0), so the inverse is sum_k (-N)^k = (I - N)(I + N^2)(I + N^4)...:
    log2(C) batched matmuls, where a batched triangular solve on CPU runs one LAPACK call per
    16x16 system and costs more than the rest of the layer.
    """
    C = N.shape[-1]
    eye = torch.eye(C, dtype=N.dtype, device=N.device)
    P = -N
    inv = eye + P
    span = 2
    while span < C:
        P = P @ P
        inv = inv @ (eye + P)
        span *= 2
    return inv


def chunk_delta_rule(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     chunk: int = 16) -> tuple[Tensor, Tensor]:
    """Same contract as kda.delta_rule: q/k/g [B,T,H,dk], v [B,T,H,dv], beta [B,T,H],
    S [B,H,dk,dv]; returns (o [B,T,H,dv], final S). `g` must satisfy |sum over a chunk| <= 80."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    C = chunk
    pad = (-T) % C
    if pad:
        # padded rows: no decay, no write (beta 0), no query: outputs dropped, state untouched
        q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C
    scale = 1.0 / math.sqrt(dv)

    # [B, H, n, C, d]
    def chunks(t: Tensor) -> Tensor:
        return t.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    b = beta.reshape(B, n, C, H).permute(0, 3, 1, 2).unsqueeze(-1)        # [B, H, n, C, 1]
    G = g.cumsum(dim=-2)
    eG, e_negG = torch.exp(G), torch.exp(-G)
    Kt, Kh, Qt = k * eG, k * e_negG, q * eG
    k_to_end = k * torch.exp(G[..., -1:, :] - G)                           # k_i * exp(G_C - G_i)
    decay_end = eG[..., -1, :]                                             # [B, H, n, dk]

    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    L = torch.where(strict, Kt @ Kh.transpose(-1, -2), torch.zeros((), dtype=k.dtype, device=k.device))
    sol = unit_lower_inverse(b * L) @ torch.cat((b * v, b * Kt), dim=-1)
    Ubar, W = sol[..., :dv], sol[..., dv:]
    Aqk = torch.where(incl, Qt @ Kh.transpose(-1, -2), torch.zeros((), dtype=k.dtype, device=k.device))

    outs = []
    for c in range(n):
        u = Ubar[:, :, c] - W[:, :, c] @ S
        outs.append((Qt[:, :, c] @ S + Aqk[:, :, c] @ u) * scale)
        S = decay_end[:, :, c].unsqueeze(-1) * S + k_to_end[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2)                                           # [B, H, n, C, dv]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, dv)[:, :T]
    return o, S


def kda_forward(self: KDA, x: Tensor, state=None, commit: bool = True):
    """KDA.forward with the chunkwise delta rule when there is no recurrent state to keep."""
    cfg = self.cfg
    C = chunk_size(cfg.gate_lower_bound)
    if state is not None or C is None:
        return KDA.forward(self, x, state, commit)
    B, T, _ = x.shape
    H, D = cfg.num_heads, cfg.kda_head_dim
    conv_in = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
    window = x.new_zeros(B, cfg.conv_kernel - 1, cfg.kda_dim)
    outs = [F.silu(causal_conv(window, xi, w)[0]).view(B, T, H, D)
            for xi, w in zip(conv_in, (self.q_conv, self.k_conv, self.v_conv), strict=True)]
    q = l2_norm(outs[0], cfg.rms_norm_eps)
    k = l2_norm(outs[1], cfg.rms_norm_eps)
    g = self.decay(x)
    beta = torch.sigmoid(self.b_proj(x))
    S0 = x.new_zeros(B, H, D, D)
    o, _ = chunk_delta_rule(S0, q, k, outs[2], g, beta, C)
    gate = torch.sigmoid(self.g_proj(x)).view(B, T, H, D)
    o = rms_norm(o, self.o_norm, cfg.rms_norm_eps) * gate
    return self.o_proj(o.reshape(B, T, H * D)), None


def use_fast_kda(model: torch.nn.Module) -> int:
    """Route every KDA module of `model` through `kda_forward`; returns how many were switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, KDA):
            m.forward = types.MethodType(kda_forward, m)
            n += 1
    return n
