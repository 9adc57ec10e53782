"""The DFlash / DSpark draft network (torch).

A draft is a few transformer layers that denoise a block [anchor, MASK x (B-1)] in one forward.
It has no embedding and no LM head of its own: it borrows the target's (passed in, not owned),
and it sees the target through "context features": the hidden states of a few tapped target
layers, concatenated, projected by `fc` and normalised by `hidden_norm`. In every layer those
projected rows become extra K/V rows (K normalised by the layer's k_norm and roped at the
position of the token they came from, V as is); queries come only from the block, and the
block attends to all context rows and to itself bidirectionally.

DSpark adds two small heads on top of DFlash:
  * Markov:     logits_k += W2 . W1[x_{k-1}], chained left to right from the anchor;
  * confidence: c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b), h_k the final-normed hidden row.

Every hidden row is a proposal ("sample from anchor"): row k predicts the token after x_{k-1},
so B rows give B proposals and the target verifies B+1 rows (anchor + proposals).

Parameter names are the HF checkpoint names without the leading "model." (names.py maps them
onto llama.cpp's `dflash` tensors). Norms are HF's RMSNorm order and rope is NeoX with YaRN
(k3kit.layers), as the interop tests against llama.cpp's dflash graph expect. The stateful
drafter over the runtime's feature ring is k3kit.adapters.dflash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3kit.errors import ConvertError
from k3kit.layers.norm import RMSNorm
from k3kit.layers.rope import YARN_BETA_FAST, YARN_BETA_SLOW, apply_rope, inv_freq, yarn_magnitude

from .config import DraftConfig
from .names import BORROWED, gguf_tensor_name


def rope_inv_freq(cfg: DraftConfig) -> tuple[Tensor, float]:
    """Inverse frequencies (float64) and the cos/sin magnitude, YaRN-blended when configured."""
    dim = cfg.rope_dim or cfg.head_dim
    ys = cfg.rope_scaling
    if ys is None:
        return inv_freq(dim, cfg.rope_theta), 1.0
    inv = inv_freq(dim, cfg.rope_theta, factor=ys.factor,
                   original_context=ys.original_max_position_embeddings,
                   beta_fast=YARN_BETA_FAST if ys.beta_fast is None else ys.beta_fast,
                   beta_slow=YARN_BETA_SLOW if ys.beta_slow is None else ys.beta_slow, truncate=ys.truncate)
    return inv, yarn_magnitude(ys.factor, mscale=ys.mscale, mscale_all_dim=ys.mscale_all_dim,
                               attention_factor=ys.attention_factor)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, style="hf")
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, style="hf")

    def kv(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, float]) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.nkv, self.hd))
        v = self.v_proj(x).view(n, self.nkv, self.hd)
        return apply_rope(k, pos, *rope), v

    def forward(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, float],
                ctx: tuple[Tensor, Tensor] | None) -> Tensor:
        n = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(n, self.nh, self.hd)), pos, *rope)
        k, v = self.kv(x, pos, rope)
        if ctx is not None and ctx[0].shape[0]:
            k = torch.cat([ctx[0].to(k.dtype), k], 0)
            v = torch.cat([ctx[1].to(v.dtype), v], 0)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        # no mask: the block sees every context row and every other block row
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.o_proj(o.transpose(0, 1).reshape(n, self.nh * self.hd))

    def forward_batch(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, float],
                      ctxs: Sequence[tuple[Tensor, Tensor] | None]) -> Tensor:
        """`forward` for N blocks at once: x [N, B, H], pos [N, B], block i attending to ctxs[i].
        Projections and rope run on all rows together, attention per block (contexts differ in length)."""
        nb, b = x.shape[:2]
        flat = pos.reshape(-1)
        q = self.q_norm(rows_linear(x, self.q_proj).view(nb * b, self.nh, self.hd))
        q = apply_rope(q, flat, *rope).view(nb, b, self.nh, self.hd)
        k = self.k_norm(rows_linear(x, self.k_proj).view(nb * b, self.nkv, self.hd))
        k = apply_rope(k, flat, *rope).view(nb, b, self.nkv, self.hd)
        v = rows_linear(x, self.v_proj).view(nb, b, self.nkv, self.hd)
        rep = self.nh // self.nkv
        outs = []
        for i, ctx in enumerate(ctxs):
            ki, vi = k[i], v[i]
            if ctx is not None and ctx[0].shape[0]:
                ki = torch.cat([ctx[0].to(ki.dtype), ki], 0)
                vi = torch.cat([ctx[1].to(vi.dtype), vi], 0)
            ki = ki.repeat_interleave(rep, dim=1)
            vi = vi.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q[i].transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(b, self.nh * self.hd))
        return rows_linear(torch.stack(outs), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_batch(self, x: Tensor) -> Tensor:
        """x [N, B, H]: each block's rows as `forward` gives them alone."""
        h = F.silu(rows_linear(x, self.gate_proj)) * rows_linear(x, self.up_proj)
        return rows_linear(h, self.down_proj)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, style="hf")
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, style="hf")
        self.mlp = MLP(cfg)

    def forward(self, x, pos, rope, ctx):
        x = x + self.self_attn(self.input_layernorm(x), pos, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_batch(self, x, pos, rope, ctxs):
        x = x + self.self_attn.forward_batch(self.input_layernorm(x), pos, rope, ctxs)
        return x + self.mlp.forward_batch(self.post_attention_layernorm(x))


def rows_linear(x: Tensor, lin: nn.Linear) -> Tensor:
    """A bias-free nn.Linear on N blocks x [N, B, in] -> [N, B, out], each block its own product.

    Each block must come out bit for bit as `forward` computes it alone (one F.linear of its B
    rows): a sequence's proposals, and so a seeded sampled request's text, must not depend on who
    else drafts in the same pass (tests/runtime/test_spec_batch.py). torch's CPU GEMM does not
    promise that for a block inside a larger product, nor inside a batched bmm: on an AMD Zen 4
    (MKL) one GEMM over all rows matched per block for B >= 2, on an Intel Xeon with AMX (same
    torch and MKL) neither the one GEMM nor bmm does. So one call per block, the same call the
    serial path makes; what is batched across sequences is the rest of the forward."""
    w = lin.weight
    if x.shape[0] == 1:
        return F.linear(x[0], w).unsqueeze(0)
    return torch.stack([F.linear(xi, w) for xi in x.unbind(0)])


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)


