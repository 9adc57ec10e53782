"""Row-wise steps of a K3 layer in one native call each (the `_fused` extension).

A decode row's norms, residual mixes and gates are a few hundred floats of arithmetic under 4-12
torch ops each, and on a decode step torch's dispatch and the Python that builds those ops cost
more than the arithmetic (k3kit.bench.host measures it). `_fused` (built from `_fused.c` at
install) does each step in one pass per row, given the tensors' addresses: `Tensor.numpy()` is
an aten op of its own, `data_ptr()` is not. Every function here checks what it passes (float32,
CPU, contiguous, sizes) and returns None where it cannot run, and the caller runs its torch ops:
with a gradient (training), on a GPU, without the extension, or on an unusual layout.

Numerics (see `_fused.c`): the norms are ggml's (squares summed in double, the mean rounded to
float), so they agree with llama.cpp's at least as well as the torch ops did; each row is computed
alone in a fixed order, so a row's bits do not depend on the rows beside it or the thread count.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from k3kit.kernels import threads as kthreads

try:
    from k3kit.kernels import _fused
except ImportError:  # built without a C compiler: the torch ops
    _fused = None  # type: ignore[assignment]


def available() -> bool:
    """Whether the extension is built."""
    return _fused is not None


def _ok(*ts: Tensor) -> bool:
    """Whether the native step runs on these tensors: float32 on the CPU, no gradient wanted.

    The choice never depends on layout (a non-contiguous input is made contiguous): a row must
    take the same step whether it came alone (often a contiguous view) or among others."""
    if _fused is None or torch.is_grad_enabled():
        return False
    for t in ts:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True


def _c(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, gate: Tensor | None = None) -> Tensor | None:
    """ggml's RMS norm of x's rows, times weight [n] and gate (x's shape), or None (run torch)."""
    n = x.shape[-1] if x.dim() else 0
    if n == 0 or not _ok(x) or (weight is not None and not (_ok(weight) and weight.shape == (n,))) \
            or (gate is not None and not (_ok(gate) and gate.shape == x.shape)):
        return None
    x, weight, gate = _c(x), weight if weight is None else _c(weight), gate if gate is None else _c(gate)
    y = torch.empty_like(x)
    _fused.rms_norm(x.data_ptr(), weight.data_ptr() if weight is not None else 0,
                    gate.data_ptr() if gate is not None else 0, y.data_ptr(), x.numel() // n, n, eps, 0,
                    kthreads.native())
    return y


def l2_norm(x: Tensor, eps: float) -> Tensor | None:
    """x / sqrt(sum(x^2) + eps) over the last dim (sum in double), or None (run torch)."""
    n = x.shape[-1] if x.dim() else 0
    if n == 0 or not _ok(x):
        return None
    x = _c(x)
    y = torch.empty_like(x)
    _fused.rms_norm(x.data_ptr(), 0, 0, y.data_ptr(), x.numel() // n, n, eps, 1, kthreads.native())
    return y


def situ(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor | None:
    """K3's situ activation elementwise, or None (run torch)."""
    if not _ok(gate, up) or gate.shape != up.shape:
        return None
    gate, up = _c(gate), _c(up)
    y = torch.empty_like(gate)
    _fused.situ(gate.data_ptr(), up.data_ptr(), y.data_ptr(), gate.numel(), beta, linear_beta,
                kthreads.native())
    return y


def res_mix(bank: Sequence[Tensor], cur: Tensor, score_w: Tensor, eps: float) -> Tensor | None:
    """The attn-res mix of `cur`'s rows over the banked checkpoints (each cur's shape), or None."""
    n = cur.shape[-1] if cur.dim() else 0
    if not bank or len(bank) > 64 or n == 0 or not _ok(cur, score_w, *bank) or score_w.shape != (n,) \
            or any(b.shape != cur.shape for b in bank):
        return None
    cur, score_w, bank = _c(cur), _c(score_w), [_c(b) for b in bank]
    y = torch.empty_like(cur)
    _fused.res_mix(tuple(b.data_ptr() for b in bank), cur.data_ptr(), score_w.data_ptr(), y.data_ptr(),
                   cur.numel() // n, n, eps, kthreads.native())
    return y


def short_conv(window: Tensor, x: Tensor, taps: Tensor) -> tuple[Tensor, Tensor] | None:
    """KDA's q, k and v causal convs and SiLU: window [B, 3, K-1, C], x [B, T, 3, C], taps [3, K, C]
    -> (out [3, B, T, C], new window [B, 3, K-1, C]), or None (run torch). x is read in place when
    its channels are contiguous and its rows evenly strided (a [B, T, 3, C] view of [3, B*T, C]
    projections included), else made contiguous."""
    if not _ok(window, x, taps) or x.dim() != 4 or window.dim() != 4:
        return None
    B, T, three, C = x.shape
    K = taps.shape[1]
    if three != 3 or tuple(window.shape) != (B, 3, K - 1, C) or tuple(taps.shape) != (3, K, C) or K < 2:
        return None
    rs, cs = x.stride(1), x.stride(2)
    if x.stride(3) != 1 or (B > 1 and x.stride(0) != T * rs) or rs < C or cs < C:
        x = x.contiguous()
        rs, cs = 3 * C, C
    window, taps = _c(window), _c(taps)
    out = torch.empty(3, B, T, C)
    new_window = torch.empty(B, 3, K - 1, C)
    _fused.short_conv(window.data_ptr(), x.data_ptr(), taps.data_ptr(), out.data_ptr(), new_window.data_ptr(),
                      B, T, C, K, kthreads.native(), rs, cs)
    return out, new_window


def slot_sum(y: Tensor, order: Tensor | Sequence[int], weights: Tensor) -> Tensor | None:
    """The routed experts' outputs y [N*k, d] (grouped: pair order[i] = n*k + j) onto their rows,
    out[n] = sum over j in slot order of y * weights[n, j], or None (run torch). `order`: an int64
    CPU tensor or the same indices as a host sequence (no tensor made for them)."""
    keep: Tensor | array[int]           # what `addr` points into, alive until the call returns
    if isinstance(order, Tensor):
        if order.dtype != torch.int64 or order.device.type != "cpu":
            return None
        keep = _c(order)
        n_order, addr = keep.numel(), keep.data_ptr()
    else:
        host = array("q", order)
        keep, n_order, addr = host, len(host), host.buffer_info()[0]
    if not _ok(y, weights) or y.dim() != 2 or weights.dim() != 2 or n_order != weights.numel() \
            or y.shape[0] != n_order or n_order == 0:
        return None
    y, weights = _c(y), _c(weights)
    N, k = weights.shape
    out = torch.empty(N, y.shape[1])
    _fused.slot_sum(y.data_ptr(), addr, weights.data_ptr(), out.data_ptr(), N, k, y.shape[1])
    del keep
    return out


def rope_neox(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """NeoX rotary embedding of x [n, heads, head_dim] on its first cos.shape[-1] dims, cos and sin
    [n, 1, rd] (one row per token), the rest of each head copied; or None (run torch). The same
    bits as k3kit.layers.rope's torch ops (each product and the sum rounded as they are)."""
    if not _ok(x, cos, sin) or x.dim() != 3:
        return None
    n, heads, hd = x.shape
    rd = cos.shape[-1]
    if cos.shape != (n, 1, rd) or sin.shape != cos.shape or rd < 2 or rd % 2 or rd > hd:
        return None
    x, cos, sin = _c(x), _c(cos), _c(sin)
    y = torch.empty_like(x)
    _fused.rope_neox(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), n, heads, hd, rd)
    return y


def markov_greedy(base: Tensor, w1: Tensor, w2t: Tensor, anchor: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """DSpark's Markov chain across a block, greedy, in one call: base [n, V] logits, W1 [V, r]
    and W2 transposed [r, V] -> (tokens [n] int64, rows [n, V] = base + W2 . W1[previous token],
    W1 rows [n, r]), the chain starting at `anchor`; or None (run torch: bfloat16, a GPU, a
    gradient). A row's bits depend only on its inputs, never on other blocks or threads."""
    if not _ok(base, w1, w2t) or base.dim() != 2 or w1.dim() != 2 or w2t.shape != (w1.shape[1], w1.shape[0]) \
            or base.shape[1] != w1.shape[0] or not 0 <= anchor < w1.shape[0]:
        return None
    base, w1, w2t = _c(base), _c(w1), _c(w2t)
    n, (V, r) = base.shape[0], w1.shape
    rows = torch.empty_like(base)
    toks = torch.empty(n, dtype=torch.int64)
    w1s = torch.empty(n, r)
    _fused.markov_greedy(base.data_ptr(), w1.data_ptr(), w2t.data_ptr(), int(anchor), rows.data_ptr(),
                         toks.data_ptr(), w1s.data_ptr(), n, V, r)
    return toks, rows, w1s


def markov_masked(base: Tensor, w1: Tensor, w2t: Tensor, prev: int,
                  bits: Tensor) -> tuple[int, Tensor, Tensor] | None:
    """One row of `markov_greedy`'s chain after token `prev` under a grammar: base [V] logits,
    bits [W] int32 (bit t % 32 of word t // 32: token t allowed) -> (the best allowed token, the
    row base + W2 . W1[prev] [V], W1[prev] [r]): the row is markov_greedy's, the token its argmax
    whenever the grammar allows that; or None (run torch)."""
    if not _ok(base, w1, w2t) or base.dim() != 1 or w1.dim() != 2 or w2t.shape != (w1.shape[1], w1.shape[0]) \
            or base.shape[0] != w1.shape[0] or not 0 <= prev < w1.shape[0] or bits.dim() != 1 \
            or bits.dtype is not torch.int32 or not bits.is_cpu or not bits.numel():
        return None
    base, w1, w2t, bits = _c(base), _c(w1), _c(w2t), _c(bits)
    V, r = w1.shape
    row = torch.empty(V)
    w1row = torch.empty(r)
    tok = _fused.markov_masked(base.data_ptr(), w1.data_ptr(), w2t.data_ptr(), int(prev), row.data_ptr(),
                               w1row.data_ptr(), bits.data_ptr(), V, r, bits.numel())
    return tok, row, w1row


def apply_bitmask(rows: Tensor, bits: Tensor) -> Tensor | None:
    """rows [R, V] float32 logits with -inf where `bits` [R, W] (int32, bit j of word i: token
    32 i + j) is 0 and past its last word: a masked copy in one pass (a grammar's mask on every
    decode row), or None (run the torch ops)."""
    if not _ok(rows) or rows.dim() != 2 or bits.dim() != 2 or bits.dtype is not torch.int32 \
            or not bits.is_cpu or bits.shape[0] != rows.shape[0]:
        return None
    rows, bits = _c(rows), _c(bits)
    out = torch.empty_like(rows)
    _fused.apply_bitmask(rows.data_ptr(), bits.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1],
                         bits.shape[1])
    return out
