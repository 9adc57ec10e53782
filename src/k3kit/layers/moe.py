"""RoutedMoE: the one way routed experts are run, for every architecture and every caller.

A batch of N rows with top-k routing names N*k (row, slot) pairs but usually far fewer
distinct experts; for experts streamed from a file the distinct set is the cost (bytes read
and matrices multiplied). So every MoE runs its experts the same way:

  route    the architecture's router gives ids [N, k] and weights [N, k] (routers differ:
           softmax or sigmoid, bias, groups; they stay with the model)
  group    one stable sort of the N*k pairs by expert (`group_routes`): each expert's pairs
           come out in row-major order, as nonzero(ids == e) would give them
  plan     the distinct experts, in the order they will be fetched, go to the provider's
           optional `plan(layer, experts)` first: a store can read the next miss while the
           current expert computes; then, if the architecture guessed a later layer's experts
           (`prefetch=`), the provider's optional `prefetch(layer, experts)`: a store can read
           them while this layer and the trunk up to that one compute
  run      each distinct expert is fetched once (`ExpertProvider.get`) and runs all its rows
           as one matrix
  scatter  each pair's weighted output lands in its own slot of [N, k, d] and the k slots
           are added left to right (top-k order, as ggml adds them); `exact_order=False`
           index_adds into [N, d] instead (k times less scratch, expert-id summation order)

The rows of a pass may come from any number of sequences: grouping does not care where a row
came from, which is what lets one pass serve several users with one read per expert. The
per-row result equals a per-row loop up to the BLAS blocking of an n-row matmul vs a 1-row
one (bitwise for row-independent experts, see tests/layers/test_moe.py).

Training (`batched = True`, experts held by the module, no provider): the same grouping feeds
a zero-padded [E, capacity, d] batch (capacity = the busiest expert's load, nothing dropped)
run with three bmm; slots are summed as above. Same function, fewer kernels.

An architecture subclasses RoutedMoE (the expert tensors `gate_exps`/`up_exps`/`down_exps`
[E, ff, d] / [E, d, ff], torch Linear layout, keep their names in its state dict), writes its
own `forward` (router, projections, shared experts around `run_experts`) and overrides the
hooks that differ: `act` (SwiGLU by default), `expert_weights` / `stacked_weights` (e.g.
fake quantization), `expert` (the whole per-expert function).

Layers never import the runtime: an engine's expert store reaches `run_experts` through the
`ExpertProvider` protocol below (its `plan(layer, ids)` has the store's signature), and a
store's quantized weights through `MatmulWeight`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3kit.kernels import fused, gpu
from k3kit.kernels import threads as kthreads
from k3kit.kernels.qmatmul import QuantizedMatrix, experts_fusable, experts_matmul_q8

# Rows per expert up to which a provider's resident experts run fused (`RoutedMoE._run_fused`):
# what fusing saves is per-call work (quantizing x per matrix, a fork and join per product), which
# matters for decode rows and small serving passes; an expert with more rows (prefill) runs alone, where
# matmul_q8 may take paths of its own for many rows (e.g. AMX tiles).
FUSED_MAX_ROWS = 8
# Experts whose matrices hold at most this many weights run fused at any row count: their
# products are microseconds of arithmetic, less than a call's own cost (the mini's 128 x 64
# experts: a 55-row pass after a long restored prompt 33 -> 25 ms); K3's are 1,000x larger.
FUSED_SMALL_WEIGHTS = 1 << 14
# Routed rows per expert up to which experts kept for the Triton kernels run as one grouped GEMV
# launch per projection (kernels.gpu.GEMV_MAX_ROWS: beyond it a product is a tiled GEMM).
GROUPED_MAX_ROWS = 16


class MatmulWeight(Protocol):
    """A weight that multiplies itself (e.g. one kept quantized by an engine's expert store)."""

    def matmul(self, x: Tensor) -> Tensor:
        """x [n, in] -> x @ W.T [n, out] in x's dtype."""
        ...


class ExpertWeights(NamedTuple):
    """One routed expert in torch Linear layout ([out, in]): float tensors or MatmulWeights."""

    gate: Tensor | MatmulWeight   # [ff, d_in]  (HF w1)
    up: Tensor | MatmulWeight     # [ff, d_in]  (HF w3)
    down: Tensor | MatmulWeight   # [d_in, ff]  (HF w2)


class ExpertProvider(Protocol):
    """Source of routed-expert weights. `run_experts` asks once per distinct expert per call.

    A provider may also have `plan(layer, experts: Sequence[int])`: it is then told, before
    the first `get` of a call, which experts will be asked for and in what order (a store can
    read the next one while the current one computes); and `prefetch(layer, experts)`: told
    right after the plan which experts of a later layer will probably be asked for (a guess:
    it may read them, never changes what `get` returns); and `resident(layer, experts) -> bool`:
    whether all of them can be fetched and held at once (nothing read, nothing evicted), which
    lets `run_experts` run them in two native products (`_run_fused`) instead of one expert
    after another; `get_all(layer, experts) -> list[ExpertWeights]`: `get` of each, in one
    call (the fused path asks it when it has it); and `take_resident(layer, experts)`: the plan
    and `get_all` in one step when every one of them is held and nothing is being read (else
    None, and nothing done), asked first by the fused path; and `device(layer)`: where that
    layer's experts are multiplied, when not where the rows are (experts kept in RAM under a
    trunk on a GPU): `run_experts` moves the rows there and the result back."""

    def get(self, layer: int, expert: int) -> ExpertWeights: ...


@dataclass
class RouteGroups:
    """The (row, slot) pairs of a routing, grouped by expert with one stable sort. The index
    tensors other than `order` are made when a path asks for them (a decode step's fused path
    needs none of them)."""

    ids: Tensor          # [N, k] the routing
    experts: list[int]   # the distinct experts, ascending (the fetch order)
    counts: list[int]    # pairs per expert, same order
    host_order: list[int] | None = None    # `order` on the host, where grouped there
    device_order: Tensor | None = None     # `order`, where grouped on the ids' device

    @cached_property
    def order(self) -> Tensor:
        """[N*k] pair indices n*k + j, grouped by expert, row-major within one"""
        if self.device_order is not None:
            return self.device_order
        return torch.tensor(self.host_order, device=self.ids.device)

    @cached_property
    def host_rows(self) -> list[int] | None:
        """order // k on the host, where grouped there"""
        k = self.ids.shape[1]
        return None if self.host_order is None else [i // k for i in self.host_order]

    @cached_property
    def sorted_ids(self) -> Tensor:
        """[N*k] ids.reshape(-1)[order]"""
        return self.ids.reshape(-1)[self.order]

    @cached_property
    def rows(self) -> Tensor:
        """[N*k] order // k"""
        return self.order // self.ids.shape[1]

    @cached_property
    def cols(self) -> Tensor:
        """[N*k] order % k"""
        return self.order % self.ids.shape[1]


# Pairs up to which a routing is grouped on the host: one read of the ids and a sort in Python
# (a few microseconds for a decode or verify pass) instead of six tensor ops and a read.
HOST_GROUP_PAIRS = 512


def group_routes(ids: Tensor) -> RouteGroups:
    """Group the pairs of `ids` [N, k] by expert."""
    N, k = ids.shape
    if N * k <= HOST_GROUP_PAIRS:
        # the one host read of a routing (the store needs the expert ids on the host)
        vals = [e for row in ids.tolist() for e in row]
        order = sorted(range(N * k), key=vals.__getitem__)       # stable, as argsort(stable=True)
        experts: list[int] = []
        counts: list[int] = []
        for i in order:
            e = vals[i]
            if experts and experts[-1] == e:
                counts[-1] += 1
            else:
                experts.append(e)
                counts.append(1)
        return RouteGroups(ids, experts, counts, host_order=order)
    flat = ids.reshape(-1)
    order_t = torch.argsort(flat, stable=True)
    sorted_ids = flat[order_t]
    uniq, counts_t = torch.unique_consecutive(sorted_ids, return_counts=True)
    # the one host read of a routing: one copy
    host = torch.cat((uniq, counts_t)).tolist()
    n = uniq.numel()
    groups = RouteGroups(ids, host[:n], host[n:], device_order=order_t)
    groups.sorted_ids = sorted_ids       # made anyway: kept
    return groups


class ModuleExperts:
    """The default provider: a RoutedMoE's own parameters, through its `expert_weights`."""

    def __init__(self, moe: RoutedMoE):
        self.moe = moe

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.moe.expert_weights(expert)


class RoutedMoE(nn.Module):
    """The routed experts of one MoE layer and the one way they are run (module docstring)."""

    def __init__(self, n_experts: int, d_in: int, d_ff: int, layer: int, with_experts: bool = True):
        """`with_experts=False` leaves the expert tensors out: `run_experts` then needs a provider
        (a 2.8T model's experts never live in module parameters)."""
        super().__init__()
        self.layer = layer
        self.n_experts = n_experts
        self.d_in, self.d_ff = d_in, d_ff
        self.has_experts = with_experts
        if with_experts:
            self.gate_exps = nn.Parameter(torch.zeros(n_experts, d_ff, d_in))
            self.up_exps = nn.Parameter(torch.zeros(n_experts, d_ff, d_in))
            self.down_exps = nn.Parameter(torch.zeros(n_experts, d_in, d_ff))
        # training speed: own experts run as three bmm over all experts (use when no provider)
        self.batched = False
        self.exact_order = True
        # rounding applied to every expert matmul's input, as ggml-cpu does for quantized weights
        # (llama.cpp parity checks only); while set, the per-expert path runs even when batched
        self.input_round: Callable[[Tensor], Tensor] | None = None
        # rows routed to each expert since `count_routes()` (int64 [n_experts]); None: not counted
        self.route_counts: Tensor | None = None

    # -- hooks an architecture overrides ---------------------------------------------------
    def act(self, gate: Tensor, up: Tensor) -> Tensor:
        """The gated activation between the two halves of an expert: SwiGLU."""
        return F.silu(gate) * up

    def expert(self, x: Tensor, w: ExpertWeights) -> Tensor:
        """One expert on its rows x [n, d]: down(act(gate x, up x)) -> [n, d]."""
        r = self.input_round
        z = r(x) if r is not None else x
        h = self.act(_matmul(z, w.gate), _matmul(z, w.up))
        if r is not None:
            h = r(h)
        return _matmul(h, w.down)

    def expert_weights(self, expert: int) -> ExpertWeights:
        """Expert `expert` from the module's own tensors (the default provider's answer)."""
        return ExpertWeights(self.gate_exps[expert], self.up_exps[expert], self.down_exps[expert])

    def stacked_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """All own experts at once, gate/up [E, ff, d] and down [E, d, ff] (the batched path)."""
        return self.gate_exps, self.up_exps, self.down_exps

    def count_routes(self, on: bool = True) -> None:
        """Start (or restart) counting the rows routed to each expert in `route_counts`, or stop
        (`on=False`, counts dropped). Every (row, slot) pair counts once, whichever path runs."""
        self.route_counts = torch.zeros(self.n_experts, dtype=torch.int64) if on else None

    # -- the one implementation ---------------------------------------------------------------
    def batched_for(self, experts: ExpertProvider | None) -> bool:
        """Whether `run_experts(..., experts)` takes the batched training path."""
        return experts is None and self.batched and self.has_experts and self.input_round is None

    def run_experts(self, x: Tensor, ids: Tensor, weights: Tensor,
                    experts: ExpertProvider | None = None,
                    prefetch: tuple[int, Sequence[int]] | None = None) -> Tensor:
        """sum_j weights[n, j] * E_{ids[n, j]}(x[n]) for x [N, d], ids and weights [N, k] -> [N, d].

        `experts` None: the module's own experts (an error if it was built without them).
        `prefetch` (layer, experts): a guess at a later layer's experts, passed to the
        provider's `prefetch` after this layer's plan (ignored without a provider)."""
        if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
            shapes = f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)}, x {tuple(x.shape)}"
            raise ValueError(f"layer {self.layer}: {shapes} disagree")
        home = self.experts_device(experts, x)
        if home != x.device:         # the experts live elsewhere: the rows go there, the sum comes back
            return self.run_experts(x.to(home), ids.to(home), weights.to(home), experts,
                                    prefetch).to(x.device)
        if self.route_counts is not None:
            counts = torch.bincount(ids.reshape(-1), minlength=self.n_experts)
            self.route_counts += counts.to(self.route_counts.device)
        groups = group_routes(ids)
        if experts is None:
            if not self.has_experts:
                raise ValueError(f"layer {self.layer}: built without routed experts; pass an ExpertProvider")
            if self.batched_for(None):
                return self._run_batched(x, groups, weights)
            experts = ModuleExperts(self)
        return self._run_each(x, groups, weights, experts, prefetch)

    def experts_device(self, experts: ExpertProvider | None, x: Tensor) -> torch.device:
        """Where `experts` multiply this layer's rows: the provider's `device(layer)`, else x's."""
        where = getattr(experts, "device", None)
        return where(self.layer) if where is not None else x.device

    def _run_each(self, x: Tensor, groups: RouteGroups, weights: Tensor, experts: ExpertProvider,
                  prefetch: tuple[int, Sequence[int]] | None = None) -> Tensor:
        """Fetch each distinct expert once, in plan order, and run all its rows together."""
        N, k = weights.shape
        plain = self.exact_order and self.input_round is None and type(self).expert is RoutedMoE.expert
        most = max(groups.counts, default=0)       # rows of the busiest expert
        fusable = plain and x.device.type == "cpu" and (most <= FUSED_MAX_ROWS or self._small_experts())
        # experts kept as their bytes for the Triton kernels: one grouped launch per projection
        groupable = plain and most <= GROUPED_MAX_ROWS
        # all cached, nothing in flight: the plan and the fetches in one step (a decode step's usual case)
        take = getattr(experts, "take_resident", None) if fusable else None
        fetched: list[ExpertWeights] | None = take(self.layer, groups.experts) if take is not None else None
        plan = getattr(experts, "plan", None)
        if plan is not None and fetched is None:
            plan(self.layer, groups.experts)
        hint = getattr(experts, "prefetch", None)
        if prefetch is not None and hint is not None:
            hint(*prefetch)
        resident = getattr(experts, "resident", None)
        if fetched is None and (fusable or groupable) and resident is not None \
                and resident(self.layer, groups.experts):
            get_all = getattr(experts, "get_all", None)
            fetched = (get_all(self.layer, groups.experts) if get_all is not None
                       else [experts.get(self.layer, e) for e in groups.experts])
        if fetched is not None:
            y = self._run_together(x, groups, weights, fetched, fusable, groupable)
            if y is not None:
                return y
        return self._run_one_by_one(x, groups, weights, experts, fetched)

    def _run_together(self, x: Tensor, groups: RouteGroups, weights: Tensor, fetched: list[ExpertWeights],
                      fusable: bool, groupable: bool) -> Tensor | None:
        """The fetched experts in two native products or two grouped launches, summed into their
        rows; None where neither applies (then `_run_one_by_one`)."""
        N, k = weights.shape
        y = self._run_fused(x, groups, fetched) if fusable else None     # the CPU's native weights
        if y is None and groupable:
            y = self._run_grouped(x, groups, fetched)
        if y is None:
            return None
        order = groups.host_order if groups.host_order is not None else groups.order
        if (summed := fused.slot_sum(y, order, weights)) is not None:
            return summed          # one native pass: the same products and sums as below
        slots = x.new_zeros(N, k, x.shape[-1])
        slots.index_put_((groups.rows, groups.cols), y * weights[groups.rows, groups.cols, None])
        return _sum_slots(slots)

    def _run_one_by_one(self, x: Tensor, groups: RouteGroups, weights: Tensor, experts: ExpertProvider,
                        fetched: list[ExpertWeights] | None) -> Tensor:
        """Each expert's rows as one product after another (`expert`), fetched now unless given."""
        N, k = weights.shape
        if self.exact_order:
            slots = x.new_zeros(N, k, x.shape[-1])
        else:
            out = x.new_zeros(N, x.shape[-1])
        start = 0
        for i, (e, c) in enumerate(zip(groups.experts, groups.counts, strict=True)):
            rows, cols = groups.rows[start:start + c], groups.cols[start:start + c]
            start += c
            w = fetched[i] if fetched is not None else experts.get(self.layer, e)
            y = self.expert(x[rows], w) * weights[rows, cols, None]
            if self.exact_order:
                slots.index_put_((rows, cols), y)      # every pair owns its slot: no accumulation
            else:
                out.index_add_(0, rows, y)
        if not self.exact_order:
            return out
        return _sum_slots(slots)

    def _small_experts(self) -> bool:
        """Whether each expert matrix holds at most FUSED_SMALL_WEIGHTS weights."""
        return self.d_in * self.d_ff <= FUSED_SMALL_WEIGHTS

    def _run_fused(self, x: Tensor, groups: RouteGroups, fetched: list[ExpertWeights]) -> Tensor | None:
        """Every expert's rows in two native products (gate and up together, then down), rows in
        grouped order [N*k, d]; None when the weights are not all native ggml-arithmetic matrices
        of one type per projection. Each expert's output has the bits of `expert` on its rows:
        the products are row-invariant in that arithmetic (the same kernels per row count) and
        `act` runs per expert on the same tensors as there."""
        gates, ups, downs = ([w[i] for w in fetched] for i in range(3))
        if not (experts_fusable(downs) and experts_fusable(gates + ups)):
            return None
        qg, qu, qd = (cast(list[QuantizedMatrix], m) for m in (gates, ups, downs))
        counts = groups.counts
        pairs = [[g, u] for g, u in zip(qg, qu, strict=True)]
        if groups.host_rows is not None:       # each routed row read where it is
            gu = experts_matmul_q8(pairs, x, counts, groups.host_rows, checked=True)
        else:
            gu = experts_matmul_q8(pairs, x[groups.rows], counts, checked=True)
        if x.dtype != torch.float32:
            gu = gu.to(x.dtype)
        g, u = gu.unbind(0)
        if _whole_vectors(g):
            h = self.act(g, u)                  # one call for all experts: the same bits, fewer ops
        else:
            h = torch.empty(gu.shape[1], gu.shape[-1], dtype=x.dtype)
            start = 0
            for c in counts:   # per expert: an elementwise kernel's bits may depend on its length
                h[start:start + c] = self.act(gu[0, start:start + c], gu[1, start:start + c])
                start += c
        y = experts_matmul_q8([[d] for d in qd], h, counts, checked=True)[0]
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _run_grouped(self, x: Tensor, groups: RouteGroups, fetched: list[ExpertWeights]) -> Tensor | None:
        """Every expert's rows through the Triton kernels in two grouped launches (gate and up
        together, then down), rows in grouped order [N*k, d]; None unless every weight is a
        `kernels.gpu.TritonMatrix`, one type and shape per projection. A pair's row is the GEMV
        program `expert` runs for it (`_gemv` per row), and `act` runs as `_run_fused` runs it:
        each output has `expert`'s bits."""
        if not isinstance(fetched[0].gate, gpu.TritonMatrix):
            return None
        gates, ups, downs = ([w[i] for w in fetched] for i in range(3))
        if not all(isinstance(m, gpu.TritonMatrix) for m in gates + ups + downs):
            return None
        kinds = [{(m.qtype, m.in_features, m.out_features) for m in cast(list[gpu.TritonMatrix], ms)}
                 for ms in (gates + ups, downs)]
        if any(len(kd) != 1 for kd in kinds):
            return None
        (qgu, d_in, d_ff), (qd, _, d_out) = (next(iter(kd)) for kd in kinds)
        counts = groups.counts
        rows = groups.host_rows if groups.host_rows is not None else groups.rows.tolist()
        mat = [i for i, c in enumerate(counts) for _ in range(c)]
        e, p = len(counts), len(mat)
        mats = cast(list[gpu.TritonMatrix], gates + ups)
        gu = gpu.grouped_gemv(x, [m.raw for m in mats], mat + [e + i for i in mat], list(rows) * 2, qgu,
                              d_in, d_ff).to(x.dtype)
        g, u = gu[:p], gu[p:]
        if x.device.type != "cpu" or _whole_vectors(g):
            h = self.act(g, u)
        else:
            h = torch.empty(p, d_ff, dtype=x.dtype)
            start = 0
            for c in counts:   # per expert: an elementwise kernel's bits may depend on its length
                h[start:start + c] = self.act(g[start:start + c], u[start:start + c])
                start += c
        down = cast(list[gpu.TritonMatrix], downs)
        y = gpu.grouped_gemv(h, [m.raw for m in down], mat, list(range(p)), qd, d_ff, d_out)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _run_batched(self, x: Tensor, groups: RouteGroups, weights: Tensor) -> Tensor:
        """All own experts as three bmm over a zero-padded [E, capacity, d] batch."""
        N, k = weights.shape
        gate, up, down = self.stacked_weights()
        E, d = gate.shape[0], x.shape[-1]
        order, sorted_e = groups.order, groups.sorted_ids
        counts = torch.bincount(sorted_e, minlength=E)
        cap = int(counts.max())
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(order.numel(), device=x.device) - starts[sorted_e]
        xin = x.new_zeros(E, cap, d)
        xin[sorted_e, pos] = x[groups.rows]
        h = self.act(torch.bmm(xin, gate.transpose(1, 2)), torch.bmm(xin, up.transpose(1, 2)))
        yout = torch.bmm(h, down.transpose(1, 2))                # [E, cap, d]
        slots = x.new_zeros(N * k, d)
        slots = slots.index_copy(0, order, yout[sorted_e, pos]) * weights.reshape(-1, 1)
        return _sum_slots(slots.view(N, k, d))


