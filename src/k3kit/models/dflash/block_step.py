"""A draft block through `DSparkDraft.forward` with only the Python its rows need.

A draft step is a few rows (the block) through two or three small layers, so on a CPU its time is
the modules' plumbing (calls, argument checks, shapes, fresh outputs), not their arithmetic.
`BlockStep` runs the layers of a draft read from a GGUF (products on its quantized bytes, ggml
norms) by calling what their `forward` calls: the native fused products, norms and rope, and the
torch ops of attention and SiLU, in the same order with the same arguments, so a block's hidden
rows have the bits `forward` gives them (tests/models/test_dflash_block_step.py compares them).
What does not fit (float or HF-norm weights, grouped heads, a gradient) says why at `build`, and
`run` returns None where a call cannot run; the caller then runs `forward`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3kit.kernels import fused as kfused
from k3kit.kernels import qmatmul as kq
from k3kit.kernels import threads as kthreads
from k3kit.layers.module_hooks import HookWatch
from k3kit.layers.norm import RMSNorm
from k3kit.layers.quantized_linear import fusable_matrices
from k3kit.layers.rope import RopeTable

from .network import DraftLayer, DSparkDraft, _join

# False: every block runs DSparkDraft.forward (tests and benchmarks compare the two ways)
ENABLED = True


class Unfit(Exception):
    """Why a draft has no block step."""


def _norm(m: nn.Module) -> tuple[int, float]:
    """An RMSNorm in ggml's order (the native norm): its weight's address and eps."""
    if not isinstance(m, RMSNorm) or m.style != "ggml":
        raise Unfit("a norm not in ggml's order (a draft not read from a GGUF)")
    w = m.weight
    if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
        raise Unfit("a norm weight that is not contiguous float32 on the CPU")
    return w.data_ptr(), m.eps


def _matrices(lins: Sequence[nn.Module]) -> list[Any]:
    """The QuantizedMatrix of each linear, fusable into one native call (fused_products)."""
    mats = fusable_matrices(lins)
    if mats is None:
        raise Unfit("projections that are not quantized matrices one native call takes")
    return mats


class _Layer:
    """DraftLayer.forward's calls for one layer."""

    def __init__(self, layer: DraftLayer):
        attn = layer.self_attn
        if attn.nh != attn.nkv:
            raise Unfit("grouped K/V heads")
        self.layer = layer
        self.nh, self.hd = attn.nh, attn.hd
        self.in_norm, self.post_norm = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
        self.q_norm, self.k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
        self.qkv = _matrices((attn.q_proj, attn.k_proj, attn.v_proj))
        self.o = _matrices((attn.o_proj,))[0]
        self.gu = _matrices((layer.mlp.gate_proj, layer.mlp.up_proj))
        self.down = _matrices((layer.mlp.down_proj,))[0]
        self.kv = _matrices((attn.k_proj, attn.v_proj))
        self.linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj,
                        layer.mlp.up_proj, layer.mlp.down_proj]

    def context_kv(self, g: Tensor, rope: RopeTable, nt: int) -> tuple[Tensor, Tensor]:
        """DraftAttention.kv's calls on fused context rows g [n, H]: the fused K/V product, K's
        norm and rope -> (K, V) [n, nh, hd]."""
        Fu = kfused._fused
        n, nh, hd = g.shape[0], self.nh, self.hd
        m0 = self.kv[0]
        kv = torch.empty(2, n, m0.out_features)
        kq._qmatmul.experts_q8(m0._qtype_id, [m._raw_np for m in self.kv], kq.buf(g), kq.buf(kv), [n],
                               m0.out_features, m0.in_features, 2, nt)
        k, v = kv.view(2, n, nh, hd).unbind(0)
        w, eps = self.k_norm
        kn = torch.empty(n, nh, hd)
        Fu.rms_norm(k.data_ptr(), w, 0, kn.data_ptr(), n * nh, hd, eps, 0, nt)
        r = torch.empty(n, nh, hd)
        Fu.rope_neox(kn.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr(), r.data_ptr(), n, nh, hd,
                     rope.cos.shape[-1])
        return r, v

    def __call__(self, x: Tensor, rope: RopeTable, ctx: Any, nt: int) -> Tensor:
        Fu, Q = kfused._fused, kq._qmatmul
        b, H = x.shape
        nh, hd = self.nh, self.hd
        h = torch.empty(b, H)
        Fu.rms_norm(x.data_ptr(), self.in_norm[0], 0, h.data_ptr(), b, H, self.in_norm[1], 0, nt)
        m0 = self.qkv[0]
        qkv = torch.empty(3, b, m0.out_features)
        Q.experts_q8(m0._qtype_id, [m._raw_np for m in self.qkv], kq.buf(h), kq.buf(qkv), [b],
                     m0.out_features, m0.in_features, 3, nt)
        q, k, v = qkv.view(3, b, nh, hd).unbind(0)
        cos, sin = rope.cos, rope.sin
        rd = cos.shape[-1]
        roped = []
        for t, (w, eps) in ((q, self.q_norm), (k, self.k_norm)):
            n = torch.empty(b, nh, hd)
            Fu.rms_norm(t.data_ptr(), w, 0, n.data_ptr(), b * nh, hd, eps, 0, nt)
            r = torch.empty(b, nh, hd)
            Fu.rope_neox(n.data_ptr(), cos.data_ptr(), sin.data_ptr(), r.data_ptr(), b, nh, hd, rd)
            roped.append(r)
        kk, vv = _join(ctx, roped[1], v)
        a = self.layer.self_attn.attend(roped[0], kk, vv)
        o = torch.empty(b, H)
        Q.matmul_q8(self.o._qtype_id, self.o._raw_np, a.data_ptr(), o.data_ptr(), H, self.o.in_features, b,
                    -1, nt, 1, kq.I8_PATH)
        x = x + o
        Fu.rms_norm(x.data_ptr(), self.post_norm[0], 0, h.data_ptr(), b, H, self.post_norm[1], 0, nt)
        g0 = self.gu[0]
        gu = torch.empty(2, b, g0.out_features)
        Q.experts_q8(g0._qtype_id, [m._raw_np for m in self.gu], kq.buf(h), kq.buf(gu), [b], g0.out_features,
                     g0.in_features, 2, nt)
        g, u = gu.unbind(0)
        act = F.silu(g).mul_(u)
        y = torch.empty(b, H)
        Q.matmul_q8(self.down._qtype_id, self.down._raw_np, act.data_ptr(), y.data_ptr(), H,
                    self.down.in_features, b, -1, nt, 1, kq.I8_PATH)
        return x + y


