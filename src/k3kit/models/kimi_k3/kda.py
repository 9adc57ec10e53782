"""KDA: Kimi Delta Attention, the recurrent (linear-attention) layer of K3.

As llama.cpp's kimi-k3 builds it (build_kda_layer, kimi_k3_conv1d, ggml gated_delta_net):
  q, k, v = SiLU(causal depthwise conv_d(W_{q,k,v} x))           per channel, no bias
  q, k    = q / sqrt(|q|^2 + eps), k likewise                      per head, eps = RMS eps
  g       = lb * sigmoid(exp(A_log) * (W_fb W_fa x + dt_bias))      per head and key dim (K3)
          = -exp(A_log) * softplus(W_fb W_fa x + dt_bias)           when lb is unset (kimi-linear)
  beta    = sigmoid(W_b x)                                          per head
  S_t     = S_{t-1} * exp(g_t)[:, None];  S_t += k_t (beta_t (v_t - S_t^T k_t))^T
  o_t     = S_t^T q_t / sqrt(d)
  out     = W_o[ RMSNorm_d(o) * sigmoid(W_g x) ]                    full-rank gate, norm per head

Speculative support: `forward(..., commit=False)` leaves the state untouched and returns
the per-row inputs of the recurrence (`KDARows`); `commit_rows` then applies only the
first n of them, with the same step function, so the result is what a normal run over
those n rows leaves behind.

Three forms of the same recurrence, by use:
  delta_rule          one step per row: decode, prefill and replay (llama.cpp's order); in
                      inference the steps run natively (k3kit.kernels.kda_step, one pass over
                      each head's state per call), with gradients as torch ops
  delta_rule_chunked  per-chunk triangular solve: stateless forwards with gradients, T >= 32
  delta_rule_wy       chunkwise WY / UT form, all chunks at once: `KDA.chunked` modules
                      (training, scoring; switched on by `use_fast_kda`) without a state
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3kit.kernels import fused, kda_step
from k3kit.kernels import threads as kthreads
from k3kit.layers.norm import rms_norm
from k3kit.layers.quantized_linear import fused_products

from .activations import l2_norm
from .config import K3ModelConfig
from .state import KDAState


@dataclass
class KDARows:
    """Per-row inputs of one KDA layer's state update, for a later partial commit."""

    conv_in: Tensor   # [B, T, 3, d_inner] raw q/k/v projections (what the conv windows hold)
    k: Tensor         # [B, T, H, d] after conv, SiLU and L2 norm
    v: Tensor         # [B, T, H, d] after conv and SiLU
    g: Tensor         # [B, T, H, d] log-decay
    beta: Tensor      # [B, T, H]
    final: Tensor | None = None   # [B, H, d, d] the state after all T rows (what verify computed)

    @property
    def n_rows(self) -> int:
        return self.k.shape[1]


def delta_step(S: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, inplace: bool = False) -> Tensor:
    """One gated delta-rule transition; S [B,H,dk,dv], k/g [B,H,dk], v [B,H,dv], beta [B,H].
    `inplace`: S is the caller's to overwrite (the same floats, one [B,H,dk,dv] allocation and
    write fewer: with 8 sequences decoding, 50 MB a K3 layer); else the caller's S stays as it was.
    Differentiable in every input; the update is added in place unless k needs a gradient, whose
    backward reads the decayed S (autograd would refuse an S changed under it)."""
    decay = torch.exp(g).unsqueeze(-1)
    S = S.mul_(decay) if inplace else S * decay
    kv_mem = torch.einsum("bhij,bhi->bhj", S, k)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    update = k.unsqueeze(-1) * delta.unsqueeze(-2)
    if k.requires_grad and torch.is_grad_enabled():
        return S + update                   # the same floats as add_
    return S.add_(update)                   # in place: one [B,H,dk,dv] fewer per step


def delta_rule(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               inplace: bool = False) -> tuple[Tensor, Tensor]:
    """Run the recurrence over T rows: q/k/v/g [B,T,H,d], beta [B,T,H]; returns (o [B,T,H,d], S).
    The caller's S is left as it was unless `inplace` (then it is the returned S).

    Float32 on the CPU without a gradient (decode, prefill, verify, serving passes) runs the
    native steps (`native_steps`); otherwise `delta_rule_torch`."""
    if native_steps(S, q, k, v, g, beta):
        o, S_new = kda_step.rows(S, k, v, g, beta, q, inplace=inplace and S.is_contiguous())
        assert o is not None
        if inplace and S_new is not S:
            S_new = S.copy_(S_new)
        return o, S_new
    return delta_rule_torch(S, q, k, v, g, beta, inplace)