# torch's elementwise CPU loops run 2 SIMD vectors per iteration (32 float32 with AVX-512) and the
# tail past the last whole pair in scalar code, whose transcendental functions (tanh, sigmoid) round
# differently; below this many elements a tensor is never split between threads (at::GRAIN_SIZE).
_VECTOR_ELEMS = 64
_GRAIN = 32768


def _whole_vectors(x: Tensor) -> bool:
    """Whether an elementwise op over the contiguous rows `x` [n, w] gives every row the bits it
    gets alone: w a multiple of the widest vector pair (no row has a scalar tail) and one chunk
    of work (no thread split inside a row)."""
    return (x.is_contiguous() and x.shape[-1] % _VECTOR_ELEMS == 0
            and (x.numel() < _GRAIN or kthreads.native() == 1))


def _sum_slots(slots: Tensor) -> Tensor:
    """[N, k, d] -> [N, d], the k slots added one after another as ggml adds them."""
    parts = slots.unbind(1)          # one op for all k views (k selects otherwise)
    y = parts[0]
    for p in parts[1:]:
        y = y + p
    return y


def _matmul(x: Tensor, weight: Tensor | MatmulWeight) -> Tensor:
    """x [n, in] @ weight[out, in].T. One row (decode: each expert sees one token) goes through
    a matrix-vector product, ~30% faster than the 1-row matmul for K3-sized bf16 experts."""
    if not isinstance(weight, Tensor):
        return weight.matmul(x)
    if x.shape[0] == 1 and not torch.is_grad_enabled():
        return torch.mv(weight, x[0]).unsqueeze(0)
    return x @ weight.t()

