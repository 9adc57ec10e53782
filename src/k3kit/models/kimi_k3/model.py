"""The Kimi-K3 text model: KDA/MLA hybrid layers, attn-res mixing, latent MoE, situ.

Layer il, in llama.cpp's order (src/models/kimi-k3.cpp, the graph constructor):
  stream = layer input (the raw residual stream)
  h = attn_norm(res_mix(bank, stream, attn_res_score))
  if il % block == 0: bank += [stream]; stream = attn(h)     (restart from the attn output)
  else:               stream = stream + attn(h)
  h = ffn_norm(res_mix(bank, stream, ffn_res_score))
  stream = stream + ffn(h)                                    (dense for il < first_k_dense)
then logits = W_out output_norm(res_mix(bank, stream, output_res_score)).
The bank lives only inside one forward (see attn_res.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from k3kit.layers.moe import ExpertProvider
from k3kit.layers.norm import rms_norm
from k3kit.layers.quantized_linear import QuantizedLinear

from .activations import l2_norm
from .attn_res import res_mix
from .config import K3ModelConfig
from .kda import KDA, KDARows, delta_rule, detached, short_convs
from .kda import commit_rows as kda_commit_rows
from .kda import output_rows as kda_output_rows
from .kda import project_rows as kda_project_rows
from .kda import recur_rows as kda_recur_rows
from .mla import MLA
from .mla import absorb_q_rows as mla_absorb_q_rows
from .mla import attend_latent as mla_attend_latent
from .mla import attend_rows as mla_attend_rows
from .mla import output_rows as mla_output_rows
from .mla import project_rows as mla_project_rows
from .mla import value_rows as mla_value_rows
from .moe import DenseFFN, LatentMoE, Router, route
from .mxfp4 import ggml_input_round
from .state import K3State, KDAState, MLACache


@dataclass
class Captured:
    """What a speculative forward leaves for `commit_rows`: per KDA layer, its row inputs."""

    start_pos: int
    n_rows: int
    kda: dict[int, KDARows] = field(default_factory=dict)


@dataclass
class K3Output:
    logits: Tensor | None                                          # [B, T or 1, vocab]
    layer_inputs: dict[int, Tensor] = field(default_factory=dict)  # il -> [B, T, hidden]
    routes: dict[int, Tensor] = field(default_factory=dict)        # il -> expert ids [B, T, k]
    captured: Captured | None = None                               # speculative forwards only


class K3Layer(nn.Module):
    def __init__(self, cfg: K3ModelConfig, il: int, with_experts: bool = True):
        super().__init__()
        self.cfg = cfg
        self.il = il
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.ffn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        if cfg.attn_res_block_size > 0:
            self.attn_res_score = nn.Parameter(torch.zeros(cfg.hidden_size))
            self.ffn_res_score = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.attn: KDA | MLA = KDA(cfg) if cfg.is_kda(il) else MLA(cfg)
        self.ffn: DenseFFN | LatentMoE = (DenseFFN(cfg, cfg.intermediate_size) if cfg.is_dense(il)
                                          else LatentMoE(cfg, il, with_experts))


class K3Model(nn.Module):
    def __init__(self, cfg: K3ModelConfig, with_experts: bool = True):
        """`with_experts=False`: the trunk only; forward then needs an ExpertProvider (the
        engine's expert store), as a 2.8T model's experts never live in module parameters."""
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        # nn.Embedding's own initialisation goes through torch.nn.init, whose first call imports
        # torch._dynamo (0.7 s of every load, where the model is built on the meta device and
        # its table then read from the file); Tensor.normal_ is the same draw without it
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not table.is_meta:
            with torch.no_grad():
                table.normal_()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(K3Layer(cfg, il, with_experts) for il in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        if cfg.attn_res_block_size > 0:
            self.output_res_score = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._ggml_hooks: list[RemovableHandle] = []     # set_ggml_q8_inputs' input rounding

    def set_ggml_q8_inputs(self, on: bool = True,
                           input_kinds: Mapping[str, str | None] | None = None) -> None:
        """Round matmul inputs as ggml-cpu does for quantized weights (llama.cpp parity only).

        ggml-cpu converts the activation operand of every matmul to its weight type's
        vec_dot_type first: Q8_0 blocks of 32 for Q8_0 / MXFP4 / Q4_0 ... weights, F16 for F16.
        `input_kinds` says, per weight, which rounding applies ("q8_0", "f16", "bf16" or
        None; see mxfp4.input_kind): keys are parameter names ("layers.3.attn.q_a_proj.weight",
        "lm_head.weight", "layers.1.ffn.router.weight") plus, for what is not one Linear,
        "layers.N.attn.k_b" / ".v_b" (MLA's absorbed per-head products) or ".kv_b" (the
        unabsorbed kv_b product) and "layers.N.ffn.experts" (the routed experts). A loader
        builds it from the file's tensor types (gguf_load.ggml_input_kinds). Without it, only
        the routed experts' inputs are rounded to Q8_0 (an F32 trunk with MXFP4 experts).
        With the right kinds, float32 logits match llama.cpp's CPU backend to ~1e-5 on an
        F32-trunk tiny model; without the rounding they differ by ~1e-1 there.
        """
        for h in self._ggml_hooks:
            h.remove()
        self._ggml_hooks.clear()
        kinds: Mapping[str, str | None] = input_kinds if on and input_kinds is not None else {}
        for name, mod in self.named_modules():
            pre = f"{name}." if name else ""
            if isinstance(mod, LatentMoE):
                exp = kinds.get(pre + "experts") if input_kinds is not None else "q8_0"
                mod.ggml_q8_inputs = on and exp == "q8_0"
            elif isinstance(mod, Router):
                mod.ggml_input = kinds.get(pre + "weight")
            elif isinstance(mod, MLA):
                mod.ggml_inputs = {k: kinds.get(pre + k) for k in ("k_b", "v_b", "kv_b")}
            elif (isinstance(mod, (nn.Linear, QuantizedLinear))
                  and (kind := kinds.get(pre + "weight")) is not None):
                self._ggml_hooks.append(mod.register_forward_pre_hook(_rounding_hook(kind)))

    def new_state(self, batch: int = 1) -> K3State:
        return K3State.new(self.cfg, batch, self.norm.device, self.norm.dtype)

    def forward(self, tokens: Tensor, state: K3State | None = None, *,
                experts: ExpertProvider | None = None,
                capture_layers: Iterable[int] = (),
                capture_mode: str = "raw",
                speculative: bool = False,
                logits: str = "all",
                return_routes: bool = False) -> K3Output:
        """Run `tokens` [B, T] (or [T]) after what `state` holds.

        state         None: a fresh sequence, nothing kept. Else advanced by T tokens, or,
                      with `speculative`, KDA state left untouched (MLA rows appended past
                      `state.pos`, dropped by the next forward) and `captured` returned for
                      `commit_rows`.
        capture_layers  layer inputs to return: "raw" = the residual stream entering layer il
                      (llama.cpp's t_layer_inp convention), "mixed" = the attn-res mix that
                      layer's attention actually normalises. il == num_layers is the final stream.
        logits        "all", "last" (the last row only) or "none".
        """
        cfg = self.cfg
        if tokens.dim() == 1:
            tokens = tokens[None]
        B, T = tokens.shape
        if capture_mode not in ("raw", "mixed"):
            raise ValueError(f"capture_mode must be 'raw' or 'mixed', got {capture_mode!r}")
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        taps = set(capture_layers)
        if any(not 0 <= il <= cfg.num_layers for il in taps):
            raise ValueError(f"capture layers must be in 0..{cfg.num_layers}")
        if state is not None:
            if state.batch != B:
                raise ValueError(f"state holds {state.batch} sequences, tokens {B}")
            for c in state.mla_caches():
                c.truncate(state.pos)          # drop rows a speculative pass left behind
        elif speculative:
            raise ValueError("a speculative forward needs a state")

        out = K3Output(logits=None)
        captured = Captured(state.pos, T) if speculative and state is not None else None
        eps, bs = cfg.rms_norm_eps, cfg.attn_res_block_size
        bank: list[Tensor] = []
        stream = self.embed(tokens)

        layers = cast("Sequence[K3Layer]", self.layers)
        for il, layer in enumerate(layers):
            mixed = res_mix(bank, stream, layer.attn_res_score, eps) if bs > 0 else stream
            if il in taps:
                out.layer_inputs[il] = stream if capture_mode == "raw" else mixed
            banked = bs > 0 and il % bs == 0
            if banked:
                bank.append(stream)
            h = rms_norm(mixed, layer.attn_norm, eps)
            layer_state = state.layers[il] if state is not None else None
            if isinstance(layer.attn, KDA):
                assert layer_state is None or isinstance(layer_state, KDAState)
                a, rows = layer.attn(h, layer_state, commit=not speculative)
                if captured is not None and rows is not None:
                    captured.kda[il] = rows
            else:
                assert layer_state is None or isinstance(layer_state, MLACache)
                a = layer.attn(h, layer_state)
            stream = a if banked else stream + a

            mixed = res_mix(bank, stream, layer.ffn_res_score, eps) if bs > 0 else stream
            h = rms_norm(mixed, layer.ffn_norm, eps)
            if isinstance(layer.ffn, LatentMoE):
                f, ids = layer.ffn(h, experts)
                if return_routes:
                    out.routes[il] = ids
            else:
                f = layer.ffn(h)
            stream = stream + f

        final = res_mix(bank, stream, self.output_res_score, eps) if bs > 0 else stream
        if cfg.num_layers in taps:
            out.layer_inputs[cfg.num_layers] = stream if capture_mode == "raw" else final
        if logits == "last":
            final = final[:, -1:]
        if logits != "none":
            out.logits = self.lm_head(rms_norm(final, self.norm, eps))
        if state is not None and not speculative:
            state.pos += T
        out.captured = captured
        return out

    def forward_batch(self, segments: Sequence[tuple[Tensor, K3State]], *,
                      experts: ExpertProvider | None = None) -> Tensor:
        """Run several sequences' rows in one pass: `segments` = (token ids [T_i], its state), one
        entry per sequence (each state holds one sequence). Every state advances by its T_i rows;
        returns float logits [n_segments, vocab] of each segment's last row.

        What works row by row (embedding, norms, attn-res mixes, every trunk matmul, the router
        and the routed experts, route-batched over all rows, the LM head) runs once on the
        concatenated rows; attention (MLA over its cached latents, the KDA recurrence) runs per
        sequence on its own state and positions, exactly as `forward` runs it. A row's result is
        independent of the other rows as far as the products are: the native quantized kernels up
        to their row limit (the adapter's `batch_invariant_rows`), and the router's float product
        here, which takes each row as a matrix-vector product (`_row_product`), because torch's
        GEMM sums a row differently for 1-3 rows than for more.
        """
        outs = self.forward_segments(segments, experts=experts)
        return torch.cat([o.logits for o in outs])

    def forward_segments(self, segments: Sequence[tuple[Tensor, K3State]], *,
                         experts: ExpertProvider | None = None, speculative: Sequence[bool] = (),
                         capture: Sequence[bool] = (), capture_layers: Iterable[int] = (),
                         capture_mode: str = "raw") -> list[SegmentOutput]:
        """forward_batch with a speculative mode per segment (batched speculative verification).

        A segment with `speculative[i]` is a verify block: its rows run after its committed state
        exactly as a committed segment of the same rows would (the same per-sequence recurrence,
        the same row-wise products), but KDA state is left untouched and its MLA rows stay pending
        past `state.pos` (ReplaySSM); it returns every row's logits and the `Captured` rows that
        `commit_rows` applies for the accepted prefix. Other segments commit and return their last
        row's logits. `capture[i]`: return the segment's tap features (the inputs of
        `capture_layers`, concatenated, one row per row) for a draft's feature ring."""
        cfg = self.cfg
        if not segments:
            raise ValueError("no segments")
        if capture_mode not in ("raw", "mixed"):
            raise ValueError(f"capture_mode must be 'raw' or 'mixed', got {capture_mode!r}")
        n_seg = len(segments)
        spec = list(speculative) or [False] * n_seg
        cap = list(capture) or [False] * n_seg
        if len(spec) != n_seg or len(cap) != n_seg:
            raise ValueError("one speculative / capture flag per segment")
        taps = list(capture_layers) if any(cap) else []
        if any(not 0 <= il <= cfg.num_layers for il in taps):
            raise ValueError(f"capture layers must be in 0..{cfg.num_layers}")
        lengths = [int(ids.numel()) for ids, _ in segments]
        if min(lengths) < 1:
            raise ValueError("every segment needs at least one row")
        for _, state in segments:
            if state.batch != 1:
                raise ValueError(f"a batched forward takes one sequence per state, got {state.batch}")
            for c in state.mla_caches():
                c.truncate(state.pos)          # drop rows a speculative pass left behind
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        captured = [Captured(state.pos, n) if sp else None
                    for (_, state), n, sp in zip(segments, lengths, spec, strict=True)]
        eps, bs = cfg.rms_norm_eps, cfg.attn_res_block_size
        tokens = torch.cat([ids.reshape(-1) for ids, _ in segments])[None]     # [1, N]
        bank: list[Tensor] = []
        tapped: dict[int, Tensor] = {}
        stream = self.embed(tokens)

        layers = cast("Sequence[K3Layer]", self.layers)
        for il, layer in enumerate(layers):
            mixed = res_mix(bank, stream, layer.attn_res_score, eps) if bs > 0 else stream
            if il in taps:
                tapped[il] = stream if capture_mode == "raw" else mixed
            banked = bs > 0 and il % bs == 0
            if banked:
                bank.append(stream)
            h = rms_norm(mixed, layer.attn_norm, eps)
            states = [state.layers[il] for _, state in segments]
            if isinstance(layer.attn, KDA):
                a = _kda_rows(layer.attn, h, cast("list[KDAState]", states), bounds, spec, captured, il)
            else:
                a = _mla_rows(layer.attn, h, cast("list[MLACache]", states), bounds)
            stream = a if banked else stream + a

            mixed = res_mix(bank, stream, layer.ffn_res_score, eps) if bs > 0 else stream
            h = rms_norm(mixed, layer.ffn_norm, eps)
            f = _latent_moe_rows(layer.ffn, h, experts) if isinstance(layer.ffn, LatentMoE) else layer.ffn(h)
            stream = stream + f

        if cfg.num_layers in taps:
            tapped[cfg.num_layers] = (stream if capture_mode == "raw" or bs <= 0
                                      else res_mix(bank, stream, self.output_res_score, eps))
        # the LM head's rows: every row of a verify block, the last row of any other segment
        sel: list[int] = []
        for i in range(n_seg):
            sel += list(range(bounds[i], bounds[i + 1])) if spec[i] else [bounds[i + 1] - 1]
        last = torch.tensor(sel, device=stream.device)
        final_rows = [bank_row[:, last] for bank_row in bank]
        final = (res_mix(final_rows, stream[:, last], self.output_res_score, eps) if bs > 0
                 else stream[:, last])
        logits = self.lm_head(rms_norm(final, self.norm, eps))[0]
        outs: list[SegmentOutput] = []
        k = 0
        for i, ((_, state), n) in enumerate(zip(segments, lengths, strict=True)):
            m = n if spec[i] else 1
            feats = (torch.cat([tapped[il][0, bounds[i]:bounds[i + 1]] for il in taps], dim=-1)
                     if cap[i] and taps else None)
            outs.append(SegmentOutput(logits[k:k + m], feats, captured[i]))
            k += m
            if not spec[i]:
                state.pos += n
        return outs
    def commit_rows(self, state: K3State, captured: Captured, n: int) -> None:
        """Commit the first `n` rows of a speculative forward: KDA layers replay them from the
        captured inputs, MLA caches keep them by position; `state.pos` advances by n."""
        commit_rows(state, captured, n)


@dataclass
class SegmentOutput:
    """One segment of `forward_segments`."""

    logits: Tensor                 # [T, vocab] (a verify block) or [1, vocab] (its last row)
    taps: Tensor | None = None     # [T, n_taps * hidden] when captured
    captured: Captured | None = None   # a verify block: what commit_rows applies


def _kda_rows(kda: KDA, h: Tensor, states: list[KDAState], bounds: list[int],
              speculative: Sequence[bool] = (), captured: Sequence[Captured | None] = (),
              il: int = 0) -> Tensor:
    """A KDA layer over a pass's rows [1, N, hidden]: projections on all rows, then the
    recurrence per sequence; the one-row segments (decoding sequences) step together as one
    batch of states (the same per-sequence floats as stepping alone). A speculative segment
    runs the same recurrence on a copy of its state and leaves its rows in `captured[i]`."""
    conv_in, g, beta, gate = kda_project_rows(kda, h)
    n = len(states)
    spec = list(speculative) or [False] * n
    singles = [i for i in range(n) if bounds[i + 1] - bounds[i] == 1 and not spec[i]]
    o = torch.empty_like(gate)
    if singles:
        rows = torch.tensor([bounds[i] for i in singles], device=h.device)
        S = [states[i].S for i in singles]
        batch = KDAState(_stacked(S) if not torch.is_grad_enabled() else torch.cat(S),
                         torch.cat([states[i].conv for i in singles]))
        o[0, rows] = kda_recur_rows(kda, batch, conv_in[0, rows, None], g[0, rows, None],
                                    beta[0, rows, None], inplace=not torch.is_grad_enabled())[:, 0]
        for j, i in enumerate(singles):     # views of the batch: the next pass steps them in place
            states[i].S, states[i].conv = batch.S[j:j + 1], batch.conv[j:j + 1]
    for i in range(n):
        s = slice(bounds[i], bounds[i + 1])
        if spec[i]:
            o[:, s], rows_i = _kda_verify_rows(kda, states[i], conv_in[:, s], g[:, s], beta[:, s])
            cap = captured[i]
            assert cap is not None
            cap.kda[il] = rows_i
        elif bounds[i + 1] - bounds[i] > 1:
            o[:, s] = kda_recur_rows(kda, states[i], conv_in[:, s], g[:, s], beta[:, s])
    return kda_output_rows(kda, o, gate)


def _stacked(parts: list[Tensor]) -> Tensor:
    """The states `parts` (each [1, ...]) as one [n, ...] tensor: the tensor they are already
    consecutive views of, in this order (the batch of the previous pass when the same sequences
    decode again: no copy, the states are stepped in place), else a new one (torch.cat)."""
    first = parts[0]
    n, per = len(parts), first.numel()
    storage = first.untyped_storage()
    if all(p.is_contiguous() and p.shape == first.shape and p.dtype == first.dtype
           and p.untyped_storage().data_ptr() == storage.data_ptr() and p.storage_offset() == j * per
           for j, p in enumerate(parts)):
        return first.as_strided((n, *first.shape[1:]), first.stride(), 0)
    return torch.cat(parts)


def _kda_verify_rows(kda: KDA, state: KDAState, conv_in: Tensor, g: Tensor, beta: Tensor
                     ) -> tuple[Tensor, KDARows]:
    """kda.recur_rows without touching `state`: the same operations (so a verify block's rows
    are the floats a committed segment of those rows gets), plus the per-row inputs that
    kda.commit_rows replays for the accepted prefix."""
    cfg = kda.cfg
    q, k, v, _ = short_convs(kda, state.conv, conv_in)
    q = l2_norm(q, cfg.rms_norm_eps)
    k = l2_norm(k, cfg.rms_norm_eps)
    o, S = delta_rule(state.S, q, k, v, g, beta)
    return o, KDARows(*(detached(t) for t in (conv_in, k, v, g, beta, S)))


def _mla_rows(mla: MLA, h: Tensor, caches: list[MLACache], bounds: list[int]) -> Tensor:
    """An MLA layer over a pass's rows: projections on all rows, attention per sequence. The
    one-row segments (decoding sequences) take the per-head products W_kb^T q and W_vb lat
    together (mla.absorb_q_rows / value_rows: the floats each row gets alone, W_kb and W_vb read
    once for all)."""
    q, c, k_pe, gate = mla_project_rows(mla, h)
    n = len(caches)
    singles = [i for i in range(n) if bounds[i + 1] - bounds[i] == 1]
    if len(singles) < 2 or torch.is_grad_enabled():
        parts = [mla_attend_rows(mla, cache, q[:, bounds[i]:bounds[i + 1]], c[:, bounds[i]:bounds[i + 1]],
                                 k_pe[:, bounds[i]:bounds[i + 1]]) for i, cache in enumerate(caches)]
        return mla_output_rows(mla, parts[0] if len(parts) == 1 else torch.cat(parts, dim=1), gate)
    cfg = mla.cfg
    nope, H = cfg.qk_nope_head_dim, cfg.num_heads
    rows = torch.tensor([bounds[i] for i in singles], device=h.device)
    q_abs = mla_absorb_q_rows(mla, q[0, rows, :, :nope])       # [N, H, L]
    lat = q_abs.new_empty(len(singles), H, cfg.kv_lora_rank)
    for j, i in enumerate(singles):
        r = bounds[i]
        lat[j] = mla_attend_latent(mla, caches[i], q_abs[j][None, None], q[:, r:r + 1, :, nope:],
                                   c[:, r:r + 1], k_pe[:, r:r + 1])[0, 0]
    out = q.new_empty(1, q.shape[1], H * cfg.v_head_dim)
    out[0, rows] = mla_value_rows(mla, lat)
    for i, cache in enumerate(caches):
        if bounds[i + 1] - bounds[i] > 1:
            s = slice(bounds[i], bounds[i + 1])
            out[:, s] = mla_attend_rows(mla, cache, q[:, s], c[:, s], k_pe[:, s])
    return mla_output_rows(mla, out, gate)


def _row_product(x: Tensor, weight: Tensor) -> Tensor:
    """x [N, in] @ weight[out, in].T with each row computed on its own (a batch of 1-row
    products; torch.matmul would fold the batch into one GEMM): the same floats for a row
    whatever the other rows are, and the same as a 1-row `x @ weight.T`."""
    n, k = x.shape
    return torch.bmm(x[:, None, :], weight.t().expand(n, k, weight.shape[0])).squeeze(1)


def _latent_moe_rows(moe: LatentMoE, x: Tensor, experts: ExpertProvider | None) -> Tensor:
    """LatentMoE.forward for a batched pass, with the router's float product taken row by row
    (`_row_product`); the routing and everything after it are the module's own."""
    cfg = moe.cfg
    lead = x.shape[:-1]
    xf = x.reshape(-1, x.shape[-1])
    router = moe.router
    ids, w = route(torch.sigmoid(_row_product(ggml_input_round(xf, router.ggml_input), router.weight)),
                   router.bias, cfg)
    xl = moe.routed_down(xf) if moe.routed_down is not None else xf
    y = moe.run_experts(xl, ids, w, experts)
    if moe.routed_norm is not None:
        y = rms_norm(y, moe.routed_norm, cfg.rms_norm_eps)
    if moe.routed_up is not None:
        y = moe.routed_up(y)
    if moe.shared is not None:
        y = y + moe.shared(xf)
    return y.reshape(*lead, -1)


def _rounding_hook(kind: str):
    """A Linear pre-hook rounding its input as ggml-cpu does for a weight of this kind."""
    def hook(_mod: nn.Module, args: tuple) -> tuple:
        return (ggml_input_round(args[0], kind), *args[1:])
    return hook


def commit_rows(state: K3State, captured: Captured, n: int) -> None:
    """See K3Model.commit_rows."""
    if state.pos != captured.start_pos:
        raise ValueError(f"captured rows start at {captured.start_pos}, the state is at {state.pos}")
    if not 0 <= n <= captured.n_rows:
        raise ValueError(f"cannot commit {n} of {captured.n_rows} rows")
    for il, layer in enumerate(state.layers):
        if isinstance(layer, KDAState):
            kda_commit_rows(layer, captured.kda[il], n)
        elif layer.length < state.pos + n:
            raise ValueError(f"layer {il}: MLA cache has {layer.length} rows, "
                             f"the commit needs {state.pos + n}")
        else:
            layer.truncate(state.pos + n)
    state.pos += n


@torch.no_grad()
def init_random(model: K3Model, seed: int = 0, std: float = 0.02) -> K3Model:
    """Random weights at a scale that keeps a deep stack numerically alive (tests, mini).

    Norm weights and scores are perturbed too, so that every parameter matters to the output.
    """
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg

    def normal(p: Tensor, s: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=g) * s + mean)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("attn_norm", "ffn_norm", "norm", "o_norm", "q_a_norm", "kv_a_norm", "routed_norm"):
            normal(p, 0.1, 1.0)
        elif leaf.endswith("res_score"):
            normal(p, 0.5)
        elif leaf in ("q_conv", "k_conv", "v_conv"):
            normal(p, 0.4)
        elif leaf == "A_log":
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
        elif leaf == "dt_bias":
            normal(p, 0.5)
        elif leaf == "bias":        # router selection bias
            normal(p, 0.05)
        elif name.startswith("embed"):
            normal(p, 1.0)
        elif leaf in ("gate_exps", "up_exps", "down_exps"):
            normal(p, 1.0 / p.shape[-1] ** 0.5)
        else:
            normal(p, 1.0 / p.shape[-1] ** 0.5 if p.dim() == 2 else std)
    del cfg
    return model
