"""MLA of K3: multi-head latent attention with no rotary part and a sigmoid output gate.

As llama.cpp's kimi-k3 runs it (build_mla_layer, absorbed "MQA" form):
  q        = W_qb RMSNorm(W_qa x)  (or W_q x), per head [nope | pe]
  [c | pe] = W_kva x;  c = RMSNorm(c)                 c is the cached latent (kv_lora wide)
  score    = ((W_kb^T q_nope) . c + q_pe . pe) / sqrt(nope + pe)    causal softmax
  out      = W_o[ (W_vb (softmax . c)) * sigmoid(W_gate x) ]
The "pe" parts are NOT rotated (mla_use_nope): they are a head-shared extra key slice.
W_kb / W_vb are the two halves of HF's kv_b_proj, per head.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from k3kit.layers.norm import rms_norm

from .config import K3ModelConfig
from .mxfp4 import ggml_input_round
from .state import MLACache


class MLA(nn.Module):
    def __init__(self, cfg: K3ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, E = cfg.num_heads, cfg.hidden_size
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(E, cfg.q_lora_rank, bias=False)
            self.q_a_norm = nn.Parameter(torch.ones(cfg.q_lora_rank))
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(E, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(E, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.Parameter(torch.ones(cfg.kv_lora_rank))
        # HF layout: [H * (nope + v), kv_lora], per head nope rows then v rows
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.g_proj = nn.Linear(E, H * cfg.v_head_dim, bias=False) if cfg.mla_output_gate else None
        self.o_proj = nn.Linear(H * cfg.v_head_dim, E, bias=False)
        # ggml-cpu input rounding of the products that are not one Linear ("k_b", "v_b",
        # "kv_b" -> "q8_0" / "f16" / ...), see K3Model.set_ggml_q8_inputs
        self.ggml_inputs: dict[str, str | None] = {}

    def forward(self, x: Tensor, cache: MLACache | None = None) -> Tensor:
        """x [B, T, hidden] (attn-normed). With `cache`, the new rows are appended and the
        queries see the cached rows before them."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, nope, pe_dim, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        eps = cfg.rms_norm_eps

        if cfg.q_lora_rank is not None:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_norm, eps))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]

        kv_pe = self.kv_a_proj(x)
        c = rms_norm(kv_pe[..., :L], self.kv_a_norm, eps)       # [B, T, L]
        k_pe = kv_pe[..., L:]                                    # [B, T, pe]

        if cache is not None:
            offset = cache.length
            cache.append(c, k_pe)
            c_all, pe_all = cache.view()
            if c.requires_grad:
                # the cache holds detached copies; keep this chunk's own rows differentiable
                c_all = torch.cat((c_all[:, :offset], c), dim=1)
                pe_all = torch.cat((pe_all[:, :offset], k_pe), dim=1)
        else:
            offset, c_all, pe_all = 0, c, k_pe

        w_kb, w_vb = head_weights(self)
        rnd = self.ggml_inputs
        if rnd.get("kv_b"):     # llama.cpp's unabsorbed path multiplies kv_b with the latent rows
            c_all = ggml_input_round(c_all, rnd["kv_b"])
        q_abs = absorb(ggml_input_round(q_nope, rnd.get("k_b")), w_kb)
        Q = torch.cat((q_abs, q_pe), dim=-1)                     # [B, T, H, L + pe]
        K = torch.cat((c_all, pe_all), dim=-1)                   # [B, S, L + pe]
        scores = torch.einsum("bthc,bsc->bhts", Q, K) * (1.0 / math.sqrt(nope + pe_dim))
        S = K.shape[1]
        rows = offset + torch.arange(T, device=x.device)
        allowed = torch.arange(S, device=x.device)[None, :] <= rows[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        lat = torch.einsum("bhts,bsl->bthl", probs, c_all)       # [B, T, H, L]
        lat = ggml_input_round(lat, rnd.get("v_b"))
        out = torch.einsum("bthl,hvl->bthv", lat, w_vb).reshape(B, T, H * cfg.v_head_dim)
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)


