"""Cross-layer residual attention ("attn-res"): each sub-layer input is a softmax mix over
the residual checkpoints banked so far and the current residual stream.

Semantics of llama.cpp's `res_mix` / `res_push` (src/models/kimi-k3.cpp):
* the bank is per token and rebuilt on every forward: it mixes across LAYERS of one token,
  never across tokens, so nothing of it survives into the sequence state;
* on layers il % block_size == 0 the RAW layer input (not the mixed one) is banked, after
  that layer's attention-side mix, and the stream restarts from the attention output alone;
* scores are sum(RMSNorm(x) * score_w) (no learned norm weight: `score_w` is the fused
  res_norm * res_proj vector), the weighted sum uses the un-normalised values, and the
  current stream is scored and added apart from the bank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3kit.kernels import fused
from k3kit.layers.norm import rms_norm


def res_mix(bank: list[Tensor], cur: Tensor, score_w: Tensor, eps: float) -> Tensor:
    """softmax([s(b_0) .. s(b_n-1), s(cur)]) . [b_0 .. b_n-1, cur] with s(x) = sum(rmsnorm(x)*w)."""
    if not bank:
        return cur
    if torch.is_grad_enabled():
        src = torch.stack(bank, dim=-2)                                  # [..., n_ckpt, H]
        sc_src = (rms_norm(src, None, eps) * score_w).sum(dim=-1)        # [..., n_ckpt]
        sc_cur = (rms_norm(cur, None, eps) * score_w).sum(dim=-1, keepdim=True)
        probs = torch.softmax(torch.cat((sc_src, sc_cur), dim=-1), dim=-1)
        out = (src * probs[..., :-1, None]).sum(dim=-2)
        return out + cur * probs[..., -1:]
    if (native := fused.res_mix(bank, cur, score_w, eps)) is not None:   # one native call per mix
        return native
    # inference: the checkpoints and the stream scored as one tensor. Each score is its own row's
    # norm and dot (row-wise reductions: the same floats), in half the ops.
    both = torch.stack((*bank, cur), dim=-2)                             # [..., n_ckpt + 1, H]
    probs = torch.softmax((rms_norm(both, None, eps) * score_w).sum(dim=-1), dim=-1)
    out = (both[..., :-1, :] * probs[..., :-1, None]).sum(dim=-2)
    return out + cur * probs[..., -1:]
