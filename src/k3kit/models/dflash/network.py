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
from k3kit.kernels import fused as kfused
from k3kit.layers.norm import RMSNorm, Style
from k3kit.layers.quantized_linear import QuantizedLinear, fused_products
from k3kit.layers.rope import YARN_BETA_FAST, YARN_BETA_SLOW, RopeTable, inv_freq, rope_table, yarn_magnitude

from .config import DraftConfig
from .names import BORROWED, gguf_tensor_name

# Positions whose rope table a draft keeps (see DSparkDraft.rope): 256 KiB of float32 at head_dim 64
ROPE_WINDOW = 4096


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


Rope = tuple[Tensor, float] | RopeTable


def _table(rope: Rope, pos: Tensor, dtype: torch.dtype) -> RopeTable:
    """The cos/sin table of `pos`: given (made once per pass), or made from (inv_freq, magnitude)."""
    return rope if isinstance(rope, RopeTable) else rope_table(pos, rope[0], rope[1], dtype)


class ContextRows(tuple):
    """A layer's context (K, V) rows, as a plain pair reads them, with the owner's `join`: it
    writes a block's rows after the context's in the owner's storage (room kept past the
    context) and returns [context ; block] K and V, so attention reads them without a copy of
    the context each draft step."""

    join: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def _join(ctx: tuple[Tensor, Tensor] | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """[context rows ; block rows] of K and V."""
    if ctx is None or not ctx[0].shape[0]:
        return k, v
    if isinstance(ctx, ContextRows) and ctx[0].dtype == k.dtype:
        return ctx.join(k, v)
    return torch.cat([ctx[0].to(k.dtype), k], 0), torch.cat([ctx[1].to(v.dtype), v], 0)


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

    def kv(self, x: Tensor, pos: Tensor, rope: Rope) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        fused = fused_products((self.k_proj, self.v_proj), x)
        k, v = (self.k_proj(x), self.v_proj(x)) if fused is None else (fused[0], fused[1])
        k = self.k_norm(k.view(n, self.nkv, self.hd))
        return _table(rope, pos, k.dtype).apply(k), v.view(n, self.nkv, self.hd)

    def qkv(self, x: Tensor, pos: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        """Roped q [n, nh, hd], roped k and v [n, nkv, hd] of rows x [n, H]: one native product
        for the three where the weights allow (k3kit.layers.quantized_linear.fused_products)."""
        n = x.shape[0]
        fused = fused_products((self.q_proj, self.k_proj, self.v_proj), x)
        if fused is None:
            q, (k, v) = self.q_proj(x), self.kv(x, pos, rope)
            return _table(rope, pos, q.dtype).apply(self.q_norm(q.view(n, self.nh, self.hd))), k, v
        table = _table(rope, pos, x.dtype)
        if self.nh == self.nkv:           # the three as views of one [3, n, heads, hd]: two ops, not six
            q, k, v = fused.view(3, n, self.nh, self.hd).unbind(0)
        else:
            q, k, v = (fused[0].view(n, self.nh, self.hd), fused[1].view(n, self.nkv, self.hd),
                       fused[2].view(n, self.nkv, self.hd))
        return table.apply(self.q_norm(q)), table.apply(self.k_norm(k)), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [n, nh, hd] over k, v [m, nkv, hd], no mask -> [n, nh * hd].

        softmax(q K^T * scale) V as ggml's graph computes it (the scale on the scores), in two
        batched products over the heads that read K and V where they are: torch's CPU
        scaled_dot_product_attention scales a copy of all of K instead, which over a context of
        a thousand rows cost more than the products (a draft step at 1k rows: 2.9 ms)."""
        n = q.shape[0]
        qh = q.transpose(0, 1)                                       # [nh, n, hd]
        if self.nh != self.nkv:              # grouped heads: each kv head serves nh / nkv queries
            g = self.nh // self.nkv
            qh = qh.reshape(self.nkv, g * n, self.hd)
        scores = torch.bmm(qh, k.permute(1, 2, 0)).mul_(self.hd ** -0.5)   # [nkv, g*n, m]
        o = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))     # [nkv, g*n, hd]
        return o.view(self.nh, n, self.hd).transpose(0, 1).reshape(n, self.nh * self.hd)

    def forward(self, x: Tensor, pos: Tensor, rope: Rope, ctx: tuple[Tensor, Tensor] | None) -> Tensor:
        q, k, v = self.qkv(x, pos, rope)
        k, v = _join(ctx, k, v)
        # no mask: the block sees every context row and every other block row
        return self.o_proj(self.attend(q, k, v))

    def forward_batch(self, x: Tensor, pos: Tensor, rope: Rope,
                      ctxs: Sequence[tuple[Tensor, Tensor] | None]) -> Tensor:
        """`forward` for N blocks at once: x [N, B, H], pos [N, B], block i attending to ctxs[i].
        Projections and rope run on all rows together, attention per block (contexts differ in length)."""
        nb, b = x.shape[:2]
        if rows_invariant(self.q_proj, nb * b) and rows_invariant(self.k_proj, nb * b) \
                and rows_invariant(self.v_proj, nb * b):
            q, k, v = self.qkv(x.reshape(nb * b, -1), pos.reshape(-1), rope)
        else:
            flat = pos.reshape(-1)
            table = _table(rope, flat, x.dtype)
            q = table.apply(self.q_norm(rows_linear(x, self.q_proj).view(nb * b, self.nh, self.hd)))
            k = table.apply(self.k_norm(rows_linear(x, self.k_proj).view(nb * b, self.nkv, self.hd)))
            v = rows_linear(x, self.v_proj).view(nb * b, self.nkv, self.hd)
        q = q.view(nb, b, self.nh, self.hd)
        k, v = k.view(nb, b, self.nkv, self.hd), v.view(nb, b, self.nkv, self.hd)
        outs = [self.attend(q[i], *_join(ctx, k[i], v[i])) for i, ctx in enumerate(ctxs)]
        return rows_linear(torch.stack(outs), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gu = fused_products((self.gate_proj, self.up_proj), x)
        if gu is not None:      # one native product for both; the same bits as two
            g, u = gu.unbind(0)
            return self.down_proj(F.silu(g).mul_(u).view(*x.shape[:-1], -1))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_batch(self, x: Tensor) -> Tensor:
        """x [N, B, H]: each block's rows as `forward` gives them alone."""
        rows = x.shape[0] * x.shape[1]
        if all(rows_invariant(m, rows) for m in (self.gate_proj, self.up_proj, self.down_proj)):
            return self.forward(x)
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


def rows_invariant(lin: nn.Module, rows: int) -> bool:
    """Whether one call of `lin` on `rows` rows gives each row the bits it gets alone: a
    QuantizedLinear within its invariant rows (the native kernels), never torch's GEMM."""
    return isinstance(lin, QuantizedLinear) and not torch.is_grad_enabled() and lin.invariant_rows >= rows


def rows_linear(x: Tensor, lin: nn.Module) -> Tensor:
    """A bias-free linear on N blocks x [N, B, in] -> [N, B, out], each block its own product.

    Each block must come out bit for bit as `forward` computes it alone (one product of its B
    rows): a sequence's proposals, and so a seeded sampled request's text, must not depend on who
    else drafts in the same pass (tests/runtime/test_spec_batch.py). The native kernels over a
    GGUF's bytes promise that for any rows up to their limit (`rows_invariant`): one call. torch's
    CPU GEMM does not promise it for a block inside a larger product, nor inside a batched bmm: on
    an AMD Zen 4 (MKL) one GEMM over all rows matched per block for B >= 2, on an Intel Xeon with
    AMX (same torch and MKL) neither the one GEMM nor bmm does. So there, one call per block, the
    same call the serial path makes; what is batched across sequences is the rest of the forward."""
    if rows_invariant(lin, x.shape[0] * x.shape[1]):
        return lin(x)
    if x.shape[0] == 1:
        return lin(x[0]).unsqueeze(0)
    return torch.stack([lin(xi) for xi in x.unbind(0)])


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        # nn.Embedding's own initialisation goes through torch.nn.init, whose first call imports
        # torch._dynamo (1.5 s of loading a drafter); Tensor.normal_ is the same draw without it
        table = torch.empty(vocab, rank)
        if not table.is_meta:
            with torch.no_grad():
                table.normal_()
        self.markov_w1 = nn.Embedding(vocab, rank, _weight=table)
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
        self._w2t: tuple[tuple, Tensor] | None = None
        self._mask_rows: tuple[tuple, Tensor] | None = None     # (embedding and shape, rows)
        # (first position, dtype, table): see rope()
        self._rope_window: tuple[int, torch.dtype, RopeTable] | None = None

    @property
    def device(self) -> torch.device:
        """Where the weights are (a norm's weight says: a matrix may be a QuantizedLinear's bytes)."""
        return self.hidden_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the float parameters' (quantized matrices compute in it)."""
        return self.hidden_norm.weight.dtype

    def set_target(self, embed: Embed, lm_head: Head) -> None:
        self._embed, self._head = embed, lm_head
        self._mask_rows = None

    def place(self, device: torch.device | str) -> DSparkDraft:
        """Move the weights to `device`, the rope frequencies with them (a plain attribute, so
        that `.to(dtype)` leaves them float64, and `.to(device)` would leave them behind)."""
        self.to(device)
        self.rope_inv_freq = self.rope_inv_freq.to(device)
        self._mask_rows = self._rope_window = self._w2t = None
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
    def block_embed(self, anchors: Sequence[int], b: int) -> Tensor:
        """Embedded blocks [N, b, H]: each anchor's row, then b - 1 mask rows. The mask rows are
        the same in every block: looked up once per target embedding and kept."""
        x = self.embed(torch.tensor([int(a) for a in anchors], dtype=torch.long))
        key = (id(self._embed), b, x.device, x.dtype)
        if self._mask_rows is None or self._mask_rows[0] != key:
            mask = self.embed(torch.full((b - 1,), self.cfg.mask_token_id, dtype=torch.long))
            self._mask_rows = (key, mask)
        mask = self._mask_rows[1]
        return torch.cat([x[:, None, :], mask[None].expand(len(anchors), *mask.shape)], dim=1)

    def embed(self, ids: Tensor) -> Tensor:
        if self._embed is None:
            raise RuntimeError("DSparkDraft has no target embedding; call set_target()")
        if isinstance(self._embed, Tensor):
            e = F.embedding(ids.to(self._embed.device), self._embed)
        else:
            e = self._embed(ids)
        e = e.to(self.device, self.dtype)     # the target's rows, maybe another device
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

    def rope(self, positions: Tensor, dtype: torch.dtype, span: tuple[int, int] | None = None,
             contiguous: bool = False) -> RopeTable:
        """The cos/sin table of `positions` [n], made once for every layer of a pass.

        `span` (lo, hi): the caller knows that lo <= positions < hi; `contiguous`: that positions
        is that range, in order. Rows are then read from a table of ROPE_WINDOW positions kept
        across passes (remade when a span leaves it), two views or lookups instead of the eight
        ops that make a table; the values are those ops' on each position."""
        dev = self.rope_inv_freq.device
        if span is None:
            return rope_table(positions.to(dev), self.rope_inv_freq, self.rope_mag, dtype)
        lo, hi = span
        w = self._rope_window
        if w is None or w[1] != dtype or w[2].cos.device != dev or lo < w[0] or hi > w[0] + w[2].cos.shape[0]:
            n = max(ROPE_WINDOW, 2 * (hi - lo))
            w = self._rope_window = (lo, dtype, rope_table(torch.arange(lo, lo + n, device=dev),
                                                           self.rope_inv_freq, self.rope_mag, dtype))
        start, _, t = w
        if contiguous:
            return RopeTable(t.cos[lo - start:hi - start], t.sin[lo - start:hi - start])
        idx = positions.to(dev) - start
        return RopeTable(t.cos.index_select(0, idx), t.sin.index_select(0, idx))

    def use_norms(self, style: Style) -> None:
        """Every RMSNorm in `style`: "ggml" (llama.cpp's dflash graph's order, one native call per
        norm in inference) for a draft read from a GGUF, "hf" (transformers') as trained."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.style = style

    # -- context
    def project_context(self, taps: Tensor) -> Tensor:
        """Concatenated tap features [n, n_taps*H_target] -> fused context rows [n, H]."""
        return self.hidden_norm(self.fc(taps.to(self.device, self.dtype)))

    def context_kv(self, taps: Tensor, positions: Tensor,
                   span: tuple[int, int] | None = None) -> list[tuple[Tensor, Tensor]]:
        """Per-layer (K, V) of context rows at their own positions; they do not depend on the block.
        `span` (lo, hi): the positions are that range, in order (see `rope`)."""
        g = self.project_context(taps)
        rope = self.rope(positions, g.dtype, span, contiguous=span is not None)
        return [cast(DraftLayer, layer).self_attn.kv(g, positions, rope) for layer in self.layers]

    # -- block
    def forward(self, block_ids: Tensor | None, positions: Tensor,
                ctx_kv: list[tuple[Tensor, Tensor]] | None = None, *, span: tuple[int, int] | None = None,
                x: Tensor | None = None) -> Tensor:
        """Block token ids [B] at positions [B] -> final-normed hidden rows [B, H]. `span` (lo, hi):
        the positions are that range, in order (see `rope`); `x`: the block's embedded rows, when
        the caller has them."""
        if x is None:
            if block_ids is None:
                raise ValueError("forward needs block_ids or their embedded rows x")
            x = self.embed(block_ids)
        positions = positions.to(self.rope_inv_freq.device)
        rope = self.rope(positions, x.dtype, span, contiguous=span is not None)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, rope, None if ctx_kv is None else ctx_kv[i])
        return self.norm(x)

    def forward_batch(self, block_ids: Tensor | None, positions: Tensor,
                      ctx_kvs: Sequence[list[tuple[Tensor, Tensor]] | None], *,
                      span: tuple[int, int] | None = None, x: Tensor | None = None) -> Tensor:
        """N blocks [N, B] of ids at positions [N, B], block i over its own context ctx_kvs[i]
        -> hidden rows [N, B, H], each block's equal to `forward` of it alone (see rows_linear).
        `span` (lo, hi): bounds of all the positions (see `rope`); `x` [N, B, H]: the embedded rows."""
        nb, b = positions.shape
        if x is None:
            if block_ids is None:
                raise ValueError("forward_batch needs block_ids or their embedded rows x")
            x = self.embed(block_ids.reshape(-1)).view(nb, b, -1)
        positions = positions.to(self.rope_inv_freq.device)
        rope = self.rope(positions.reshape(-1), x.dtype, span)
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

    def markov_greedy(self, base: Tensor, anchor: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """The greedy Markov chain over a block's base logits [n, V] from `anchor` in one native
        call -> (tokens [n], corrected rows [n, V], W1 rows [n, r]), or None where it cannot run
        (quantized or bfloat16 Markov weights, a GPU: the caller chains with markov_embed/bias)."""
        weights = self._markov_weights()
        return None if weights is None else kfused.markov_greedy(base, weights[0], weights[1], anchor)

    def markov_masked(self, base: Tensor, prev: int, bits: Tensor) -> tuple[int, Tensor, Tensor] | None:
        """One row of `markov_greedy`'s chain after `prev` whose token is the best one a grammar's
        bitmask bits [W] allows -> (token, corrected row [V], W1 row [r]), or None (as there)."""
        weights = self._markov_weights()
        return None if weights is None else kfused.markov_masked(base, weights[0], weights[1], prev, bits)

    def _markov_weights(self) -> tuple[Tensor, Tensor] | None:
        """W1 and W2 transposed (made once per weights) for the native chain, or None."""
        head = self.markov_head
        if head is None or not isinstance(head.markov_w1, nn.Embedding) \
                or not isinstance(head.markov_w2, nn.Linear):
            return None
        w2 = head.markov_w2.weight
        key = (w2.data_ptr(), w2._version, w2.device, w2.dtype)
        if self._w2t is None or self._w2t[0] != key:         # W2 transposed, made once per weights
            self._w2t = (key, w2.detach().t().contiguous())
        return head.markov_w1.weight, self._w2t[1]

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