def project_rows(mla: MLA, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The row-wise half of MLA.forward (x [B, T, hidden]) for a pass over rows of several
    sequences: (q [B, T, H, nope + pe], latent c [B, T, L] (normed), k_pe [B, T, pe], the
    output gate's logits or None). Same products as forward's."""
    cfg = mla.cfg
    B, T, _ = x.shape
    if cfg.q_lora_rank is not None:
        q = mla.q_b_proj(rms_norm(mla.q_a_proj(x), mla.q_a_norm, cfg.rms_norm_eps))
    else:
        q = mla.q_proj(x)
    kv_pe = mla.kv_a_proj(x)
    c = rms_norm(kv_pe[..., :cfg.kv_lora_rank], mla.kv_a_norm, cfg.rms_norm_eps)
    gate = mla.g_proj(x) if mla.g_proj is not None else None
    return q.view(B, T, cfg.num_heads, cfg.qk_head_dim), c, kv_pe[..., cfg.kv_lora_rank:], gate


def head_weights(mla: MLA) -> tuple[Tensor, Tensor]:
    """kv_b's per-head halves as views: W_kb [H, nope, L] and W_vb [H, v, L]."""
    cfg = mla.cfg
    kv_b = mla.kv_b_proj.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return kv_b[:, :cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim:]


def _one_per_row(x: Tensor) -> bool:
    """Whether a [B, T, ...] operand takes the per-row products (no gradient, T == 1)."""
    return x.shape[1] == 1 and not torch.is_grad_enabled()


def absorb(q_nope: Tensor, w_kb: Tensor) -> Tensor:
    """W_kb^T q_nope per head: [B, T, H, nope] -> [B, T, H, L]. One-row operands (decode) go
    through `absorb_rows`, so a decoding row gets the same floats alone or batched with others
    (W_vb's product needs no such care: it runs per sequence, one row each, in both cases)."""
    if _one_per_row(q_nope):
        return absorb_rows(q_nope[:, 0], w_kb)[:, None]
    return torch.einsum("bthd,hdl->bthl", q_nope, w_kb)


def absorb_rows(x: Tensor, w_kb: Tensor) -> Tensor:
    """x [N, H, nope] (N rows, of any sequences) -> [N, H, L], each (row, head) its own 1-row
    product with W_kb[h] (the floats of the per-sequence einsum). For several rows, head by head:
    W_kb[h] (256 KiB on K3) is read once for all of them, where a GEMM over the rows would sum
    differently for different N, and a product per sequence reads all of W_kb (25 MB in float32
    on K3) for each row."""
    N, H, d = x.shape
    L = w_kb.shape[-1]
    if N == 1:
        return torch.bmm(x.transpose(0, 1), w_kb).transpose(0, 1)
    out = x.new_empty(H, N, 1, L)
    for h in range(H):
        torch.bmm(x[:, h, None, :], w_kb[h].expand(N, d, L), out=out[h])
    return out[:, :, 0].transpose(0, 1)


def attend_latent(mla: MLA, cache: MLACache, q_abs: Tensor, q_pe: Tensor, c: Tensor, k_pe: Tensor) -> Tensor:
    """One sequence's attention over its latents: append the rows' latents to `cache`, attend
    with the absorbed queries q_abs [B, T, H, L] (+ q_pe [B, T, H, pe]); the attended latents
    [B, T, H, L] (rounded as ggml rounds W_vb's input), before W_vb."""
    cfg = mla.cfg
    T = q_abs.shape[1]
    offset = cache.length
    cache.append(c, k_pe)
    c_all, pe_all = cache.view()
    rnd = mla.ggml_inputs
    if rnd.get("kv_b"):
        c_all = ggml_input_round(c_all, rnd["kv_b"])
    Q = torch.cat((q_abs, q_pe), dim=-1)
    K = torch.cat((c_all, pe_all), dim=-1)
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    scores = torch.einsum("bthc,bsc->bhts", Q, K) * scale
    rows = offset + torch.arange(T, device=q_abs.device)
    allowed = torch.arange(K.shape[1], device=q_abs.device)[None, :] <= rows[:, None]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return ggml_input_round(torch.einsum("bhts,bsl->bthl", probs, c_all), rnd.get("v_b"))


def attend_rows(mla: MLA, cache: MLACache, q: Tensor, c: Tensor, k_pe: Tensor) -> Tensor:
    """The per-sequence half: append the rows' latents to `cache` and attend over it; the
    value-projected heads [B, T, H * v] (before the gate and W_o)."""
    cfg = mla.cfg
    B, T = q.shape[:2]
    nope = cfg.qk_nope_head_dim
    w_kb, w_vb = head_weights(mla)
    q_abs = absorb(ggml_input_round(q[..., :nope], mla.ggml_inputs.get("k_b")), w_kb)
    lat = attend_latent(mla, cache, q_abs, q[..., nope:], c, k_pe)
    return torch.einsum("bthl,hvl->bthv", lat, w_vb).reshape(B, T, cfg.num_heads * cfg.v_head_dim)


def output_rows(mla: MLA, out: Tensor, gate: Tensor | None) -> Tensor:
    """The row-wise tail: W_o(out * sigmoid(gate))."""
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return mla.o_proj(out)
