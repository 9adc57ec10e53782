"""One decode row of one sequence through a K3Model with only the Python the row needs.

A decode step of the mini K3 costs ~0.5 ms a layer on the host and ~0.03 ms in the kernels: the
arithmetic is already native (the quantized products, norms, mixes, short convs, the KDA
recurrence, SiTU, the experts' slot sum), but every call reaches it through module calls,
argument checks, shape logic and a fresh output tensor. `RowStep` is the steady AR decode step of
`K3Model.forward` (one token, one sequence, committed) for the case that dominates it: a trunk of
native ggml-arithmetic products on the CPU, float32 state. It calls the same native functions
with the same arguments, and the same torch ops where the arithmetic is torch's (sigmoid, exp,
the router's product and top-k, MLA's attention products), on buffers made once and written in
place: a row's logits and the state it leaves have the bits `forward` gives (the tests compare
them step by step). What it cannot take it leaves to `forward`: `RowStep.build` says why not once
per model (None: no row step), and `run` returns None before touching anything when a step's
conditions do not hold (another thread inside, a gradient, a state not float32 on the CPU,
routes being counted). A MoE layer whose experts are not all cached for the CPU runs the
module's own `run_experts` (reads, plans, prefetch), the rest of the step staying here.

What escapes a step is fresh: the logits, the KDA conv windows (the state keeps them) and the MLA
rows (copied into the cache). Everything else lives in the step's buffers, one set per model,
entered by one thread at a time.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from k3kit.kernels import fused as kfused
from k3kit.kernels import kda_step
from k3kit.kernels import qmatmul as kq
from k3kit.kernels import threads as kthreads
from k3kit.layers.module_hooks import HookWatch
from k3kit.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear

from .kda import KDA
from .mla import MLA
from .model import Captured, K3Layer, K3Model, K3Output, SegmentOutput
from .moe import LatentMoE
from .row_ffn import DenseLayer, MoeLayer
from .row_layers import F32, KdaLayer, MlaLayer, Product, Unfit, Vec, f32
from .state import K3State, KDAState, MLACache

# False: every row runs K3Model.forward (tests and benchmarks compare the two ways)
ENABLED = True
# rows a call takes (a decode row, a verify block, a short chunk); longer prompts run forward
MAX_ROWS = 64


def _any_set(objs: Iterable[Any], attr: str) -> bool:
    """Whether `attr` is not None on any of `objs` (one pass in C: `fits` asks it every step)."""
    return any(map(is_not, map(attrgetter(attr), objs), repeat(None)))


class RowStep:
    """`K3Model.forward` of one committed decode row of one sequence (module doc)."""

    def __init__(self, model: K3Model, segments: bool = False):
        cfg = model.cfg
        if kq._qmatmul is None or not kfused.available() or kda_step._kda is None:
            raise Unfit("the native extensions are not built")
        if not all(hasattr(kfused._fused, f) for f in ("add", "mul", "scale", "copy_rows")):
            raise Unfit("the _fused extension is an older build: pip install -e . again")
        if getattr(model, "_ggml_hooks", None):
            raise Unfit("ggml input rounding hooks are set")
        self.model, self.cfg, self.segments = model, cfg, segments
        E, n_layers = cfg.hidden_size, cfg.num_layers
        self.E, self.eps, self.bs = E, cfg.rms_norm_eps, cfg.attn_res_block_size
        self.attn: list[KdaLayer | MlaLayer] = []
        self.ffn: list[MoeLayer | DenseLayer] = []
        self.moes: list[LatentMoE] = []
        layers = cast("Sequence[K3Layer]", model.layers)
        for layer in layers:
            attn = layer.attn
            self.attn.append(KdaLayer(attn, segments) if isinstance(attn, KDA) else MlaLayer(attn))
            if isinstance(layer.ffn, LatentMoE):
                self.ffn.append(MoeLayer(layer.ffn, segments))
                self.moes.append(layer.ffn)
            else:
                self.ffn.append(DenseLayer(layer.ffn))
        weights = [
            (f32(layer.attn_norm.detach(), "attn norm"), f32(layer.ffn_norm.detach(), "ffn norm"))
            for layer in layers
        ]
        self.norm_w = [(a.data_ptr(), f.data_ptr()) for a, f in weights]
        self._keep: list[object] = list(weights)
        if self.bs > 0:
            scores = [
                (
                    f32(layer.attn_res_score.detach(), "attn-res score"),
                    f32(layer.ffn_res_score.detach(), "attn-res score"),
                )
                for layer in layers
            ]
            self._keep += scores
            self.score_w = [(a.data_ptr(), f.data_ptr()) for a, f in scores]
            out_score = f32(model.output_res_score.detach(), "output attn-res score")
            self._keep.append(out_score)
            self.out_score = out_score.data_ptr()
        self.final_norm = f32(model.norm.detach(), "final norm")
        lm = Product(model.lm_head)
        self.lm_q = (lm.qtype, lm.raw, lm.n_out, lm.n_in)
        # per layer: the stream entering it, the two mixes and norms, the stream after attention
        self.stream_in = [Vec(E) for _ in range(n_layers + 1)]
        self.mixed = [Vec(E) for _ in range(2 * n_layers + 1)]
        self.normed = [Vec(E) for _ in range(2 * n_layers + 1)]
        self.after_attn = [Vec(E) for _ in range(n_layers)]
        self.embed = self._embedding(model.embed)
        self.modules = list(model.modules())
        self.hooked = HookWatch(self.modules)
        self.routers = [m.router for m in self.moes]
        self.mlas = [layer.attn for layer in model.layers if isinstance(layer.attn, MLA)]
        self.linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        heads = [layer.attn.kv_b_heads for layer in model.layers if isinstance(layer.attn, MLA)]
        self.checked = self.linears + [h for h in heads if h is not None]
        self.plan = self._one_row_plan()
        self.lock = threading.Lock()
        self._cpu_experts: Any = None              # the provider whose experts all multiply on the CPU

    @classmethod
    def build(cls, model: K3Model, segments: bool = False) -> tuple[RowStep | None, str]:
        """(the row step, "") or (None, why there is none). `segments`: the arithmetic of
        `K3Model.forward_segments` with one segment (a serving pass of one sequence) instead of
        `forward`'s (the router's product row by row, beta's sigmoid over padded rows)."""
        if not ENABLED:
            return None, "turned off"
        try:
            return cls(model, segments), ""
        except Unfit as e:
            return None, str(e)

    def _embedding(self, emb: nn.Module) -> Callable[[Sequence[int], Tensor, int], None]:
        """What writes the tokens' embedding rows into a [T, hidden] float32 tensor:
        QuantizedEmbedding.forward's native row dequantization (and its corrupt-row check), or a
        float table's rows copied."""
        row_type = ctypes.c_char * (self.E * F32)
        if isinstance(emb, QuantizedEmbedding):
            native = emb._native_matrix()
            if native is None or native.dtype != torch.float32:
                raise Unfit("an embedding table without a native float32 row dequantizer")
            row_bytes = native.nbytes // native.out_features
            raw, qtype, E = native._raw_np, int(native.qtype), self.E
            self.n_tokens = native.out_features

            def quantized(tokens: Sequence[int], out: Tensor, nt: int) -> None:
                addr = out.data_ptr()
                for i, t in enumerate(tokens):
                    kq._qmatmul.dequantize(
                        qtype,
                        raw[t * row_bytes : (t + 1) * row_bytes],
                        row_type.from_address(addr + i * E * F32),
                        1,
                        E,
                        0,
                        -1,
                        nt,
                    )
                corrupt = emb.corrupt_row
                if corrupt is not None:
                    ok = np.isfinite(
                        np.frombuffer(memoryview(kq.buf(out)), dtype=np.float32).reshape(len(tokens), E)
                    ).all(axis=1)
                    if not ok.all():
                        corrupt(tokens[int(np.argmin(ok))])

            return quantized
        if isinstance(emb, nn.Embedding) and emb.max_norm is None:
            table = f32(emb.weight.detach(), "embedding table")
            self.n_tokens = table.shape[0]
            size = self.E * F32

            def dense(tokens: Sequence[int], out: Tensor, nt: int) -> None:
                addr, base = out.data_ptr(), table.data_ptr()
                for i, t in enumerate(tokens):
                    ctypes.memmove(addr + i * size, base + t * size, size)

            return dense
        raise Unfit(f"an embedding of type {type(emb).__name__}")

    def fits(self, state: K3State, experts: Any) -> bool:
        """Whether `run` takes this state and provider now (nothing is changed either way)."""
        return self._fits_pass(experts) and self._fits_state(state)

    def _fits_pass(self, experts: Any) -> bool:
        """`fits`' conditions on the model and the provider."""
        if torch.is_grad_enabled() or self.model.training or self.model._ggml_hooks:
            return False
        if self.hooked():               # a hook expects the modules' own calls: forward's
            return False
        if _any_set(self.moes, "input_round") or _any_set(self.routers, "ggml_input") or any(
            v is not None for m in self.mlas for v in m.ggml_inputs.values()
        ):
            return False
        if _any_set(self.checked, "check") or _any_set(self.moes, "route_counts"):
            return False
        if experts is not self._cpu_experts:       # asked once per provider: devices do not move
            where = getattr(experts, "device", None)
            if where is not None and any(where(m.layer).type != "cpu" for m in self.moes):
                return False
            self._cpu_experts = experts
        return True

    def _fits_state(self, state: K3State) -> bool:
        """`fits`' conditions on one sequence's state."""
        if state.batch != 1:
            return False
        for step, st in zip(self.attn, state.layers, strict=True):
            if isinstance(st, KDAState) != isinstance(step, KdaLayer) or not step.fit(st):  # type: ignore[arg-type]
                return False
        return True

    def run(
        self,
        tokens: Sequence[int],
        state: K3State,
        experts: Any,
        *,
        commit: bool = True,
        taps: Sequence[int] = (),
        mode: str = "raw",
        logits: str = "last",
    ) -> K3Output | None:
        """`forward(tokens [1, T], state, experts=experts, capture_layers=taps, capture_mode=mode,
        speculative=not commit, logits=logits)` for T <= MAX_ROWS token ids: the same output and
        the same state; None, with nothing done, where this step cannot run it."""
        T = len(tokens)
        if (
            not 0 < T <= MAX_ROWS
            or not all(0 <= t < self.n_tokens for t in tokens)
            or not self.lock.acquire(blocking=False)
        ):
            return None
        try:
            if not self.fits(state, experts):
                return None
            if len(tokens) == 1 and logits != "none":
                return self._run_one(tokens[0], state, experts, commit, frozenset(taps), mode)
            return self._run(tokens, state, experts, commit, frozenset(taps), mode, logits)
        finally:
            self.lock.release()

    def segment(self, tokens: Sequence[int], state: K3State, experts: Any, speculative: bool,
                taps: Sequence[int], mode: str) -> list[SegmentOutput] | None:
        """`forward_segments` of one segment (a serving pass of one sequence; a step built with
        `segments`): its output, the same floats, or None where this step cannot run it."""
        out = self.run(tokens, state, experts, commit=not speculative, taps=taps, mode=mode,
                       logits="all" if speculative else "last")
        if out is None or out.logits is None:
            return None
        feats = torch.cat([out.layer_inputs[il][0] for il in taps], dim=-1) if taps else None
        return [SegmentOutput(out.logits[0], feats, out.captured)]

    def run_segments(self, ids: Sequence[Sequence[int]], states: Sequence[K3State], experts: Any,
                     speculative: Sequence[bool] = (), capture: Sequence[bool] = (), taps: Sequence[int] = (),
                     mode: str = "raw") -> list[SegmentOutput] | None:
        """`forward_segments` of a serving pass of several sequences (a step built with `segments`):
        ids[i] after states[i], a verify block where `speculative[i]`, tap features where
        `capture[i]`. The norms, mixes, experts and LM head run over all the pass's rows at once;
        the attention per sequence, the decoding sequences' (one committed row each) as one batch.
        The same outputs and states, or None, with nothing done, where this step cannot run it."""
        n_seg = len(ids)
        lengths = [len(v) for v in ids]
        if (
            not self.segments
            or n_seg < 2
            or len(states) != n_seg
            or min(lengths) < 1
            or sum(lengths) > MAX_ROWS
            or len({id(st) for st in states}) != n_seg
            or not all(0 <= t < self.n_tokens for v in ids for t in v)
            or not self.lock.acquire(blocking=False)
        ):
            return None
        try:
            if not self._fits_pass(experts) or not all(self._fits_state(st) for st in states):
                return None
            flags = list(speculative) or [False] * n_seg
            spec = [bool(s) and n > 1 for s, n in zip(flags, lengths, strict=True)]
            cap = list(capture) or [False] * n_seg
            return self._run_segments(ids, states, experts, spec, cap, list(taps) if any(cap) else [], mode)
        finally:
            self.lock.release()

    def _run_segments(self, ids: Sequence[Sequence[int]], states: Sequence[K3State], experts: Any,
                      spec: list[bool], capture: list[bool], order: list[int],
                      mode: str) -> list[SegmentOutput]:
        F = kfused._fused
        nt = kthreads.native()
        E, eps, bs = self.E, self.eps, self.bs
        lengths = [len(v) for v in ids]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        N, row_bytes = bounds[-1], E * F32
        singles = [i for i, n in enumerate(lengths) if n == 1 and not spec[i]]
        one_rows = len(singles) == len(ids)          # decoding sequences only: their rows are the pass's
        single_rows = torch.tensor([bounds[i] for i in singles], dtype=torch.long)
        captured = [Captured(st.pos, n) if sp else None
                    for st, n, sp in zip(states, lengths, spec, strict=True)]
        for st in states:
            for c in st.mla_caches():
                c.truncate(st.pos)  # drop rows a speculative pass left behind
        stream = torch.empty(N, E)
        self.embed([t for v in ids for t in v], stream, nt)
        bank: list[int] = []  # the banked streams' addresses ...
        banked_rows: list[Tensor] = []  # ... and the tensors, alive until the pass ends
        tapped: dict[int, Tensor] = {}
        taps = frozenset(order)
        raw = mode == "raw"
        for il in range(self.cfg.num_layers):
            attn_w, ffn_w = self.norm_w[il]
            mixed = stream
            if bs > 0 and bank:
                mixed = torch.empty(N, E)
                F.res_mix(tuple(bank), stream.data_ptr(), self.score_w[il][0], mixed.data_ptr(), N, E, eps,
                          nt)
            if il in taps:
                tapped[il] = stream if raw else mixed
            banked = bs > 0 and il % bs == 0
            if banked:
                bank.append(stream.data_ptr())
                banked_rows.append(stream)
            h = torch.empty(N, E)
            F.rms_norm(mixed.data_ptr(), attn_w, 0, h.data_ptr(), N, E, eps, 0, nt)
            attn = self.attn[il]
            layer_states = [st.layers[il] for st in states]
            a = torch.empty(N, E) if not one_rows else None
            if singles:                      # the decoding sequences as one batch of rows
                hs = h if one_rows else h.index_select(0, single_rows)
                if isinstance(attn, KdaLayer):
                    kda_states = [cast(KDAState, layer_states[i]) for i in singles]
                    out = attn.decode(hs.data_ptr(), kq.buf(hs), kda_states, nt)
                else:
                    out = attn.decode(hs.data_ptr(), [cast(MLACache, layer_states[i]) for i in singles], nt)
                if a is None:
                    a = out
                else:
                    a.index_copy_(0, single_rows, out)
            for i, n in enumerate(lengths):  # the others, each its block of rows on its own state
                if n == 1 and not spec[i]:
                    continue
                assert a is not None
                x = h.data_ptr() + bounds[i] * row_bytes
                if isinstance(attn, KdaLayer):
                    o, kda_rows = attn(x, (ctypes.c_char * (n * row_bytes)).from_address(x),
                                       cast(KDAState, layer_states[i]), nt, n, not spec[i])
                    cap_i = captured[i]
                    if cap_i is not None and kda_rows is not None:
                        cap_i.kda[il] = kda_rows
                else:
                    o = attn(x, cast(MLACache, layer_states[i]), nt, n)
                a[bounds[i]:bounds[i + 1]] = o
            assert a is not None
            after = a if banked else stream + a
            mixed = after
            if bs > 0 and bank:
                mixed = torch.empty(N, E)
                F.res_mix(tuple(bank), after.data_ptr(), self.score_w[il][1], mixed.data_ptr(), N, E, eps, nt)
            h = torch.empty(N, E)
            F.rms_norm(mixed.data_ptr(), ffn_w, 0, h.data_ptr(), N, E, eps, 0, nt)
            ffn = self.ffn[il]
            f = ffn(h, kq.buf(h), experts, nt, N)[0] if isinstance(ffn, MoeLayer) else ffn(kq.buf(h), nt, N)
            stream = after + f
        final = stream
        if bs > 0 and bank:
            final = torch.empty(N, E)
            F.res_mix(tuple(bank), stream.data_ptr(), self.out_score, final.data_ptr(), N, E, eps, nt)
        n_layers = self.cfg.num_layers
        if n_layers in taps:
            tapped[n_layers] = stream if raw else final
        # the LM head's rows: every row of a verify block, the last row of any other segment
        sel = [r for i in range(len(ids))
               for r in (range(bounds[i], bounds[i + 1]) if spec[i] else [bounds[i + 1] - 1])]
        if len(sel) < N:
            final = final.index_select(0, torch.tensor(sel, dtype=torch.long))
        M = len(sel)
        normed = torch.empty(M, E)
        F.rms_norm(final.data_ptr(), self.final_norm.data_ptr(), 0, normed.data_ptr(), M, E, eps, 0, nt)
        qtype, raw_w, n_out, n_in = self.lm_q
        lg = torch.empty(M, n_out)
        kq._qmatmul.matmul_q8(qtype, raw_w, normed.data_ptr(), lg.data_ptr(), n_out, n_in, M, -1, nt, 1,
                              kq.I8_PATH)
        outs = []
        k = 0
        for i, st in enumerate(states):
            m = lengths[i] if spec[i] else 1
            feats = (torch.cat([tapped[il][bounds[i]:bounds[i + 1]] for il in order], dim=-1)
                     if capture[i] and order else None)
            outs.append(SegmentOutput(lg[k:k + m], feats, captured[i]))
            k += m
            if not spec[i]:
                st.pos += lengths[i]
        return outs

    def _one_row_plan(self) -> list[tuple[Any, ...]]:
        """Per layer, what a committed row's step passes, all fixed: the buffers' addresses, the
        banked streams' addresses at each mix (a row's streams live in stream_in / the attention
        outputs, so the bank holds the same addresses every step) and the sub-layers."""
        E, bs = self.E, self.bs
        plan: list[tuple[Any, ...]] = []
        bank: list[int] = []
        for il in range(self.cfg.num_layers):
            attn_w, ffn_w = self.norm_w[il]
            s_in = self.stream_in[il]
            mix_a = (tuple(bank), self.score_w[il][0], self.mixed[2 * il]) if bs > 0 and bank else None
            banked = bs > 0 and il % bs == 0
            if banked:
                bank.append(s_in.addr)
            mix_f = (tuple(bank), self.score_w[il][1], self.mixed[2 * il + 1]) if bs > 0 and bank else None
            attn, ffn = self.attn[il], self.ffn[il]
            plan.append((attn, isinstance(attn, KdaLayer), ffn, isinstance(ffn, MoeLayer), attn_w, ffn_w,
                         mix_a, mix_f, self.normed[2 * il], self.normed[2 * il + 1], s_in,
                         None if banked else self.after_attn[il], self.stream_in[il + 1]))
        self.final_mix = (tuple(bank), self.out_score, self.mixed[-1]) if bs > 0 and bank else None
        del E
        return plan

    def _run_one(self, token: int, state: K3State, experts: Any, commit: bool = True,
                 taps: frozenset[int] = frozenset(), mode: str = "raw") -> K3Output:
        """`_run` of one row, on the plan's buffers: what a speculative row keeps for its commit
        and the tapped inputs are fresh copies."""
        F = kfused._fused
        nt = kthreads.native()
        E, eps = self.E, self.eps
        layers = state.layers
        for c in state.mla_caches():
            c.truncate(state.pos)          # drop rows a speculative pass left behind
        out = K3Output(logits=None)
        captured = None if commit else Captured(state.pos, 1)
        raw = mode == "raw"
        self.embed((token,), self.stream_in[0].t, nt)
        x = self.stream_in[0].addr
        for il, (attn, kda, ffn, moe, attn_w, ffn_w, mix_a, mix_f, h_a, h_f, s_in, after_v, s_out) in \
                enumerate(self.plan):
            mixed = s_in
            if mix_a is not None:
                mixed = mix_a[2]
                F.res_mix(mix_a[0], s_in.addr, mix_a[1], mixed.addr, 1, E, eps, nt)
            if il in taps:
                out.layer_inputs[il] = (s_in if raw else mixed).t.clone().view(1, 1, E)
            F.rms_norm(mixed.addr, attn_w, 0, h_a.addr, 1, E, eps, 0, nt)
            if kda:
                a, rows = attn(h_a.addr, h_a.buf, layers[il], nt, 1, commit)
                if captured is not None and rows is not None:
                    captured.kda[il] = rows
            else:
                a = attn(h_a.addr, layers[il], nt, 1)
            x = a.data_ptr()           # the residual adds: torch.add's IEEE sums, natively
            if after_v is not None:
                F.add(s_in.addr, x, after_v.addr, E)
                x = after_v.addr
            after = x
            if mix_f is not None:
                F.res_mix(mix_f[0], x, mix_f[1], mix_f[2].addr, 1, E, eps, nt)
                x = mix_f[2].addr
            F.rms_norm(x, ffn_w, 0, h_f.addr, 1, E, eps, 0, nt)
            f = ffn(h_f.t, h_f.buf, experts, nt, 1)[0] if moe else ffn(h_f.buf, nt, 1)
            F.add(after, f.data_ptr(), s_out.addr, E)
            x = s_out.addr
        final = self.stream_in[-1]
        if self.final_mix is not None:
            bank, score, final = self.final_mix
            F.res_mix(bank, x, score, final.addr, 1, E, eps, nt)
        n_layers = self.cfg.num_layers
        if n_layers in taps:
            out.layer_inputs[n_layers] = (self.stream_in[-1] if raw else final).t.clone().view(1, 1, E)
        normed = self.normed[-1]
        F.rms_norm(final.addr, self.final_norm.data_ptr(), 0, normed.addr, 1, E, eps, 0, nt)
        qtype, raw_w, n_out, n_in = self.lm_q
        lg = torch.empty(1, 1, n_out)
        kq._qmatmul.matmul_q8(qtype, raw_w, normed.addr, lg.data_ptr(), n_out, n_in, 1, -1, nt, 1, kq.I8_PATH)
        out.logits = lg
        if commit:
            state.pos += 1
        out.captured = captured
        return out

    def _run(
        self,
        tokens: Sequence[int],
        state: K3State,
        experts: Any,
        commit: bool,
        taps: frozenset[int],
        mode: str,
        logits: str,
    ) -> K3Output:
        F = kfused._fused
        nt = kthreads.native()
        T = len(tokens)
        one = T == 1 and commit and not taps  # the step's buffers (nothing of it is kept)
        E, eps, bs = self.E, self.eps, self.bs
        for c in state.mla_caches():
            c.truncate(state.pos)  # drop rows a speculative pass left behind
        out = K3Output(logits=None)
        captured = None if commit else Captured(state.pos, T)
        stream = self.stream_in[0].t if one else torch.empty(T, E)
        self.embed(tokens, stream, nt)
        bank: list[int] = []  # the banked streams' addresses ...
        banked_rows: list[Tensor] = []  # ... and the tensors, alive until the step ends
        raw = mode == "raw"

        def fresh(i: int, buffers: list[Vec]) -> Tensor:
            return buffers[i].t if one else torch.empty(T, E)

        for il in range(self.cfg.num_layers):
            attn_w, ffn_w = self.norm_w[il]
            mixed = stream
            if bs > 0 and bank:
                mixed = fresh(2 * il, self.mixed)
                F.res_mix(
                    tuple(bank), stream.data_ptr(), self.score_w[il][0], mixed.data_ptr(), T, E, eps, nt
                )
            if il in taps:
                out.layer_inputs[il] = (stream if raw else mixed).view(1, T, E)
            banked = bs > 0 and il % bs == 0
            if banked:
                bank.append(stream.data_ptr())
                banked_rows.append(stream)
            h = fresh(2 * il, self.normed)
            F.rms_norm(mixed.data_ptr(), attn_w, 0, h.data_ptr(), T, E, eps, 0, nt)
            h_buf = self.normed[2 * il].buf if one else kq.buf(h)
            attn, st = self.attn[il], state.layers[il]
            if isinstance(attn, KdaLayer):
                a, rows = attn(h.data_ptr(), h_buf, st, nt, T, commit)  # type: ignore[arg-type]
                if captured is not None and rows is not None:
                    captured.kda[il] = rows
            else:
                a = attn(h.data_ptr(), st, nt, T)  # type: ignore[arg-type]
            after = a if banked else torch.add(stream, a, out=self.after_attn[il].t) if one else stream + a
            mixed = after
            if bs > 0 and bank:
                mixed = fresh(2 * il + 1, self.mixed)
                F.res_mix(tuple(bank), after.data_ptr(), self.score_w[il][1], mixed.data_ptr(), T, E, eps, nt)
            h = fresh(2 * il + 1, self.normed)
            F.rms_norm(mixed.data_ptr(), ffn_w, 0, h.data_ptr(), T, E, eps, 0, nt)
            h_buf = self.normed[2 * il + 1].buf if one else kq.buf(h)
            ffn = self.ffn[il]
            if isinstance(ffn, MoeLayer):
                f, _ = ffn(h, h_buf, experts, nt, T)
            else:
                f = ffn(h_buf, nt, T)
            stream = torch.add(after, f, out=self.stream_in[il + 1].t) if one else after + f
        final = stream
        if bs > 0 and bank:
            final = fresh(2 * self.cfg.num_layers, self.mixed)
            F.res_mix(tuple(bank), stream.data_ptr(), self.out_score, final.data_ptr(), T, E, eps, nt)
        if self.cfg.num_layers in taps:
            out.layer_inputs[self.cfg.num_layers] = (stream if raw else final).view(1, T, E)
        if logits != "none":
            n_rows = T if logits == "all" else 1
            normed = self.normed[-1].t if one else torch.empty(n_rows, E)
            F.rms_norm(
                final[T - n_rows :].data_ptr(),
                self.final_norm.data_ptr(),
                0,
                normed.data_ptr(),
                n_rows,
                E,
                eps,
                0,
                nt,
            )
            qtype, raw_w, n_out, n_in = self.lm_q
            lg = torch.empty(1, n_rows, n_out)
            kq._qmatmul.matmul_q8(
                qtype, raw_w, normed.data_ptr(), lg.data_ptr(), n_out, n_in, n_rows, -1, nt, 1, kq.I8_PATH
            )
            out.logits = lg
        if commit:
            state.pos += T
        out.captured = captured
        return out
