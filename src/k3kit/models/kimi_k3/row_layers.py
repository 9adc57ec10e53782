"""The attention sub-layers of `row_step.RowStep`: K3's KDA and MLA on T rows of one sequence,
each calling the native functions and torch ops its module's forward calls, in the same order
with the same arguments (so with the same bits), on buffers of its own for a single row; and the
products and buffers every sub-layer shares (the feed-forward ones are in row_ffn)."""


from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from k3kit.kernels import fused as kfused
from k3kit.kernels import kda_step
from k3kit.kernels import qmatmul as kq
from k3kit.layers.quantized_linear import QuantizedLinear, fusable_matrices

from . import mla as mla_ops
from .kda import KDA, KDARows
from .kda import _padded_sigmoid as padded_sigmoid
from .mla import MLA
from .model import _stacked as stacked
from .state import KDAState, MLACache

F32 = 4


def empty(*shape: int) -> Tensor:
    return torch.empty(*shape, dtype=torch.float32)


class Product:
    """x @ W.T for a QuantizedLinear in the ggml arithmetic on one row: `QuantizedLinear.forward`'s
    `_matmul_q8` call, into a buffer of this product's own."""


    def __init__(self, lin: nn.Module):
        q8 = lin._q8 if isinstance(lin, QuantizedLinear) else None
        if q8 is None or lin.bias is not None:
            raise Unfit(f"{type(lin).__name__} is not a native ggml-arithmetic product without a bias")
        self.qtype: int = q8._qtype_id
        self.raw: np.ndarray = q8._raw_np
        self.n_out: int = q8.out_features
        self.n_in: int = q8.in_features
        self.out: Tensor = empty(1, self.n_out)
        self.out_buf: Any = kq.buf(self.out)

    def __call__(self, x: int, nt: int, T: int = 1) -> Tensor:
        """x's T rows (an address) -> [T, n_out]: the product's buffer for one row, else fresh."""
        out = self.out if T == 1 else torch.empty(T, self.n_out)
        kq._qmatmul.matmul_q8(
            self.qtype, self.raw, x, out.data_ptr(), self.n_out, self.n_in, T, -1, nt, 1, kq.I8_PATH
        )
        return out


class FusedProducts:
    """`quantized_linear.fused_products` of several QuantizedLinear on one row: one experts_q8
    call, [len, 1, n_out] into a buffer."""

    def __init__(self, lins: Sequence[nn.Module]):
        mats = fusable_matrices(lins)
        if mats is None:
            raise Unfit("products that are not quantized matrices one native call takes")
        self.qtype, self.raws = mats[0]._qtype_id, [m._raw_np for m in mats]
        self.n_out, self.n_in, self.per = mats[0].out_features, mats[0].in_features, len(mats)
        self.out = empty(self.per, 1, self.n_out)
        self.out_buf = kq.buf(self.out)

    def __call__(self, x_buf: Any, nt: int, T: int = 1, fresh: bool = False) -> Tensor:
        """[per, T, n_out]: the buffer for one row, else (or `fresh`) a new tensor."""
        if T == 1 and not fresh:
            out, out_buf = self.out, self.out_buf
        else:
            out = torch.empty(self.per, T, self.n_out)
            out_buf = kq.buf(out)
        kq._qmatmul.experts_q8(
            self.qtype, self.raws, x_buf, out_buf, [T], self.n_out, self.n_in, self.per, nt
        )
        return out


class Unfit(Exception):
    """Why a model has no row step (said once)."""


class Vec:
    """A [1, n] float32 buffer with its address and its ctypes view (for the `y*` arguments)."""


    def __init__(self, n: int):
        self.t = empty(1, n)
        self.addr = self.t.data_ptr()
        self.buf = kq.buf(self.t)


def f32(t: Tensor, what: str) -> Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise Unfit(f"{what} is not contiguous float32 on the CPU")
    return t