class BlockStep:
    """`DSparkDraft.forward(None, positions, ctx, span=..., x=x)` of one block (module doc)."""

    def __init__(self, draft: DSparkDraft):
        if kq._qmatmul is None or not kfused.available():
            raise Unfit("the native extensions are not built")
        self.draft = draft
        self.modules = list(draft.modules())
        self.hooked = HookWatch(self.modules)
        self.layers = [_Layer(cast(DraftLayer, layer)) for layer in draft.layers]
        self.norm = _norm(draft.norm)
        self.linears = [lin for layer in self.layers for lin in layer.linears]
        self.lock = threading.Lock()
        try:              # the context rows' projection (fc and its norm), where they are native
            self.fc: Any = _matrices((draft.fc,))[0]
            self.hidden_norm: tuple[int, float] | None = _norm(draft.hidden_norm)
            self.ctx_linears = [draft.fc] + self.linears
        except Unfit:
            self.fc, self.hidden_norm, self.ctx_linears = None, None, []

    @classmethod
    def build(cls, draft: DSparkDraft) -> tuple[BlockStep | None, str]:
        """(the block step, "") or (None, why there is none)."""
        if not ENABLED:
            return None, "turned off"
        try:
            return cls(draft), ""
        except Unfit as e:
            return None, str(e)

    def _rope(self, positions: Tensor, n: int, span: tuple[int, int]) -> RopeTable | None:
        """The draft's rope table of `positions` (the range `span`), where the native rope reads it."""
        draft = self.draft
        rope = draft.rope(positions.to(draft.rope_inv_freq.device), torch.float32, span, contiguous=True)
        rd = rope.cos.shape[-1]
        if not (rope.cos.is_contiguous() and rope.sin.is_contiguous() and rope.cos.dtype == torch.float32
                and rope.cos.shape == (n, 1, rd) and rope.sin.shape == rope.cos.shape
                and 2 <= rd <= self.layers[0].hd and rd % 2 == 0):
            return None         # RopeTable.apply's torch ops
        return rope

    def context_kv(self, taps: Tensor, positions: Tensor,
                   span: tuple[int, int]) -> list[tuple[Tensor, Tensor]] | None:
        """`DSparkDraft.context_kv(taps, positions, span)`: the same calls (fc and its norm, each
        layer's fused K/V product, K's norm and rope), so the same bits; None, with nothing done,
        where a call cannot run (the caller then runs the module's)."""
        draft, fc, hn = self.draft, self.fc, self.hidden_norm
        if fc is None or hn is None or torch.is_grad_enabled() or draft.training or taps.dim() != 2 \
                or taps.device.type != "cpu" or any(m.check is not None for m in self.ctx_linears) \
                or self.hooked() or not self.lock.acquire(blocking=False):
            return None
        try:
            n = taps.shape[0]
            rope = self._rope(positions, n, span)
            if rope is None:
                return None
            x = taps.to(torch.float32)
            x = x if x.is_contiguous() else x.contiguous()
            nt = kthreads.native()
            h = torch.empty(n, fc.out_features)
            kq._qmatmul.matmul_q8(fc._qtype_id, fc._raw_np, x.data_ptr(), h.data_ptr(), fc.out_features,
                                  fc.in_features, n, -1, nt, 1, kq.I8_PATH)
            g = torch.empty(n, fc.out_features)
            kfused._fused.rms_norm(h.data_ptr(), hn[0], 0, g.data_ptr(), n, fc.out_features, hn[1], 0, nt)
            return [layer.context_kv(g, rope, nt) for layer in self.layers]
        finally:
            self.lock.release()

    def run(self, x: Tensor, positions: Tensor, ctx: list[tuple[Tensor, Tensor]] | None,
            span: tuple[int, int]) -> Tensor | None:
        """The final-normed hidden rows [b, H] of the embedded block x [b, H] at `positions` (the
        range `span`) over `ctx`; None, with nothing done, where this step cannot run it."""
        draft = self.draft
        if torch.is_grad_enabled() or draft.training or x.dtype != torch.float32 or x.device.type != "cpu" \
                or x.dim() != 2 or any(m.check is not None for m in self.linears) \
                or self.hooked() or not self.lock.acquire(blocking=False):
            return None
        try:
            nt = kthreads.native()
            rope = draft.rope(positions.to(draft.rope_inv_freq.device), x.dtype, span, contiguous=True)
            rd = rope.cos.shape[-1]
            if not (rope.cos.is_contiguous() and rope.sin.is_contiguous() and rope.cos.dtype == torch.float32
                    and rope.cos.shape == (x.shape[0], 1, rd) and rope.sin.shape == rope.cos.shape
                    and 2 <= rd <= self.layers[0].hd and rd % 2 == 0):
                return None         # RopeTable.apply's torch ops
            x = x if x.is_contiguous() else x.contiguous()
            for i, layer in enumerate(self.layers):
                x = layer(x, rope, None if ctx is None else ctx[i], nt)
            b, H = x.shape
            out = torch.empty(b, H)
            kfused._fused.rms_norm(x.data_ptr(), self.norm[0], 0, out.data_ptr(), b, H, self.norm[1], 0, nt)
            return out
        finally:
            self.lock.release()