def delta_rule_torch(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     inplace: bool = False) -> tuple[Tensor, Tensor]:
    """`delta_rule` as torch ops, one `delta_step` per row (differentiable; the reference of the
    native steps). Without a gradient, the steps after the first update the step's own copy in
    place."""
    scale = 1.0 / math.sqrt(v.shape[-1])
    outs = []
    own = not torch.is_grad_enabled()
    for t in range(q.shape[1]):
        S = delta_step(S, k[:, t], v[:, t], g[:, t], beta[:, t], inplace=own and (inplace or t > 0))
        outs.append(torch.einsum("bhij,bhi->bhj", S, q[:, t]) * scale)
    return torch.stack(outs, dim=1), S


# False: every step runs as torch ops (tests and benchmarks compare the two ways)
NATIVE_STEPS = True


def native_steps(*tensors: Tensor) -> bool:
    """Whether the recurrence's steps on these tensors run in the `_kda` extension: one pass over
    each head's state per call instead of ~7 per row (k3kit.kernels.kda_step). Float32 on the CPU
    without a gradient, and the extension built; the results agree with the torch steps to float32
    rounding and are the same for any batch of sequences and thread count."""
    return NATIVE_STEPS and kda_step.usable(*tensors)


CHUNK = 16


def delta_rule_chunked(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """`delta_rule` computed chunk by chunk in parallel form: same math, far fewer kernels.

    Within a chunk, with G_t the running sum of g (so every decay factor exp(G_t - G_j),
    j <= t, is <= 1 and nothing overflows), the per-row deltas u_t = beta_t (v_t - S'_t^T k_t)
    solve a unit lower-triangular system
        u_t + beta_t sum_{j<t} (k_t . e^{G_t-G_j} k_j) u_j = beta_t (v_t - (e^{G_t} k_t)^T S_0),
    then  o_t = ((e^{G_t} q_t)^T S_0 + sum_{j<=t} (q_t . e^{G_t-G_j} k_j) u_j) / sqrt(d)
    and   S_C = e^{G_C} S_0 + sum_j (e^{G_C-G_j} k_j) u_j^T.
    Used for long training chunks; inference, decode and replay use the step loop.
    """
    B, T, H, D = q.shape
    scale = 1.0 / math.sqrt(v.shape[-1])
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))           # [B, H, T, d]
    beta = beta.transpose(1, 2)                                      # [B, H, T]
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc, gc, bc = q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk], \
            g[:, :, s:s + chunk], beta[:, :, s:s + chunk]
        C = qc.shape[2]
        G = gc.cumsum(dim=2)
        incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~incl[:, :, None], float("-inf"))
        E = torch.exp(diff)                                          # [B, H, t, j, d], 0 above the diagonal
        A = torch.einsum("bhtc,bhjc,bhtjc->bhtj", kc, kc, E).tril(-1)
        Bq = torch.einsum("bhtc,bhjc,bhtjc->bhtj", qc, kc, E)
        eG = torch.exp(G)
        rhs = bc.unsqueeze(-1) * (vc - (eG * kc) @ S)
        L = torch.eye(C, dtype=q.dtype, device=q.device) + bc.unsqueeze(-1) * A
        U = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
        outs.append(((eG * qc) @ S + Bq @ U) * scale)
        last = G[:, :, -1:]
        S = torch.exp(last).transpose(-1, -2) * S + (torch.exp(last - G) * kc).transpose(-1, -2) @ U
    return torch.cat(outs, dim=2).transpose(1, 2), S


# largest |sum of log decays| inside one WY chunk: exp(80) ~ 5.5e34 stays finite in float32
_MAX_CHUNK_LOG_DECAY = 80.0


def chunk_size(gate_lower_bound: float | None, limit: int = 16) -> int | None:
    """WY chunk length (a power of two) that keeps exp(-G) finite for this gate, or None if the
    decay is unbounded (kimi-linear's softplus gate: no safe length, the step loop runs)."""
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