# ----------------------------------------------------------------------------- the draft

Embed = Tensor | Callable[[Tensor], Tensor]
Head = Tensor | Callable[[Tensor], Tensor]


class DSparkDraft(nn.Module):
    """The draft network. `embed` and `lm_head` belong to the target and are not parameters.

    embed:   [V, H] table or ids -> [n, H];   lm_head: [V, H] matrix or hidden [n, H] -> [n, V].
    The weights live on one device (`place`); the borrowed pieces may live on another (a drafter
    on its own GPU): embedding rows and context features are moved to the weights' device, a head
    given as a matrix gets the hidden rows on its device, a head given as a function moves them itself.
    """

    def __init__(self, cfg: DraftConfig, embed: Embed | None = None, lm_head: Head | None = None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.n_taps * cfg.tap_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, style="hf")
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, style="hf")
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank) if cfg.markov_rank else None
        self.confidence_head = (
            ConfidenceHead(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0))
            if cfg.has_confidence else None
        )
        inv, mag = rope_inv_freq(cfg)
        self.rope_inv_freq = inv          # float64, deliberately not a buffer: .half() must not touch it
        self.rope_mag = mag
        self._embed = embed
        self._head = lm_head

    def set_target(self, embed: Embed, lm_head: Head) -> None:
        self._embed, self._head = embed, lm_head

    def place(self, device: torch.device | str) -> DSparkDraft:
        """Move the weights to `device`, the rope frequencies with them (a plain attribute, so
        that `.to(dtype)` leaves them float64, and `.to(device)` would leave them behind)."""
        self.to(device)
        self.rope_inv_freq = self.rope_inv_freq.to(device)
        return self

    # -- weights from a GGUF
    @torch.no_grad()
    def load_gguf_tensors(self, tensors: Mapping[str, object], source: str = "draft.gguf") -> None:
        """Fill every parameter from float arrays keyed by llama.cpp dflash name, in numpy
        (row-major) shape = torch shape = reversed ggml shape. Missing, misshapen or unknown
        tensors are errors: a draft that silently keeps random weights proposes garbage; the
        target's embedding and LM head (names.BORROWED) are accepted and ignored."""
        names = {gguf_tensor_name(n): p for n, p in self.named_parameters()}
        unknown = sorted(set(tensors) - set(names) - BORROWED)
        if unknown:
            raise ConvertError(f"{source}: tensors this draft does not have: {', '.join(unknown[:5])}")
        for gname, p in names.items():
            if gname not in tensors:
                raise ConvertError(f"{source}: missing tensor {gname!r}")
            t = torch.as_tensor(tensors[gname])
            if tuple(t.shape) != tuple(p.shape):
                raise ConvertError(f"{source}: tensor {gname!r} has shape {tuple(reversed(t.shape))} "
                                   f"(ggml order), expected {tuple(reversed(p.shape))}")
            p.copy_(t.to(p.dtype))

    # -- borrowed pieces
    def embed(self, ids: Tensor) -> Tensor:
        if self._embed is None:
            raise RuntimeError("DSparkDraft has no target embedding; call set_target()")
        if isinstance(self._embed, Tensor):
            e = F.embedding(ids.to(self._embed.device), self._embed)
        else:
            e = self._embed(ids)
        e = e.to(self.fc.weight.device, self.fc.weight.dtype)     # the target's rows, maybe another device
        return e if self.cfg.embedding_scale is None else e * self.cfg.embedding_scale

    def logits(self, hidden: Tensor) -> Tensor:
        """Base draft logits through the target's LM head (before the Markov bias)."""
        if self._head is None:
            raise RuntimeError("DSparkDraft has no target LM head; call set_target()")
        if isinstance(self._head, Tensor):
            logits = hidden.to(self._head.device, self._head.dtype) @ self._head.T
        else:
            logits = self._head(hidden)
        if self.cfg.logit_scale is not None:
            logits = logits * self.cfg.logit_scale
        cap = self.cfg.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- context
    def project_context(self, taps: Tensor) -> Tensor:
        """Concatenated tap features [n, n_taps*H_target] -> fused context rows [n, H]."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.device, self.fc.weight.dtype)))

    def context_kv(self, taps: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer (K, V) of context rows at their own positions; they do not depend on the block."""
        g = self.project_context(taps)
        rope = (self.rope_inv_freq, self.rope_mag)
        positions = positions.to(self.rope_inv_freq.device)
        return [cast(DraftLayer, layer).self_attn.kv(g, positions, rope) for layer in self.layers]

    # -- block
    def forward(self, block_ids: Tensor, positions: Tensor,
                ctx_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """Block token ids [B] at positions [B] -> final-normed hidden rows [B, H]."""
        x = self.embed(block_ids)
        rope = (self.rope_inv_freq, self.rope_mag)
        positions = positions.to(self.rope_inv_freq.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, rope, None if ctx_kv is None else ctx_kv[i])
        return self.norm(x)

    def forward_batch(self, block_ids: Tensor, positions: Tensor,
                      ctx_kvs: Sequence[list[tuple[Tensor, Tensor]] | None]) -> Tensor:
        """N blocks [N, B] of ids at positions [N, B], block i over its own context ctx_kvs[i]
        -> hidden rows [N, B, H], each block's equal to `forward` of it alone (see rows_linear)."""
        nb, b = block_ids.shape
        x = self.embed(block_ids.reshape(-1)).view(nb, b, -1)
        rope = (self.rope_inv_freq, self.rope_mag)
        positions = positions.to(self.rope_inv_freq.device)
        for i, layer in enumerate(self.layers):
            ctxs = [None if kv is None else kv[i] for kv in ctx_kvs]
            x = cast(DraftLayer, layer).forward_batch(x, positions, rope, ctxs)
        return self.norm(x)

    # -- DSpark heads
    def markov_embed(self, prev: Tensor) -> Tensor:
        """W1[x_prev] rows [n, r]."""
        if self.markov_head is None:
            raise RuntimeError("this draft has no Markov head")
        return self.markov_head.markov_w1(prev)

    def markov_bias(self, w1_prev: Tensor) -> Tensor:
        """W2 . W1[x_prev] -> [n, V], added to the base logits of the row."""
        if self.markov_head is None:
            raise RuntimeError("this draft has no Markov head")
        return self.markov_head.markov_w2(w1_prev)

    def confidence(self, hidden: Tensor, w1_prev: Tensor | None) -> Tensor:
        """c = sigmoid(w . [h ; W1[x_prev]] + b) -> [n]: the chance that this proposal is accepted
        given that every proposal before it was (the head was trained on prefix acceptance)."""
        if self.confidence_head is None:
            raise RuntimeError("this draft has no confidence head")
        feat = hidden
        if self.cfg.confidence_with_markov:
            if w1_prev is None:
                raise RuntimeError("this confidence head reads [h ; W1[x_prev]]: pass w1_prev")
            feat = torch.cat([hidden, w1_prev.to(hidden.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_head.proj(feat)).squeeze(-1)
