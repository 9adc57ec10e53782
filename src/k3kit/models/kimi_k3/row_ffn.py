"""The row steps' feed-forward sub-layers (`row_step.RowStep`): K3's dense FFN and latent MoE on
T rows of one sequence, each calling the native functions and torch ops its module's forward
calls, in the same order with the same arguments (so with the same bits), on buffers of its own
for a single row. The attention sub-layers and the products they share are in row_layers."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from k3kit.kernels import fused as kfused
from k3kit.kernels import qmatmul as kq
from k3kit.layers.moe import (
    FUSED_MAX_ROWS,
    GROUPED_MAX_ROWS,
    RoutedMoE,
    RouteGroups,
    _whole_vectors,
    group_routes,
)

from .model import _row_product as row_product
from .moe import _WEIGHT_SUM_MIN, DenseFFN, LatentMoE, route
from .row_layers import FusedProducts, Product, Unfit, Vec, empty, f32


class DenseLayer:
    """DenseFFN.forward on T rows."""

    def __init__(self, ffn: DenseFFN):
        cfg = ffn.cfg
        self.gu = FusedProducts((ffn.gate_proj, ffn.up_proj))
        self.down = Product(ffn.down_proj)
        self.n = self.gu.n_out
        self.h = Vec(self.n)
        self.beta, self.lb = cfg.situ_beta, cfg.situ_linear_beta
        self.one_addrs = (self.gu.out.data_ptr(), self.gu.out[1].data_ptr(), self.h.addr)   # a row's buffers

    def __call__(self, x_buf: Any, nt: int, T: int = 1) -> Tensor:
        y = self.gu(x_buf, nt, T)
        if T == 1:
            g, u, h = self.one_addrs
            kfused._fused.situ(g, u, h, self.n, self.beta, self.lb, nt)
            return self.down(h, nt, 1)
        ht = torch.empty(T, self.n)
        kfused._fused.situ(y.data_ptr(), y[1].data_ptr(), ht.data_ptr(), T * self.n, self.beta, self.lb, nt)
        return self.down(ht.data_ptr(), nt, T)


def host_weights(probs: Tensor, ids: Sequence[int], cfg: Any) -> array:
    """route's weights of one row from its sigmoid scores probs [1, E] and its chosen ids, on
    the host with the same floats: the scores' sum in double in slot order, rounded once to float
    (moe.weight_sum), clamped, each score divided by it and times the scaling factor, each result
    rounded to float. A double quotient or product of two floats, rounded to float, is the float
    operation's own result (53 bits hold twice 24 and 2 more), so no step differs from torch's.
    Four torch ops a MoE layer fewer for a decode row."""
    row = probs.numpy()[0] if probs.dtype == torch.float32 and probs.is_contiguous() else \
        probs.float().contiguous().numpy()[0]
    p = [float(row[i]) for i in ids]
    if cfg.moe_renormalize:
        acc = 0.0
        for v in p:
            acc += v
        s = array("f", (acc,))[0]
        if not s >= _WEIGHT_SUM_MIN and s == s:      # clamp_min, NaN passing through as torch's
            s = _WEIGHT_SUM_MIN
        p = array("f", [v / s for v in p]).tolist()
    f = cfg.routed_scaling_factor
    if f not in (0.0, 1.0):
        f32 = array("f", (f,))[0]
        p = [v * f32 for v in p]
    return array("f", p)


def weights_tensor(w: array) -> Tensor:
    """host_weights as route's [1, k] tensor (the floats as they are)."""
    return torch.tensor(w.tolist(), dtype=torch.float32).view(1, len(w))


def _fused_lists(fetched: Sequence[Any]) -> tuple[int, list[Any], int, list[Any]] | None:
    """The two native expert products' arguments for `fetched` experts (gate, up, down each), in
    one pass: (the gate/up type, their bytes interleaved, the down type, the downs' bytes); None
    unless kq.experts_fusable holds for the gates with the ups and for the downs."""
    key_gu, key_d = (getattr(m, "_fuse_key", None) for m in fetched[0][::2])
    if key_gu is None or key_d is None:
        return None
    flat: list[Any] = []
    downs: list[Any] = []
    for g, u, dn in fetched:
        if getattr(g, "_fuse_key", None) != key_gu or getattr(u, "_fuse_key", None) != key_gu \
                or getattr(dn, "_fuse_key", None) != key_d:
            return None
        flat += (g._raw_np, u._raw_np)
        downs.append(dn._raw_np)
    return key_gu[0], flat, key_d[0], downs