def delta_rule_wy(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  chunk: int = 16) -> tuple[Tensor, Tensor]:
    """`delta_rule` in the chunkwise WY / UT form, every chunk's matrices computed at once.

    Same contract as delta_rule: q/k/g [B,T,H,dk], v [B,T,H,dv], beta [B,T,H], S [B,H,dk,dv];
    returns (o [B,T,H,dv], final S). `g` must satisfy |sum over a chunk| <= 80 (`chunk_size`).

    Inside a chunk, with G_t = sum_{i<=t} g_i (per key dim, relative to the chunk start) and the
    state S at the chunk start, the recurrence
        S_t = (I - b_t k_t k_t^T) diag(exp g_t) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(d)
    unrolls to (Kimi-Linear / flash-linear-attention's chunk_kda, derived independently):
        u    = the "pseudo values" b_t (v_t - S'_t^T k_t);   with Kt = k*exp(G), Kh = k*exp(-G)
        (I + diag(b) tril_strict(Kt Kh^T)) u = diag(b) (V - Kt S)      (unit lower-triangular)
        => u = Ubar - W S   with Ubar = A^-1 diag(b) V, W = A^-1 diag(b) Kt  (the UT transform)
        O    = (Qt S + tril(Qt Kh^T) u) / sqrt(d)                     with Qt = q*exp(G)
        S'   = diag(exp G_C) S + (k*exp(G_C - G))^T u
    All chunks' Ubar, W and attention blocks are computed at once; only the C-times-shorter
    loop over chunks carrying S stays sequential. exp(-G) grows like exp(C * |lower bound|):
    with K3's gate lower bound -5 a chunk of 16 keeps it below e^80, inside float32.
    """
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


