"""The DSpark draft forward and loss over many blocks at once (training only).

`DSparkDraft.forward` runs one block against one context, as the runtime needs. Training wants
hundreds of blocks per step, each anchored somewhere in a sequence whose tap features are all
known: block n (anchor at position t_n of sequence s_n) may see the context rows of s_n at
positions < t_n (what the runtime's feature ring holds when that anchor is drafted: the anchor
itself is not committed yet) plus its own rows, bidirectionally. Here every sequence's context
K/V is projected once per layer and each block attends to its sequence's rows under a
boolean mask, with the draft's own modules, so the math is `DSparkDraft.forward`'s (a test
checks block by block).

Loss (DFlash / DSpark): cross-entropy of every block row against the target's greedy token
for that position, rows weighted by exp(-k / decay) because a proposal only counts when all
before it were accepted; the Markov head is teacher-forced (row k gets W2 . W1[label_{k-1}],
row 0 the anchor); the confidence head learns, by binary cross-entropy, whether the row's
argmax equals its label, i.e. whether proposal k survives given that the prefix did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from k3kit.layers.rope import apply_rope
from k3kit.models.dflash.network import DraftLayer, DSparkDraft


def _rope(draft: DSparkDraft) -> tuple[Tensor, float]:
    return draft.rope_inv_freq, draft.rope_mag


def _layers(draft: DSparkDraft) -> Iterable[DraftLayer]:
    return cast(Iterable[DraftLayer], draft.layers)


def context_kv(draft: DSparkDraft, taps: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Tap features [S, T, F] of S sequences -> per layer (K, V), each [S, T, kv_heads, head_dim],
    row j roped at position j."""
    S, T, _ = taps.shape
    g = draft.project_context(taps).reshape(S * T, -1)
    pos = torch.arange(T).repeat(S)
    out = []
    for layer in _layers(draft):
        k, v = layer.self_attn.kv(g, pos, _rope(draft))
        out.append((k.view(S, T, *k.shape[1:]), v.view(S, T, *v.shape[1:])))
    return out


def block_hidden(draft: DSparkDraft, block_ids: Tensor, anchor_pos: Tensor, seq_index: Tensor,
                 ctx: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Blocks [N, B] (anchor then masks) at anchor_pos[n] .. +B-1, block n attending to the context
    rows of sequence seq_index[n] before anchor_pos[n] -> final-normed hidden rows [N, B, H]."""
    N, B = block_ids.shape
    pos = (anchor_pos[:, None] + torch.arange(B)[None, :]).reshape(-1)
    T = ctx[0][0].shape[1]
    visible = torch.cat([torch.arange(T)[None, :] < anchor_pos[:, None],
                         torch.ones(N, B, dtype=torch.bool)], dim=1)[:, None, None, :]   # [N,1,1,T+B]
    rope = _rope(draft)
    x = draft.embed(block_ids)
    for layer, (ck, cv) in zip(_layers(draft), ctx, strict=True):
        att = layer.self_attn
        h = layer.input_layernorm(x).reshape(N * B, -1)
        q = apply_rope(att.q_norm(att.q_proj(h).view(N * B, att.nh, att.hd)), pos, *rope)
        k, v = att.kv(h, pos, rope)
        k = torch.cat([ck[seq_index], k.view(N, B, att.nkv, att.hd)], dim=1)
        v = torch.cat([cv[seq_index], v.view(N, B, att.nkv, att.hd)], dim=1)
        rep = att.nh // att.nkv
        k = k.repeat_interleave(rep, dim=2).transpose(1, 2)          # [N, nh, T+B, hd]
        v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
        q = q.view(N, B, att.nh, att.hd).transpose(1, 2)               # [N, nh, B, hd]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        x = x + att.o_proj(o.transpose(1, 2).reshape(N, B, att.nh * att.hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x)


@dataclass
class BlockLoss:
    loss: Tensor               # the training objective (CE + conf_coef * BCE)
    ce: Tensor                 # position-weighted cross-entropy
    conf_bce: Tensor           # confidence-head BCE (0 without the head)
    correct: Tensor            # [N, B] bool: row argmax (Markov-corrected) == label
    conf: Tensor | None        # [N, B] confidence, detached


def position_weights(block: int, decay: float) -> Tensor:
    w = torch.exp(-torch.arange(block, dtype=torch.float32) / decay)
    return w / w.sum()


def block_loss(draft: DSparkDraft, block_ids: Tensor, labels: Tensor, anchor_pos: Tensor,
               seq_index: Tensor, ctx: list[tuple[Tensor, Tensor]], *, decay: float = 4.0,
               conf_coef: float = 0.1, allowed: Tensor | None = None) -> BlockLoss:
    """labels [N, B]: the target's greedy token after each block row (row k predicts position
    anchor + k + 1). See the module docstring for the terms. `allowed` [N, B, V] bool: the tokens a
    grammar lets each row take (structured output): the runtime masks the draft's rows the same
    way, so the loss and the accuracy are over those tokens only."""
    N, B = labels.shape
    hidden = block_hidden(draft, block_ids, anchor_pos, seq_index, ctx)
    logits = draft.logits(hidden).float()
    w1 = None
    if draft.markov_head is not None:
        prev = torch.cat([block_ids[:, :1], labels[:, :-1]], dim=1)
        w1 = draft.markov_embed(prev)
        logits = logits + draft.markov_bias(w1).float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    ce_rows = F.cross_entropy(logits.reshape(N * B, -1), labels.reshape(-1), reduction="none").view(N, B)
    ce = (ce_rows * position_weights(B, decay)[None, :]).sum(1).mean()
    correct = logits.argmax(-1) == labels
    conf, bce = None, ce.new_zeros(())
    if draft.confidence_head is not None:
        feat = hidden.detach()
        if draft.cfg.confidence_with_markov:
            feat = torch.cat([feat, cast(Tensor, w1).detach().to(feat.dtype)], dim=-1)
        z = draft.confidence_head.proj(feat).squeeze(-1).float()
        bce = F.binary_cross_entropy_with_logits(z, correct.float())
        conf = torch.sigmoid(z).detach()
    return BlockLoss(ce + conf_coef * bce, ce.detach(), bce.detach(), correct, conf)


def prefix_run(correct: Tensor) -> Tensor:
    """[N, B] per-row correctness -> [N] leading run of correct rows (proposals a greedy
    verify would accept if the target saw exactly these blocks)."""
    return correct.long().cumprod(dim=1).sum(dim=1)