class MoeLayer:
    """LatentMoE.forward on T rows whose trunk is on the CPU: the router's torch ops; for one row
    the cached experts' two native products, SiTU and the slot sum, else (or experts not all
    cached) the module's `run_experts`."""

    def __init__(self, moe: LatentMoE, segments: bool = False):
        cfg = moe.cfg
        self.segments = segments        # forward_segments' arithmetic: the router's product row by row
        if (
            moe.input_round is not None
            or not moe.exact_order
            or type(moe).expert is not RoutedMoE.expert
            or moe.router.ggml_input is not None
        ):
            raise Unfit("a MoE layer with ggml input rounding or its own expert function")
        self.moe = moe
        self.layer = moe.layer
        self.k = cfg.num_experts_per_tok
        self.router_w = moe.router.weight
        self.router_wt = moe.router.weight.t()          # a view: the weight's own floats
        # forward_segments' product of one row (row_product's bmm on the same views) into a buffer
        self.router_wt3 = self.router_wt.expand(1, *self.router_wt.shape)
        self.probs = empty(1, cfg.num_experts)
        self.probs3 = self.probs.view(1, 1, cfg.num_experts)
        self.router_bias = moe.router.bias
        E = cfg.num_experts
        bias = self.router_bias
        # a row's biased scores, where the bias is E contiguous floats: torch.add's sums, natively
        self.scores = empty(1, E) if bias.dtype == torch.float32 and bias.is_contiguous() \
            and bias.numel() == E else None
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.beta, self.lb = cfg.situ_beta, cfg.situ_linear_beta
        self.down = Product(moe.routed_down) if moe.routed_down is not None else None
        self.up = Product(moe.routed_up) if moe.routed_up is not None else None
        self.norm = f32(moe.routed_norm.detach(), "routed norm") if moe.routed_norm is not None else None
        self.shared = DenseLayer(moe.shared) if moe.shared is not None else None
        self.d, self.ff = moe.d_in, moe.d_ff
        k, d, ff = self.k, self.d, self.ff
        self.gu = empty(2, k, ff)
        self.gu_buf = kq.buf(self.gu)
        self.h = empty(k, ff)
        self.h_buf = kq.buf(self.h)
        self.y = empty(1, k, d)
        self.y_buf = kq.buf(self.y)
        self.summed = empty(1, d)
        self.normed = empty(1, d)
        self.out = empty(1, cfg.hidden_size)
        self.out_addr = self.out.data_ptr()
        self.ones = [1] * k
        self.zeros = [0] * k
        # a row's fixed addresses, and whether its gate rows are whole vectors (checked once)
        self.one_addrs = (self.gu.data_ptr(), self.gu[1].data_ptr(), self.h.data_ptr(), self.y.data_ptr(),
                          self.summed.data_ptr())
        self.one_whole = _whole_vectors(self.gu[0])

    def _experts(
        self,
        xl: Tensor,
        xl_buf: Any,
        ids: Tensor,
        w: Tensor | None,
        probs: Tensor,
        experts: Any,
        guess: tuple[int, list[int]] | None,
        nt: int,
        T: int,
    ) -> Tensor:
        """run_experts(xl, ids, w, experts, guess) for T rows: with every expert cached, the calls
        of `_run_each` -> `_run_together` -> `_run_fused` -> slot_sum on the same arguments
        (so the same bits), without their checks and index tensors; one row through `_one`, on
        the row's buffers (`w` None: route's weights are made here from `probs` and the ids read)."""
        moe, k = self.moe, self.k
        take = getattr(experts, "take_resident", None)
        one = T == 1
        order: list[int] | None
        rows: list[int] | None
        if one:
            vals = ids.tolist()[0]  # the one host read of the routing
            wa = host_weights(probs, vals, self.cfg)
            if take is None or xl.dtype != torch.float32 or not xl.is_contiguous():
                return moe.run_experts(xl, ids, weights_tensor(wa), experts, guess)
            order = sorted(range(k), key=vals.__getitem__)
            chosen = [vals[i] for i in order]
            if len(set(chosen)) != k:
                return moe.run_experts(xl, ids, weights_tensor(wa), experts, guess)
            fetched = take(self.layer, chosen)
            if fetched is not None and (y := self._one(xl_buf, fetched, chosen, order, wa, experts, guess,
                                                       nt)) is not None:
                return y
            w = weights_tensor(wa)
            groups = RouteGroups(ids, chosen, list(self.ones), host_order=order)   # group_routes' groups
            rows = None
        else:
            assert w is not None
            if take is None or xl.dtype != torch.float32 or not xl.is_contiguous():
                return moe.run_experts(xl, ids, w, experts, guess)
            groups = group_routes(ids)              # the one host read of the routing
            if max(groups.counts) > FUSED_MAX_ROWS and not moe._small_experts():
                return moe._run_each(xl, groups, w, experts, guess)
            order = groups.host_order
            rows = groups.host_rows
            fetched = take(self.layer, groups.experts)
        if fetched is None:  # a read, a plan or a guess in flight: the module's way
            return moe._run_each(xl, groups, w, experts, guess)
        hint = getattr(experts, "prefetch", None)
        if guess is not None and hint is not None:
            hint(*guess)
        P = T * k
        gu = torch.empty(2, P, self.ff)
        # one row gets here only where `_one` found a matrix that does not fuse: the module's way
        lists = None if one or order is None or rows is None else _fused_lists(fetched)
        if lists is None or order is None or not _whole_vectors(gu[0]):
            # within _run_each's row limits for the fused and the grouped ways
            y = moe._run_together(xl, groups, w, fetched, True, max(groups.counts) <= GROUPED_MAX_ROWS)
            return y if y is not None else moe._run_one_by_one(xl, groups, w, experts, fetched)
        qt_gu, flat, qt_d, downs = lists
        Q, F = kq._qmatmul, kfused._fused
        counts = groups.counts
        Q.experts_q8(qt_gu, flat, xl_buf, kq.buf(gu), counts, self.ff, self.d, 2, nt, rows)
        h = torch.empty(P, self.ff)
        F.situ(gu.data_ptr(), gu[1].data_ptr(), h.data_ptr(), P * self.ff, self.beta, self.lb, nt)
        y = torch.empty(P, self.d)
        Q.experts_q8(qt_d, downs, kq.buf(h), kq.buf(y), counts, self.d, self.ff, 1, nt, None)
        where = array("q", order)
        w = w if w.is_contiguous() else w.contiguous()
        summed = torch.empty(T, self.d)
        F.slot_sum(y.data_ptr(), where.buffer_info()[0], w.data_ptr(), summed.data_ptr(), T, k, self.d)
        return summed

    def _one(self, xl_buf: Any, fetched: Sequence[Any], chosen: list[int], order: list[int], w: array,
             experts: Any, guess: tuple[int, list[int]] | None, nt: int) -> Tensor | None:
        """The fused way of one row whose k distinct experts (`chosen`, ascending; `order` their
        slots) the store handed out (`fetched`), with its weights `w`: the calls below on the row's
        buffers, their lists made in one pass over the experts. None, with nothing run, where a
        matrix does not fuse: the general way then runs on the same `fetched`."""
        if not self.one_whole:
            return None
        lists = _fused_lists(fetched)
        if lists is None:
            return None
        qt_gu, flat, qt_d, downs = lists
        hint = getattr(experts, "prefetch", None)
        if guess is not None and hint is not None:
            hint(*guess)
        Q, F = kq._qmatmul, kfused._fused
        gu, up, h, y, summed = self.one_addrs
        Q.experts_q8(qt_gu, flat, xl_buf, self.gu_buf, self.ones, self.ff, self.d, 2, nt, self.zeros)
        F.situ(gu, up, h, self.k * self.ff, self.beta, self.lb, nt)
        Q.experts_q8(qt_d, downs, self.h_buf, self.y_buf, self.ones, self.d, self.ff, 1, nt, None)
        where = array("q", order)
        F.slot_sum(y, where.buffer_info()[0], w.buffer_info()[0], summed, 1, self.k, self.d)
        return self.summed

    def __call__(self, x: Tensor, x_buf: Any, experts: Any, nt: int, T: int) -> tuple[Tensor, Tensor]:
        """x [T, hidden] -> (output [T, hidden], expert ids [T, k])."""
        moe = self.moe
        if T == 1 and self.segments:
            probs = torch.sigmoid(torch.bmm(x.view(1, 1, -1), self.router_wt3), out=self.probs3).view(1, -1)
        else:
            probs = torch.sigmoid(row_product(x, self.router_w) if self.segments else x @ self.router_wt)
        w: Tensor | None = None
        if T == 1:         # route's ids; its weights from them on the host (`host_weights`)
            scores = self.scores
            if scores is not None:
                kfused._fused.add(probs.data_ptr(), self.router_bias.data_ptr(), scores.data_ptr(),
                                  scores.shape[1])
            else:
                scores = probs + self.router_bias
            ids = torch.topk(scores, self.k, dim=-1, sorted=True).indices
        else:
            ids, w = route(probs, self.router_bias, self.cfg)
        if self.down is not None:
            xl = self.down(x.data_ptr(), nt, T)
            xl_buf = self.down.out_buf if T == 1 else kq.buf(xl)
        else:
            xl, xl_buf = x, x_buf
        guess = moe.guess_next(x, experts)
        y = self._experts(xl, xl_buf, ids, w, probs, experts, guess, nt, T)
        if self.norm is not None:
            y = y if y.is_contiguous() else y.contiguous()
            normed = self.normed if T == 1 else torch.empty(T, self.d)
            kfused._fused.rms_norm(
                y.data_ptr(), self.norm.data_ptr(), 0, normed.data_ptr(), T, self.d, self.eps, 0, nt
            )
            y = normed
        if self.up is not None:
            y = self.up(y.data_ptr(), nt, T)
        if self.shared is not None:
            if T == 1:          # torch.add's IEEE sums, natively
                y = y if y.is_contiguous() else y.contiguous()
                kfused._fused.add(y.data_ptr(), self.shared(x_buf, nt, T).data_ptr(), self.out_addr,
                                  self.out.shape[1])
                y = self.out
            else:
                y = y + self.shared(x_buf, nt, T)
        return y, ids