def causal_conv(window: Tensor, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv: window [B, K-1, C] of past inputs, x [B, T, C], weight [C, K].

    out[t, c] = sum_j w[c, j] * xx[t + j, c] with xx = window ++ x (ggml_ssm_conv's order);
    returns (out [B, T, C], the new window).
    """
    xx = torch.cat((window, x), dim=1)
    T, K = x.shape[1], weight.shape[1]
    out = xx[:, 0:T] * weight[:, 0]
    for j in range(1, K):
        out = out + xx[:, j:j + T] * weight[:, j]
    return out, xx[:, T:]


# see short_convs: silu over q, k and v at once only when every row is whole SIMD vector pairs
# (no scalar tail, whose floats differ) and the work is one chunk (no thread split in a row)
_VECTOR_ELEMS = 64
_GRAIN = 32768


def detached(t: Tensor) -> Tensor:
    """t without its autograd history; t itself when it has none (detach is an op of its own)."""
    return t.detach() if t.requires_grad else t


def gated_norm(o: Tensor, weight: Tensor, eps: float, gate: Tensor) -> Tensor:
    """rms_norm(o, weight) * gate, the output's norm and gate: one native pass where it runs."""
    y = fused.rms_norm(o, weight, eps, gate)
    return y if y is not None else rms_norm(o, weight, eps) * gate


def short_convs(kda: KDA, window: Tensor, conv_in: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The q, k and v short convs and SiLU of `causal_conv`, in one pass over the three when the
    result has the same bits: window [B, 3, K-1, C], conv_in [B, T, 3, C] -> (q, k, v [B, T, H, d]
    after SiLU, before the L2 norms; the new window [B, 3, K-1, C], contiguous).

    The three convs as one [B, 3, K-1+T, C] tensor run the same products and sums, in the same
    order, per element (mul and add round alike in any layout); SiLU over all three is one call
    instead of three when `_VECTOR_ELEMS` divides C and the work is one chunk. Otherwise (and with
    a gradient) each conv runs on its own, as before."""
    cfg = kda.cfg
    B, T = conv_in.shape[:2]
    H, D, C = cfg.num_heads, cfg.kda_head_dim, cfg.kda_dim
    if (native := fused.short_conv(window, conv_in, kda.conv_taps_by_row())) is not None:
        out, new_window = native       # one pass, q/k/v each contiguous (SiLU in C: its own bits)
        q, k, v = out.view(3, B, T, H, D).unbind(0)      # two view ops, not six
        return q, k, v, new_window
    convs = (kda.q_conv, kda.k_conv, kda.v_conv)
    split = 3 * B * T * C >= _GRAIN and kthreads.native() > 1
    if torch.is_grad_enabled() or C % _VECTOR_ELEMS or split:
        outs, windows = [], []
        for i, w in enumerate(convs):
            y, win = causal_conv(window[:, i], conv_in[:, :, i], w)
            outs.append(F.silu(y).view(B, T, H, D))
            windows.append(win)
        return outs[0], outs[1], outs[2], torch.stack(windows, dim=1)
    taps = kda.conv_taps()
    xx = torch.cat((window, conv_in.transpose(1, 2)), dim=2)        # [B, 3, K-1+T, C]
    y = xx[:, :, 0:T] * taps[0]
    for j in range(1, len(taps)):
        y = y + xx[:, :, j:j + T] * taps[j]
    s = F.silu(y).transpose(1, 2)                                   # [B, T, 3, C]
    q, k, v = (s[:, :, i].view(B, T, H, D) for i in range(3))
    return q, k, v, xx[:, :, T:].contiguous()


class KDA(nn.Module):
    def __init__(self, cfg: K3ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, D, C, E = cfg.num_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.hidden_size
        self.q_proj = nn.Linear(E, C, bias=False)
        self.k_proj = nn.Linear(E, C, bias=False)
        self.v_proj = nn.Linear(E, C, bias=False)
        self.q_conv = nn.Parameter(torch.zeros(C, cfg.conv_kernel))
        self.k_conv = nn.Parameter(torch.zeros(C, cfg.conv_kernel))
        self.v_conv = nn.Parameter(torch.zeros(C, cfg.conv_kernel))
        self.f_a_proj = nn.Linear(E, D, bias=False)
        self.f_b_proj = nn.Linear(D, C, bias=False)
        self.b_proj = nn.Linear(E, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(C))
        self.g_proj = nn.Linear(E, C, bias=False)
        self.o_norm = nn.Parameter(torch.ones(D))
        self.o_proj = nn.Linear(C, E, bias=False)
        # stateless forwards (training, scoring) take delta_rule_wy when the gate is bounded;
        # with a state (decode, prefill, speculative) the step loop runs either way
        self.chunked = False
        self._taps: tuple[tuple[int, ...], list[Tensor]] | None = None   # conv_taps' cache
        self._taps_rows: tuple[tuple[int, ...], Tensor] | None = None      # conv_taps_by_row's cache
        self._rate: tuple[tuple[int, int], Tensor] | None = None         # decay_rate's cache

    def decay_rate(self) -> Tensor:
        """-exp(A_log) per head, [H, 1] (what the converter stores as ssm_a); without a gradient made
        once, and again only when A_log changes (its version counter): three ops a step fewer."""
        if torch.is_grad_enabled():
            return (-torch.exp(self.A_log)).view(self.cfg.num_heads, 1)
        key = (self.A_log._version, self.A_log.data_ptr())
        if self._rate is None or self._rate[0] != key:
            self._rate = (key, (-torch.exp(self.A_log)).view(self.cfg.num_heads, 1))
        return self._rate[1]

    def conv_taps(self) -> list[Tensor]:
        """The q/k/v conv weights per tap j, [3, 1, C] each (what `short_convs` multiplies by):
        made once, and again only when a conv weight changes (its version counter)."""
        key = tuple(w._version for w in (self.q_conv, self.k_conv, self.v_conv)) + (
            self.q_conv.data_ptr(), self.q_conv.device.index or 0)
        if self._taps is None or self._taps[0] != key:
            with torch.no_grad():
                w = torch.stack((self.q_conv, self.k_conv, self.v_conv))       # [3, C, K]
                taps = [w[:, None, :, j].contiguous() for j in range(w.shape[-1])]
            self._taps = (key, taps)
        return self._taps[1]

    def conv_taps_by_row(self) -> Tensor:
        """The q/k/v conv weights as [3, K, C] (tap j of every channel in a row: what the native
        short conv reads), made once and again only when a conv weight changes."""
        key = tuple(w._version for w in (self.q_conv, self.k_conv, self.v_conv)) + (self.q_conv.data_ptr(),)
        if self._taps_rows is None or self._taps_rows[0] != key:
            with torch.no_grad():
                rows = torch.stack((self.q_conv, self.k_conv, self.v_conv)).transpose(1, 2).contiguous()
            self._taps_rows = (key, rows)
        return self._taps_rows[1]

    def empty_state(self, batch: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> KDAState:
        cfg = self.cfg
        H, D = cfg.num_heads, cfg.kda_head_dim
        return KDAState(torch.zeros(batch, H, D, D, device=device, dtype=dtype),
                        torch.zeros(batch, 3, cfg.conv_kernel - 1, cfg.kda_dim, device=device, dtype=dtype))

    def decay(self, x: Tensor) -> Tensor:
        """The per-key-dim log decay g [B, T, H, d] (always <= 0)."""
        cfg = self.cfg
        B, T, _ = x.shape
        u = self.f_b_proj(self.f_a_proj(x)) + self.dt_bias
        u = u.view(B, T, cfg.num_heads, cfg.kda_head_dim)
        A = self.decay_rate()
        if cfg.gate_lower_bound is not None:
            return torch.sigmoid(-(u * A)) * cfg.gate_lower_bound
        return F.softplus(u) * A

    def forward(self, x: Tensor, state: KDAState | None = None, commit: bool = True,
                ) -> tuple[Tensor, KDARows | None]:
        """x [B, T, hidden] (already attn-normed). With `commit`, `state` is advanced (without a
        gradient, state.S is written in place: nothing else may hold it); without, it is left
        untouched and the rows needed for `commit_rows` are returned."""
        cfg = self.cfg
        if self.chunked and state is None:
            C = chunk_size(cfg.gate_lower_bound)
            if C is not None:
                return forward_wy(self, x, C)
        B, T, _ = x.shape
        H, D = cfg.num_heads, cfg.kda_head_dim
        if state is None:
            state = self.empty_state(B, x.device, x.dtype)
            commit = True    # nothing to keep
            keep = False
        else:
            keep = True

        conv_in, gate_in = project_qkvg(self, x)
        q, k, v, window = short_convs(self, state.conv, conv_in)
        q = l2_norm(q, cfg.rms_norm_eps)
        k = l2_norm(k, cfg.rms_norm_eps)
        g = self.decay(x)
        beta = torch.sigmoid(self.b_proj(x))

        # llama.cpp's CPU op runs the step loop for prefill too; the loop keeps inference on its
        # summation order (small differences get amplified by ggml's Q8 rounding of expert
        # inputs and the routed norm). Training takes the parallel form.
        if torch.is_grad_enabled():
            recur = delta_rule_chunked if T >= 2 * CHUNK else delta_rule
            o, S = recur(state.S, q, k, v, g, beta)
        else:
            # a committed step advances the state it was given in place (the same floats): no new
            # [B, H, d, d] state per decoded token; a speculative one leaves it as it was
            recur = delta_rule
            o, S = delta_rule(state.S, q, k, v, g, beta, inplace=commit)

        rows = None
        if keep and commit:
            state.S = detached(S)
            state.conv = detached(window)
        elif keep:
            final = detached(S) if recur is delta_rule else None     # the replay's exact steps only
            rows = KDARows(detached(conv_in), detached(k), detached(v), detached(g), detached(beta), final)

        gate = torch.sigmoid(gate_in).view(B, T, H, D)
        o = gated_norm(o, self.o_norm, cfg.rms_norm_eps, gate)
        return self.o_proj(o.reshape(B, T, H * D)), rows


def project_qkvg(kda: KDA, x: Tensor) -> tuple[Tensor, Tensor]:
    """x [B, T, hidden] -> (conv_in [B, T, 3, C]: the raw q, k and v projections, the output
    gate's projection [B, T, C], before its sigmoid). Quantized, without a gradient: one native
    call for the four (layers.quantized_linear.fused_products, the same bits), conv_in a view of
    its [3, B*T, C] rows that the native short conv reads in place; else four products."""
    B, T, _ = x.shape
    C = kda.cfg.kda_dim
    y = fused_products((kda.q_proj, kda.k_proj, kda.v_proj, kda.g_proj), x)
    if y is not None:      # one view op each: conv_in[b, t, i] is y[i, b*T + t]
        return (y.as_strided((B, T, 3, C), (T * C, C, B * T * C, 1)),
                y.as_strided((B, T, C), (T * C, C, 1), 3 * B * T * C))
    return torch.stack((kda.q_proj(x), kda.k_proj(x), kda.v_proj(x)), dim=2), kda.g_proj(x)


def project_rows(kda: KDA, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The row-wise half of KDA.forward (x [B, T, hidden]), for a pass over rows of several
    sequences: (conv_in [B, T, 3, C] raw q/k/v projections, g [B, T, H, d], beta [B, T, H],
    output gate [B, T, H, d]). Same products as forward's."""
    cfg = kda.cfg
    B, T, _ = x.shape
    conv_in, gate_in = project_qkvg(kda, x)
    g = kda.decay(x)
    beta = _padded_sigmoid(kda.b_proj(x))
    gate = torch.sigmoid(gate_in).view(B, T, cfg.num_heads, cfg.kda_head_dim)
    return conv_in, g, beta, gate


def _padded_sigmoid(x: Tensor, width: int = 64) -> Tensor:
    """sigmoid with each row padded to a multiple of `width` values: torch computes a tensor's
    tail past its last full SIMD vector with scalar code whose floats differ, so a narrow row
    (beta has one value per head) would get different bits alone than among other rows."""
    pad = (-x.shape[-1]) % width
    return torch.sigmoid(F.pad(x, (0, pad)))[..., :x.shape[-1]] if pad else torch.sigmoid(x)


def recur_rows(kda: KDA, state: KDAState, conv_in: Tensor, g: Tensor, beta: Tensor,
               inplace: bool = False) -> Tensor:
    """The per-sequence half: short convs, q/k norms and the step recurrence over T rows of the
    state's B sequences (one row each when B > 1: a decode pass); advances `state`; o [B, T, H, d].
    `inplace`: state.S is updated in place (nothing else may hold it)."""
    cfg = kda.cfg
    q, k, v, window = short_convs(kda, state.conv, conv_in)
    q = l2_norm(q, cfg.rms_norm_eps)
    k = l2_norm(k, cfg.rms_norm_eps)
    o, S = delta_rule(state.S, q, k, v, g, beta, inplace=inplace)
    state.S = detached(S)
    state.conv = detached(window)
    return o


def output_rows(kda: KDA, o: Tensor, gate: Tensor) -> Tensor:
    """The row-wise tail: o_proj(RMSNorm_d(o) * gate) for o, gate [B, T, H, d]."""
    B, T = o.shape[:2]
    o = gated_norm(o, kda.o_norm, kda.cfg.rms_norm_eps, gate)
    return kda.o_proj(o.reshape(B, T, -1))


def forward_wy(kda: KDA, x: Tensor, chunk: int | None = None) -> tuple[Tensor, KDARows | None]:
    """KDA.forward of a fresh sequence (no state kept) through `delta_rule_wy`: the same numbers
    up to float summation order, a fraction of the kernels. `chunk` defaults to `chunk_size`
    of the layer's gate; an unbounded gate has none and runs the reference forward."""
    cfg = kda.cfg
    C = chunk if chunk is not None else chunk_size(cfg.gate_lower_bound)
    if C is None:
        return KDA.forward(kda, x)
    B, T, _ = x.shape
    H, D = cfg.num_heads, cfg.kda_head_dim
    conv_in = (kda.q_proj(x), kda.k_proj(x), kda.v_proj(x))
    window = x.new_zeros(B, cfg.conv_kernel - 1, cfg.kda_dim)
    outs = [F.silu(causal_conv(window, xi, w)[0]).view(B, T, H, D)
            for xi, w in zip(conv_in, (kda.q_conv, kda.k_conv, kda.v_conv), strict=True)]
    q = l2_norm(outs[0], cfg.rms_norm_eps)
    k = l2_norm(outs[1], cfg.rms_norm_eps)
    g = kda.decay(x)
    beta = torch.sigmoid(kda.b_proj(x))
    S0 = x.new_zeros(B, H, D, D)
    o, _ = delta_rule_wy(S0, q, k, outs[2], g, beta, C)
    gate = torch.sigmoid(kda.g_proj(x)).view(B, T, H, D)
    o = gated_norm(o, kda.o_norm, cfg.rms_norm_eps, gate)
    return kda.o_proj(o.reshape(B, T, H * D)), None


def use_fast_kda(model: nn.Module) -> int:
    """Set `chunked` on every KDA module of `model` (stateless forwards take delta_rule_wy);
    returns how many were switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, KDA):
            m.chunked = True
            n += 1
    return n


def commit_rows(state: KDAState, rows: KDARows, n: int) -> None:
    """Apply the first `n` captured rows to `state` in place (the ReplaySSM commit)."""
    if not 0 <= n <= rows.n_rows:
        raise ValueError(f"cannot commit {n} of {rows.n_rows} captured rows")
    if n == 0:
        return
    if n == rows.n_rows and rows.final is not None:
        S = rows.final          # every row accepted: verify already ran exactly these steps
    else:
        S = state.S
        k, v, g, beta = rows.k[:, :n], rows.v[:, :n], rows.g[:, :n], rows.beta[:, :n]
        if native_steps(S, k, v, g, beta):      # the steps verify ran, without their outputs
            _, S = kda_step.rows(S, k, v, g, beta)
        else:
            for t in range(n):
                S = delta_step(S, k[:, t], v[:, t], g[:, t], beta[:, t])
    K1 = state.conv.shape[2]
    xx = torch.cat((state.conv, rows.conv_in[:, :n].transpose(1, 2)), dim=2)   # [B, 3, K-1+n, C]
    state.S = S
    state.conv = xx[:, :, xx.shape[2] - K1:].contiguous()