class KdaLayer:
    """KDA.forward on T rows of one sequence (B = 1): committed (the state advanced in place) or
    speculative (the state left as it was, the rows for `commit_rows` returned fresh)."""

    def __init__(self, kda: KDA, segments: bool = False):
        cfg = kda.cfg
        self.kda = kda
        self.segments = segments        # forward_segments' arithmetic: beta's sigmoid over padded rows
        self.H, self.D, self.C, self.K = cfg.num_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.conv_kernel
        self.eps = cfg.rms_norm_eps
        self.lb = cfg.gate_lower_bound
        self.qkvg = FusedProducts((kda.q_proj, kda.k_proj, kda.v_proj, kda.g_proj))
        self.f_a, self.f_b, self.b = Product(kda.f_a_proj), Product(kda.f_b_proj), Product(kda.b_proj)
        self.o = Product(kda.o_proj)
        H, D, C = self.H, self.D, self.C
        self.o_norm = f32(kda.o_norm.detach(), "KDA o_norm")
        self.dt_bias = f32(kda.dt_bias.detach(), "KDA dt_bias")
        self.scale = 1.0 / math.sqrt(D)
        # one committed row: every intermediate in a buffer of its own
        self.conv_out = empty(3, 1, 1, C)
        self.q, self.k, self.v = self.conv_out.view(3, 1, 1, H, D).unbind(0)
        self.qn, self.kn, self.o_rows, self.normed = (empty(1, 1, H, D) for _ in range(4))
        self.u = empty(1, C)
        self.u4 = self.u.view(1, 1, H, D)
        # the gate's lower bound as the float32 torch multiplies a float32 tensor by
        self.lb32 = torch.tensor([self.lb if self.lb is not None else 0.0], dtype=torch.float32)
        self.g, self.e = empty(1, 1, H, D), empty(1, 1, H, D)
        self.beta = empty(1, H)
        # forward_segments' beta of one row: b's product into a row padded as padded_sigmoid pads
        # it (zeros past H, to a multiple of 64), one sigmoid over it in place (each value's bits
        # are its SIMD lane's, the padding's do not reach them): three ops fewer than pad + copy
        self.b_padded = torch.zeros(1, H + (-H) % 64)
        self.gate = empty(1, C)
        self.gate_in = self.qkvg.out[3]                                   # [1, C]: the gate's projection
        self.bufs = [kq.buf(t) for t in (self.qn, self.kn, self.v, self.e, self.beta, self.o_rows)]
        # (A, -A, whether -A is H contiguous floats: the native gate arithmetic's per-head scale)
        self._rate: tuple[Tensor, Tensor, bool] | None = None
        self._taps: tuple[tuple[int, ...], Tensor, tuple[Tensor, ...]] | None = None

    def fit(self, st: KDAState) -> bool:
        S, conv = st.S, st.conv
        return (S.dtype == torch.float32 and S.is_cpu and S.is_contiguous() and S.shape[0] == 1
                and not S.requires_grad and conv.dtype == torch.float32 and conv.is_cpu
                and conv.shape[0] == 1)

    def taps(self) -> Tensor:
        """kda.conv_taps_by_row(), asked again only when a conv weight changed."""
        p = self.kda._parameters         # the module's dict: no nn.Module attribute lookups
        ws = cast(tuple[Tensor, Tensor, Tensor], (p["q_conv"], p["k_conv"], p["v_conv"]))
        key = (id(ws[0]), id(ws[1]), id(ws[2]), ws[0]._version, ws[1]._version, ws[2]._version)
        taps = self._taps
        if taps is None or taps[0] != key:
            taps = self._taps = (key, self.kda.conv_taps_by_row(), ws)     # ws held: their ids stay theirs
        return taps[1]

    def neg_rate(self) -> Tensor:
        """-A for the decay's -(u * A), computed as u * (-A): the same floats (a product's
        rounding is symmetric in sign), one op fewer a row."""
        A = self.kda.decay_rate()
        if self._rate is None or self._rate[0] is not A:
            neg = -A
            flat = neg.dtype == torch.float32 and neg.is_contiguous() and neg.numel() == self.H
            self._rate = (A, neg, flat)
        return self._rate[1]

    def _native_neg(self) -> Tensor | None:
        """neg_rate where it is H contiguous floats, as the native per-head scale reads it."""
        neg = self.neg_rate()
        return neg if self._rate is not None and self._rate[2] else None

    def __call__(self, x_addr: int, x_buf: Any, st: KDAState, nt: int, T: int,
                 commit: bool) -> tuple[Tensor, KDARows | None]:
        F = kfused._fused
        H, D, C, K = self.H, self.D, self.C, self.K
        one = T == 1                     # the buffers, but for what a speculative row keeps: fresh
        keep = not commit
        y = self.qkvg(x_buf, nt, T, fresh=not one or keep)
        window = st.conv if st.conv.is_contiguous() else st.conv.contiguous()
        new_window = torch.empty(1, 3, K - 1, C)
        if one and not keep:
            conv_out, q, k, v, qn, kn = self.conv_out, self.q, self.k, self.v, self.qn, self.kn
        else:
            conv_out = torch.empty(3, 1, T, C)
            q, k, v = conv_out.view(3, 1, T, H, D).unbind(0)
            qn, kn = (self.qn if one else torch.empty(1, T, H, D)), torch.empty(1, T, H, D)
        F.short_conv(window.data_ptr(), y.data_ptr(), self.taps().data_ptr(), conv_out.data_ptr(),
                     new_window.data_ptr(), 1, T, C, K, nt, C, T * C)
        F.rms_norm(q.data_ptr(), 0, 0, qn.data_ptr(), T * H, D, self.eps, 1, nt)       # l2_norm
        F.rms_norm(k.data_ptr(), 0, 0, kn.data_ptr(), T * H, D, self.eps, 1, nt)
        # KDA.decay: u = f_b(f_a(x)) + dt_bias, then the gate's torch ops; beta = sigmoid(b x)
        fa = self.f_a(x_addr, nt, T)         # held while f_b reads it (an address does not own it)
        fb = self.f_b(fa.data_ptr(), nt, T)
        S = st.S
        if one:
            u = self.u4
            g_out = torch.empty(1, 1, H, D) if keep else self.g
            neg = self._native_neg() if self.lb is not None else None
            if neg is not None:
                # torch.add / mul's IEEE operations natively (the same bits, no dispatcher)
                F.add(fb.data_ptr(), self.dt_bias.data_ptr(), self.u.data_ptr(), C)
                g_addr = g_out.data_ptr()
                F.scale(self.u.data_ptr(), neg.data_ptr(), g_addr, H, D)        # u * (-A), per head
                torch.sigmoid(g_out, out=g_out)
                F.scale(g_addr, self.lb32.data_ptr(), g_addr, 1, C)                   # times the bound
                g = g_out
            elif self.lb is not None:
                torch.add(fb, self.dt_bias, out=self.u)
                t = torch.sigmoid(torch.mul(u, self.neg_rate(), out=g_out), out=g_out)
                g = torch.mul(t, self.lb, out=g_out)
            else:
                torch.add(fb, self.dt_bias, out=self.u)
                g = torch.nn.functional.softplus(u) * self.kda.decay_rate()
            torch.exp(g, out=self.e)
            beta = torch.empty(1, H) if keep else self.beta
            if self.segments:
                b, pb = self.b, self.b_padded
                kq._qmatmul.matmul_q8(b.qtype, b.raw, x_addr, pb.data_ptr(), b.n_out, b.n_in, 1, -1, nt, 1,
                                      kq.I8_PATH)
                torch.sigmoid(pb, out=pb)
                F.copy_rows(pb.data_ptr(), H, beta.data_ptr(), H, 1, H)
            else:
                torch.sigmoid(self.b(x_addr, nt), out=beta)
            qb, kb, vb, eb, bb, ob = self.bufs
            if keep:
                kb, vb, bb = kq.buf(kn), kq.buf(v), kq.buf(beta)
            o, rows = self.o_rows, None
            s_buf = kq.buf(S)
            S_out = torch.empty_like(S) if keep else S
            out_buf = kq.buf(S_out) if keep else s_buf
            kda_step._kda.kda_rows(s_buf, out_buf, qb, kb, vb, eb, bb, ob, 1, 1, H, D, D, self.scale, -1, nt)
            if keep:
                rows = KDARows(y.as_strided((1, 1, 3, C), (C, C, C, 1)), kn, v, g, beta.view(1, 1, H), S_out)
            else:
                st.conv = new_window
            torch.sigmoid(y[3] if keep else self.gate_in, out=self.gate)
            gate, normed = self.gate, self.normed
        else:
            g, beta = self._gates(x_addr, fb, nt, T, (1, T))
            # delta_rule through kda_step.rows: in place on a committed state, else a new one
            S_out = S if commit else torch.empty_like(S)
            o = torch.empty(1, T, H, D)
            e = torch.exp(g)          # held while the call reads it (a buffer does not own its tensor)
            kda_step._kda.kda_rows(kq.buf(S), kq.buf(S_out), kq.buf(qn), kq.buf(kn), kq.buf(v), kq.buf(e),
                                   kq.buf(beta), kq.buf(o), 1, T, H, D, D, self.scale, -1, nt)
            rows = None
            if commit:
                st.conv = new_window
            else:
                conv_in = y.as_strided((1, T, 3, C), (T * C, C, T * C, 1))     # project_qkvg's view
                rows = KDARows(conv_in, kn, v, g, beta, S_out)
            gate, normed = torch.sigmoid(y[3]), torch.empty(1, T, H, D)
        F.rms_norm(o.data_ptr(), self.o_norm.data_ptr(), gate.data_ptr(), normed.data_ptr(), T * H, D,
                   self.eps, 0, nt)
        return self.o(normed.data_ptr(), nt, T), rows


    def _gates(self, x_addr: int, fb: Tensor, nt: int, rows: int,
               lead: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """KDA.decay's gate g [*lead, H, D] from f_b's rows (u = f_b + dt_bias, then its torch ops)
        and beta = sigmoid(b x) [*lead, H] (padded rows in forward_segments' arithmetic), for
        `rows` rows of x."""
        H, D = self.H, self.D
        neg = self._native_neg() if self.lb is not None else None
        if neg is not None:
            # (fb + dt_bias), * (-A) per head, sigmoid, * lb: torch's floats, the adds and
            # products native (u * (-A) is -(u * A): a product's rounding is symmetric in sign)
            F = kfused._fused
            g = torch.empty(*lead, H, D)
            addr = g.data_ptr()
            F.add(fb.data_ptr(), self.dt_bias.data_ptr(), addr, rows * H * D, H * D)
            F.scale(addr, neg.data_ptr(), addr, rows * H, D, H)
            torch.sigmoid(g, out=g)
            F.scale(addr, self.lb32.data_ptr(), addr, 1, rows * H * D)
        else:
            u = (fb + self.dt_bias).view(*lead, H, D)
            A = self.kda.decay_rate()
            if self.lb is not None:
                g = torch.sigmoid(-(u * A)) * self.lb
            else:
                g = torch.nn.functional.softplus(u) * A
        b = self.b(x_addr, nt, rows)
        beta = (padded_sigmoid(b).contiguous() if self.segments else torch.sigmoid(b)).view(*lead, self.H)
        return g, beta

    def decode(self, x_addr: int, x_buf: Any, states: Sequence[KDAState], nt: int) -> Tensor:
        """One committed row for each of N sequences (x's rows, states[i] row i's): the
        projections, gates and output over all rows, the convs and the delta rule as one batch
        of states (forward_segments' one-row segments: their calls, so their bits). The states
        are left as views of the batch they were stepped in (the next pass of the same
        sequences steps them in place)."""
        F = kfused._fused
        H, D, C, K, N = self.H, self.D, self.C, self.K, len(states)
        y = self.qkvg(x_buf, nt, N, fresh=True)                       # [4, N, C]
        window = stacked([st.conv for st in states])                  # [N, 3, K-1, C]
        S = stacked([st.S for st in states])                          # [N, H, D, D]
        new_window = torch.empty(N, 3, K - 1, C)
        conv_out = torch.empty(3, N, 1, C)
        q, k, v = conv_out.view(3, N, 1, H, D).unbind(0)
        qn, kn = torch.empty(N, 1, H, D), torch.empty(N, 1, H, D)
        F.short_conv(window.data_ptr(), y.data_ptr(), self.taps().data_ptr(), conv_out.data_ptr(),
                     new_window.data_ptr(), N, 1, C, K, nt, C, N * C)
        F.rms_norm(q.data_ptr(), 0, 0, qn.data_ptr(), N * H, D, self.eps, 1, nt)       # l2_norm
        F.rms_norm(k.data_ptr(), 0, 0, kn.data_ptr(), N * H, D, self.eps, 1, nt)
        fa = self.f_a(x_addr, nt, N)         # held while f_b reads it (an address does not own it)
        fb = self.f_b(fa.data_ptr(), nt, N)
        g, beta = self._gates(x_addr, fb, nt, N, (N, 1))
        o = torch.empty(N, 1, H, D)
        e = torch.exp(g)          # held while the call reads it (a buffer does not own its tensor)
        s_buf = kq.buf(S)
        kda_step._kda.kda_rows(s_buf, s_buf, kq.buf(qn), kq.buf(kn), kq.buf(v), kq.buf(e), kq.buf(beta),
                               kq.buf(o), N, 1, H, D, D, self.scale, -1, nt)
        for j, st in enumerate(states):
            st.S, st.conv = S[j:j + 1], new_window[j:j + 1]
        gate, normed = torch.sigmoid(y[3]), torch.empty(N, 1, H, D)
        F.rms_norm(o.data_ptr(), self.o_norm.data_ptr(), gate.data_ptr(), normed.data_ptr(), N * H, D,
                   self.eps, 0, nt)
        return self.o(normed.data_ptr(), nt, N)


class MlaLayer:
    """MLA.forward on T rows of one sequence appended to its cache (B = 1), absorbed form."""

    def __init__(self, mla: MLA):
        cfg = mla.cfg
        heads = mla.kv_b_heads
        if heads is None or not heads.ggml_exact or any(v is not None for v in mla.ggml_inputs.values()):
            raise Unfit("an MLA layer without native ggml-arithmetic kv_b heads")
        self.mla, self.heads = mla, heads
        self.H, self.nope, self.pe, self.L = (
            cfg.num_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.kv_lora_rank,
        )
        self.qk, self.v = cfg.qk_head_dim, cfg.v_head_dim
        self.eps = cfg.rms_norm_eps
        H, nope, pe, L = self.H, self.nope, self.pe, self.L
        if cfg.q_lora_rank is not None:
            self.q_a: Product | None = Product(mla.q_a_proj)
            self.q_a_norm = f32(mla.q_a_norm.detach(), "MLA q_a_norm")
            self.q_a_normed = Vec(cfg.q_lora_rank)
            self.q = Product(mla.q_b_proj)
        else:
            self.q_a = None
            self.q = Product(mla.q_proj)
        self.kv_a = Product(mla.kv_a_proj)
        self.kv_a_norm = f32(mla.kv_a_norm.detach(), "MLA kv_a_norm")
        self.g = Product(mla.g_proj) if mla.g_proj is not None else None
        self.o = Product(mla.o_proj)
        # one row's query: the q product's buffer [H, qk] holds q_nope and q_pe per head
        self.q_nope_c = empty(H, 1, nope)  # absorb's contiguous copy, [H, 1, nope]
        self.q_abs = empty(H, 1, L)
        self.Q = empty(1, 1, H, L + pe)
        self.Q3 = self.Q.view(1, H, L + pe)
        self.values = empty(H, 1, self.v)
        self.out = self.values.view(1, H * self.v)  # value_heads' [B*T, H * v] rows
        self.gated = empty(1, H * self.v)
        self.gate = empty(1, H * self.v)
        self.bufs = (kq.buf(self.q_nope_c), kq.buf(self.q_abs), kq.buf(self.values))
        self.c = empty(1, L)
        self.scale = 1.0 / math.sqrt(nope + pe)
        self.k_stride, self.v_stride = heads.k_b.nbytes // H, heads.v_b.nbytes // H

    def fit(self, cache: MLACache) -> bool:
        r = cache.rows
        return r.dtype == torch.float32 and r.is_cpu and r.shape[0] == 1 and r.shape[2] == self.L + self.pe

    def __call__(self, x_addr: int, cache: MLACache, nt: int, T: int) -> Tensor:
        F = kfused._fused
        H, nope, pe, L = self.H, self.nope, self.pe, self.L
        if self.q_a is not None:
            qa = self.q_a(x_addr, nt, T)
            qan = self.q_a_normed.t if T == 1 else torch.empty_like(qa)
            F.rms_norm(
                qa.data_ptr(), self.q_a_norm.data_ptr(), 0, qan.data_ptr(), T, self.q_a.n_out, self.eps, 0, nt
            )
            q = self.q(qan.data_ptr(), nt, T)
        else:
            q = self.q(x_addr, nt, T)
        kv = self.kv_a(x_addr, nt, T)
        offset = cache.length
        if T > 1:
            return self._rows(x_addr, cache, nt, T, q, kv)
        F.rms_norm(kv.data_ptr(), self.kv_a_norm.data_ptr(), 0, self.c.data_ptr(), 1, L, self.eps, 0, nt)
        # cache.append(c, k_pe): the row copied in (a copy has the bits of its source)
        need = offset + 1
        if need > cache.rows.shape[1]:
            cache.reserve(max(need, 2 * cache.rows.shape[1]))
        rows = cache.rows
        if rows.is_contiguous():
            dst = rows.data_ptr() + offset * (L + pe) * F32
            ctypes.memmove(dst, self.c.data_ptr(), L * F32)
            ctypes.memmove(dst + L * F32, kv.data_ptr() + L * F32, pe * F32)
            cache.length = need
        else:
            cache.append(self.c.view(1, 1, L), kv[:, L:].view(1, 1, pe))
        K = cache.rows[:, :need]
        # absorb_q: W_kb^T q_nope per head (QuantizedHeads.matmul of the contiguous heads)
        q_addr, qk, C = self.q.out.data_ptr(), self.qk, L + pe
        F.copy_rows(q_addr, qk, self.q_nope_c.data_ptr(), nope, H, nope)     # q_nope, contiguous
        heads = self.heads
        kq._qmatmul.matmul_heads(
            int(heads.k_b.qtype),
            heads.k_b._raw_np,
            self.bufs[0],
            self.bufs[1],
            H,
            L,
            nope,
            1,
            self.k_stride,
            1,
            -1,
            nt,
        )
        Q_addr = self.Q.data_ptr()          # torch.cat((q_abs, q_pe), -1) per head, as copies
        F.copy_rows(self.q_abs.data_ptr(), L, Q_addr, C, H, L)
        F.copy_rows(q_addr + nope * F32, qk, Q_addr + L * F32, C, H, pe)
        # attend, T == 1: one row sees every position
        scores = torch.bmm(self.Q3, K.transpose(1, 2)).mul_(self.scale)
        lat = torch.bmm(torch.softmax(scores, dim=-1), K[..., :L])  # [1, H, L]
        kq._qmatmul.matmul_heads(
            int(heads.v_b.qtype),
            heads.v_b._raw_np,
            kq.buf(lat),
            self.bufs[2],
            H,
            self.v,
            L,
            1,
            self.v_stride,
            1,
            -1,
            nt,
        )
        out = self.out
        if self.g is not None:
            gate = torch.sigmoid(self.g(x_addr, nt), out=self.gate)
            F.mul(out.data_ptr(), gate.data_ptr(), self.gated.data_ptr(), H * self.v)   # torch.mul's bits
            out = self.gated
        return self.o(out.data_ptr(), nt)

    def decode(self, x_addr: int, caches: Sequence[MLACache], nt: int) -> Tensor:
        """One row for each of N sequences (x's rows, caches[i] row i's): the projections and
        the per-head products over all rows, the attention per sequence over its own cache
        (forward_segments' one-row segments: their calls, so their bits)."""
        F = kfused._fused
        H, nope, pe, L, N = self.H, self.nope, self.pe, self.L, len(caches)
        if self.q_a is not None:
            qa = self.q_a(x_addr, nt, N)
            qan = torch.empty_like(qa)
            F.rms_norm(qa.data_ptr(), self.q_a_norm.data_ptr(), 0, qan.data_ptr(), N, self.q_a.n_out,
                       self.eps, 0, nt)
            q = self.q(qan.data_ptr(), nt, N)
        else:
            q = self.q(x_addr, nt, N)
        kv = self.kv_a(x_addr, nt, N)                                 # [N, L + pe]
        kvc = kv[:, :L].contiguous()
        c = torch.empty(N, L)
        F.rms_norm(kvc.data_ptr(), self.kv_a_norm.data_ptr(), 0, c.data_ptr(), N, L, self.eps, 0, nt)
        q4 = q.view(N, H, self.qk)
        q_abs = self._absorb(q4, nt)                                  # absorb_q_rows: [N, H, L]
        lat = torch.empty(N, H, L)
        for j, cache in enumerate(caches):     # attend_latent, one row: append, then attend over all
            cache.append(c[j].view(1, 1, L), kv[j, L:].view(1, 1, pe))
            K = cache.keys()
            Qj = torch.cat((q_abs[j][None, None], q4[j, :, nope:][None, None]), dim=-1).view(1, H, L + pe)
            scores = torch.bmm(Qj, K.transpose(1, 2)).mul_(self.scale)
            torch.bmm(torch.softmax(scores, dim=-1), K[..., :L], out=lat[j:j + 1])
        out = self._value(lat, nt)                                    # value_rows: [N, H * v]
        if self.g is not None:
            out = out * torch.sigmoid(self.g(x_addr, nt, N))
        return self.o(out.data_ptr(), nt, N)

    def _absorb(self, q4: Tensor, nt: int) -> Tensor:
        """absorb_q's native head product of the rows' q [N, H, qk] (its ggml arithmetic: no input
        rounding), on the layout it makes ([H, N, nope] -> [H, N, L]): q_abs [N, H, L] (a view)."""
        H, nope, L, N = self.H, self.nope, self.L, q4.shape[0]
        heads = self.heads
        q_nope = q4[:, :, :nope].transpose(0, 1).contiguous()
        q_abs = torch.empty(H, N, L)
        kq._qmatmul.matmul_heads(int(heads.k_b.qtype), heads.k_b._raw_np, kq.buf(q_nope), kq.buf(q_abs), H, L,
                                 nope, N, self.k_stride, 1, -1, nt)
        return q_abs.transpose(0, 1)

    def _value(self, lat: Tensor, nt: int) -> Tensor:
        """value_heads' native head product of the attended latents [N, H, L] (any view), on the
        layout it makes ([H, N, L] -> [H, N, v]): [N, H * v]."""
        H, L = self.H, self.L
        N = lat.numel() // (H * L)
        heads = self.heads
        lat_h = lat.reshape(N, H, L).transpose(0, 1).contiguous()
        values = torch.empty(H, N, self.v)
        kq._qmatmul.matmul_heads(int(heads.v_b.qtype), heads.v_b._raw_np, kq.buf(lat_h), kq.buf(values), H,
                                 self.v, L, N, self.v_stride, 1, -1, nt)
        return values.transpose(0, 1).reshape(N, H * self.v)

    def _rows(self, x_addr: int, cache: MLACache, nt: int, T: int, q: Tensor, kv: Tensor) -> Tensor:
        """T > 1 rows: MLA.forward's own steps from the projections on (fresh tensors)."""
        H, nope, L = self.H, self.nope, self.L
        c = torch.empty(T, L)
        kvc = kv[:, :L].contiguous()
        kfused._fused.rms_norm(
            kvc.data_ptr(), self.kv_a_norm.data_ptr(), 0, c.data_ptr(), T, L, self.eps, 0, nt
        )
        offset = cache.length
        cache.append(c.view(1, T, L), kv[:, L:].view(1, T, self.pe))
        K = cache.keys()
        q4 = q.view(T, H, self.qk)
        Q = torch.cat((self._absorb(q4, nt), q4[:, :, nope:]), dim=-1).view(1, T, H, L + self.pe)
        if T <= mla_ops.ROWWISE_MAX:
            lat = self._attend_rows(Q, K, offset, T)
        else:
            lat = mla_ops.attend(Q, K, K[..., :L], offset, self.scale)
        out = self._value(lat, nt)
        if self.g is not None:
            out = out * torch.sigmoid(self.g(x_addr, nt, T))
        return self.o(out.data_ptr(), nt, T)


    def _attend_rows(self, Q: Tensor, K: Tensor, offset: int, T: int) -> Tensor:
        """mla.attend of a verify block (T <= ROWWISE_MAX): each row a decode row over the columns
        it sees, the same products on the same views, written in place of the rows' concatenation."""
        H, C, L = self.H, self.L + self.pe, self.L
        lat = torch.empty(1, T, H, L)
        Kt, c_all = K.transpose(1, 2), K[..., :L]
        scale = self.scale
        for a, (qa, out) in enumerate(zip(Q.view(T, 1, H, C).unbind(0), lat.view(T, 1, H, L).unbind(0),
                                          strict=True)):
            n = offset + a + 1
            scores = torch.bmm(qa, Kt[..., :n]).mul_(scale)
            torch.bmm(torch.softmax(scores, dim=-1), c_all[:, :n], out=out)
        return lat
