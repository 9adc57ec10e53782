"""The `dflash` GGUF architecture (DFlash and DSpark drafts) as the runtime's Draft.

DSparkDrafter adapts the pure network (k3kit.models.dflash) to the runtime's Draft protocol:
it keeps the context K/V in step with the feature ring and returns DraftBlocks. `load` is the
registry entry, so `load_model("draft.gguf")` gives a DraftAdapter.

A draft cannot run alone: it borrows the target's token embedding and LM head and reads the
target's tapped hidden states, so `attach(target)` checks that the two fit (tap layers exist,
feature widths and vocabularies agree, the mask token is in the target's vocabulary) and tells
the target which layer inputs to capture. The draft's matrices stay the file's bytes, multiplied
by the native kernels like a target's quantized trunk (`--trunk float`: dequantized once).

The draft may run on another device than the target (`--draft-device`, `place`): the target's
tap features move to the draft's device when the context K/V is built, and everything the
drafter hands back (block logits and hidden rows, Markov rows, confidences) moves to the
target's device (`home`, where its embedding rows land).

A legacy `dflash-draft` file (the Lucebox converter's; the seed's llama.cpp aliases the arch)
loads as is: `legacy_view` reads it the way `k3kit draft fix` would rewrite it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from gguf import GGMLQuantizationType, GGUFValueType, Keys
from torch import Tensor

from k3kit.convert.draft_fix import LEGACY_ARCHES, LEGACY_TENSORS, plan_fix
from k3kit.errors import FormatError, K3Error
from k3kit.gguf.format import ARCH_DFLASH, CONF_PROJ, FC, KEY_MASK_TOKEN_ID, KEY_TARGET_LAYERS, LLM, MARKOV_W1
from k3kit.gguf.reader import TensorInfo
from k3kit.gguf.rewrite import apply_kv_rules, rename_tensors
from k3kit.gguf.shards import Model
from k3kit.gguf.writer import kv
from k3kit.kernels import threads as kthreads
from k3kit.layers.quantized_linear import GGMLWeight, use_quantized_weights
from k3kit.models.dflash.block_step import BlockStep
from k3kit.models.dflash.config import DraftConfig
from k3kit.models.dflash.names import BORROWED, gguf_tensor_name
from k3kit.models.dflash.network import ContextRows, DSparkDraft, rope_inv_freq
from k3kit.runtime.loader import GGUFSource, LoadOptions, kv_value
from k3kit.runtime.protocols import DraftBlock
from k3kit.runtime.speculative.feature_ring import FeatureRing

FC_WEIGHT, W1_WEIGHT, CONF_WEIGHT = f"{FC}.weight", f"{MARKOV_W1}.weight", f"{CONF_PROJ}.weight"
TARGET_LAYERS = KEY_TARGET_LAYERS.format(arch=ARCH_DFLASH)
# Matrices whose rows are at most this wide are read as float even in a quantized draft: the
# native products cost the same per output row up to a few hundred inputs, so a 4096 x 32 Markov
# W2 (a small rank) takes ~60 us a row quantized against ~10 as float, and the Markov chain runs
# it once per proposal; its float copy is small (V x rank). A K3 drafter's rank (256) stays quantized.
SHORT_ROWS = 64


class _Rows:
    """Rows appended at the end, dropped at the front, read as one contiguous view; storage grows
    by doubling and compacts in place, so a decode pass copies only its new rows. `with_tail`
    reads the rows followed by a few more written past the end (a draft block's own K or V),
    not kept: the next append or tail overwrites them."""

    def __init__(self):
        self.buf: Tensor | None = None
        self.off = self.n = 0

    def _room(self, x: Tensor) -> None:
        """Room for x's rows past the end."""
        m = x.shape[0]
        if self.buf is None:
            self.buf = x.new_empty((max(64, 2 * m), *x.shape[1:]))
        elif self.off + self.n + m > self.buf.shape[0]:
            old = self.buf[self.off:self.off + self.n]
            if self.n + m > self.buf.shape[0] // 2:
                self.buf = x.new_empty((2 * (self.n + m), *x.shape[1:]))
            self.buf[: self.n] = old.clone()
            self.off = 0

    def append(self, x: Tensor) -> None:
        self._room(x)
        m = x.shape[0]
        cast(Tensor, self.buf)[self.off + self.n:self.off + self.n + m] = x
        self.n += m

    def with_tail(self, x: Tensor) -> Tensor:
        """[rows ; x] as one view of the storage (x copied past the end; the rows stay n)."""
        self._room(x)
        end = self.off + self.n
        buf = cast(Tensor, self.buf)
        buf[end:end + x.shape[0]] = x
        return buf[self.off:end + x.shape[0]]

    def drop_front(self, k: int) -> None:
        k = min(k, self.n)
        self.off += k
        self.n -= k

    def view(self) -> Tensor:
        return cast(Tensor, self.buf)[self.off:self.off + self.n]


def _layer_rows(k: _Rows, v: _Rows) -> ContextRows:
    """A layer's context (K, V) views that join a block's rows in the storage (no copy of the context)."""
    out = ContextRows((k.view(), v.view()))
    out.join = lambda bk, bv: (k.with_tail(bk), v.with_tail(bv))
    return out


class _Context:
    """The draft's context K/V for one feature ring: per layer, rows for positions [begin, end)."""

    def __init__(self, n_layers: int, begin: int, version: int):
        self.rows = [(_Rows(), _Rows()) for _ in range(n_layers)]
        self.begin = self.end = begin
        self.version = version


class DSparkDrafter:
    """Adapts a DSparkDraft to the runtime's Draft protocol.

    Keeps the per-layer K/V of the context rows: they depend only on committed features, so
    each committed position is projected once, when the ring first holds it. One context per
    feature ring (a server drafts for many sequences, each with its own ring, in turn): `sync`
    selects the ring's context, so switching sequences rebuilds nothing; a context goes when its
    ring is garbage (weakly keyed) or at `release(ring)`. `max_context` bounds the attention
    window (None: whatever the ring holds).
    """

    def __init__(self, draft: DSparkDraft, max_context: int | None = None, chunk: int = 256,
                 block_size: int | None = None):
        self.draft = draft
        self.device = draft.device     # where the weights and the context K/V live
        self.home = self.device                  # where what this returns goes (the target's side)
        self.chunk = chunk
        self.cfg = draft.cfg
        self.max_context = max_context
        lo = 1 if draft.cfg.sample_from_anchor else 2
        if block_size is not None and not lo <= block_size <= draft.cfg.block_size:
            raise ValueError(f"block size {block_size} must be in {lo}..{draft.cfg.block_size} "
                             "(the draft's trained block)")
        # a shorter block than trained: fewer MASK rows in the forward, fewer proposals
        self.block_size = block_size or draft.cfg.block_size
        self.has_markov = draft.markov_head is not None
        self.has_confidence = draft.confidence_head is not None
        self._contexts: weakref.WeakKeyDictionary[FeatureRing, _Context] = weakref.WeakKeyDictionary()
        self._ctx: _Context | None = None        # the last synced ring's (draft_block reads it)
        # rows the target's LM head takes in one call with each row's logits as it gets alone
        # (the target's batch_invariant_rows; 0: one call per block, as draft_block makes it)
        self.head_rows = 0
        self._block_step: BlockStep | None | bool = False      # block_step's, made at first use
        self.block_step_note = ""

    def place(self, device: torch.device) -> None:
        """Run the draft on `device`; context K/V is rebuilt there from the rings at the next sync."""
        self.draft.place(device)
        self.device = device
        self._contexts = weakref.WeakKeyDictionary()
        self._ctx = None
        self._block_step = False

    def block_step(self) -> BlockStep | None:
        """The draft's block step (k3kit.models.dflash.block_step) where it runs, made at first use;
        `block_step_note` says why there is none."""
        if self._block_step is False:
            if self.device.type != "cpu":
                self._block_step, self.block_step_note = None, "the draft is on a GPU"
            else:
                self._block_step, self.block_step_note = BlockStep.build(self.draft)
        return self._block_step if isinstance(self._block_step, BlockStep) else None

    def release(self, ring: FeatureRing) -> None:
        """Forget `ring`'s context K/V (its sequence ended)."""
        ctx = self._contexts.pop(ring, None)
        if ctx is not None and ctx is self._ctx:
            self._ctx = None

    @property
    def contexts(self) -> int:
        """Rings whose context K/V is held."""
        return len(self._contexts)

    @property
    def n_proposals(self) -> int:
        return self.block_size if self.cfg.sample_from_anchor else self.block_size - 1

    @property
    def feature_width(self) -> int:
        return self.cfg.n_taps * self.cfg.tap_width

    @property
    def context_span(self) -> tuple[int, int]:
        return (self._ctx.begin, self._ctx.end) if self._ctx is not None else (0, 0)

    def context(self) -> list[tuple[Tensor, Tensor]] | None:
        """Per-layer (K, V) of the context rows currently held."""
        ctx = self._ctx
        if ctx is None or ctx.end == ctx.begin:
            return None
        return [_layer_rows(k, v) for k, v in ctx.rows]

    @torch.no_grad()
    def sync(self, ring: FeatureRing) -> None:
        begin = ring.start
        if self.max_context is not None:
            begin = max(begin, ring.length - self.max_context)
        ctx = self._contexts.get(ring)
        if ctx is None or ctx.version != ring.version or ctx.end > ring.length or begin > ctx.end:
            ctx = _Context(len(self.draft.layers), begin, ring.version)   # rebuild from the ring
            self._contexts[ring] = ctx
        self._ctx = ctx
        if begin > ctx.begin:                                              # slide the window
            for k, v in ctx.rows:
                k.drop_front(begin - ctx.begin)
                v.drop_front(begin - ctx.begin)
            ctx.begin = begin
        while ring.length > ctx.end:           # chunked: a long prompt's taps are wide
            end = min(ring.length, ctx.end + self.chunk)
            feats = ring.get(ctx.end, end).to(self.device)         # the target's taps cross here
            with kthreads.serial_torch() if end - ctx.end <= self.n_proposals + 1 else nullcontext():
                pos = torch.arange(ctx.end, end, device=self.device)
                step = self.block_step()        # the module's calls without its plumbing, where it runs
                got = step.context_kv(feats, pos, (ctx.end, end)) if step is not None else None
                new = got if got is not None else self.draft.context_kv(feats, pos, span=(ctx.end, end))
            for (k, v), (nk, nv) in zip(ctx.rows, new, strict=True):
                k.append(nk)
                v.append(nv)
            ctx.end = end

    @torch.no_grad()
    def draft_block(self, anchor: int, position: int) -> DraftBlock:
        with kthreads.serial_torch():        # a few rows: torch's ops on one thread (kernels.threads)
            return self._draft_block(anchor, position)

    def _draft_block(self, anchor: int, position: int) -> DraftBlock:
        b = self.block_size
        pos = torch.arange(position, position + b, device=self.device)
        x = self.draft.block_embed([anchor], b)[0]        # the target's embedding looks the anchor up
        step = self.block_step()
        span = (position, position + b)
        hidden = step.run(x, pos, self.context(), span) if step is not None else None
        if hidden is None:
            hidden = self.draft(None, pos, self.context(), span=span, x=x)
        logits = self.draft.logits(hidden)
        if not self.cfg.sample_from_anchor:      # DFlash: row 0 only re-reads the anchor
            hidden, logits = hidden[1:], logits[1:]
        return DraftBlock(logits=logits.to(self.home), hidden=hidden.to(self.home))

    @torch.no_grad()
    def draft_blocks(self, contexts: Sequence[list[tuple[Tensor, Tensor]] | None], anchors: Sequence[int],
                     positions: Sequence[int]) -> list[DraftBlock]:
        """`draft_block` for N sequences in one forward: sequence i's block after anchors[i] at
        positions[i] over contexts[i] (what `context()` gave right after `sync` of its ring). Each
        block equals its own draft_block bit for bit (DSparkDraft.forward_batch); the LM head takes
        whole blocks, at most `head_rows` rows a call."""
        with kthreads.serial_torch():
            return self._draft_blocks(contexts, anchors, positions)

    def _draft_blocks(self, contexts: Sequence[list[tuple[Tensor, Tensor]] | None], anchors: Sequence[int],
                      positions: Sequence[int]) -> list[DraftBlock]:
        n, b = len(anchors), self.block_size
        starts = [int(p) for p in positions]
        pos = (torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(b)[None, :]).to(self.device)
        hidden = self.draft.forward_batch(None, pos, contexts, span=(min(starts), max(starts) + b),
                                          x=self.draft.block_embed(anchors, b))
        per_call = max(1, self.head_rows // b)
        logits = [self.draft.logits(hidden[i:i + per_call].reshape(-1, hidden.shape[-1])).view(
            min(per_call, n - i), b, -1) for i in range(0, n, per_call)]
        out = torch.cat(logits).to(self.home)
        hidden = hidden.to(self.home)
        if not self.cfg.sample_from_anchor:
            hidden, out = hidden[:, 1:], out[:, 1:]
        return [DraftBlock(logits=out[i], hidden=hidden[i]) for i in range(n)]

    # The Markov and confidence heads are the draft's own: inputs go to its device, results come home.
    @torch.no_grad()
    def markov_embed(self, prev: Tensor) -> Tensor:
        return self.draft.markov_embed(prev.to(self.device)).to(self.home)

    @torch.no_grad()
    def markov_greedy(self, base: Tensor, anchor: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """The whole greedy Markov chain of a block in one call where the weights allow (see
        DSparkDraft.markov_greedy), else None."""
        if base.device != self.device:
            return None
        return self.draft.markov_greedy(base, anchor)

    @torch.no_grad()
    def markov_masked(self, base: Tensor, prev: int, bits: Tensor) -> tuple[int, Tensor, Tensor] | None:
        """One row of the greedy Markov chain under a grammar's bitmask in one call where the
        weights allow (see DSparkDraft.markov_masked), else None."""
        if base.device != self.device:
            return None
        return self.draft.markov_masked(base, prev, bits)

    @torch.no_grad()
    def markov_bias(self, w1_prev: Tensor) -> Tensor:
        return self.draft.markov_bias(w1_prev.to(self.device)).to(self.home)

    @torch.no_grad()
    def confidence(self, hidden: Tensor, w1_prev: Tensor | None) -> Tensor:
        w1 = None if w1_prev is None else w1_prev.to(self.device)
        return self.draft.confidence(hidden.to(self.device), w1).to(self.home)


class DraftAdapter(DSparkDrafter):
    """A DSparkDrafter over GGUF weights, plus what it needs from the target it drafts for."""

    def __init__(self, source: GGUFSource, draft: DSparkDraft):
        super().__init__(draft)
        self.source = source

    @property
    def where(self) -> str:
        return self.source.where

    @property
    def tap_inputs(self) -> tuple[int, ...]:
        """Target layers whose INPUTS are the draft's features (HF id i = output of layer i =
        input of layer i + 1, which is also what the GGUF stores)."""
        return tuple(i + 1 for i in self.cfg.target_layer_ids)

    def set_block_size(self, block_size: int | None) -> None:
        """Run the draft with a block shorter than trained (None: as trained)."""
        lo = 1 if self.cfg.sample_from_anchor else 2
        if block_size is not None and not lo <= block_size <= self.cfg.block_size:
            raise K3Error(f"{self.where}: --block-size {block_size} must be in {lo}..{self.cfg.block_size} "
                          "(this draft's trained block)")
        self.block_size = block_size or self.cfg.block_size

    def attach(self, target: Any) -> None:
        """Borrow `target`'s embedding and LM head and make it capture this draft's taps."""
        n_layers, hidden = int(target.num_layers), int(target.hidden_size)
        bad = [i for i in self.tap_inputs if not 0 <= i <= n_layers]
        if bad:
            raise FormatError(f"{self.where}: draft taps target layers {[i - 1 for i in bad]}, "
                              f"the target has {n_layers} layers")
        if self.cfg.tap_width != hidden:
            raise FormatError(f"{self.where}: draft reads target features of width {self.cfg.tap_width}, "
                              f"the target's hidden size is {hidden}")
        if self.draft.markov_head is not None and self.cfg.vocab_size != target.vocab_size:
            raise FormatError(f"{self.where}: draft vocabulary {self.cfg.vocab_size} != target "
                              f"vocabulary {target.vocab_size}")
        if not 0 <= self.cfg.mask_token_id < target.vocab_size:
            raise FormatError(f"{self.where}: mask token {self.cfg.mask_token_id} is outside the "
                              f"target vocabulary ({target.vocab_size})")
        # The target's embedding and head run where the target is (its embedding rows say where);
        # the draft may sit on another device, so the rows cross at these two calls.
        home = target.embed(torch.zeros(1, dtype=torch.long)).device
        self.home = home
        self.draft.set_target(lambda ids: target.embed(ids.to(home)), lambda h: target.head(h.to(home)))
        target.set_taps(self.tap_inputs)
        self.head_rows = int(getattr(target, "batch_invariant_rows", 0) or 0)

    def close(self) -> None:
        self.source.close()


def _vocab_size(where: str, kv: dict[str, Any], tensors: dict[str, TensorInfo]) -> int:
    """From markov_w1 {r, V} (DSpark) or the tokenizer's token list (plain DFlash)."""
    info = tensors.get(W1_WEIGHT)
    if info is not None:
        return int(info.shape[1])
    tokens = kv.get(Keys.Tokenizer.LIST)
    if tokens is not None:
        return len(tokens)
    raise FormatError(f"{where}: no markov_w1 tensor and no tokenizer.ggml.tokens: "
                      "cannot tell the draft's vocabulary size")


def _legacy_vocab(source: GGUFSource) -> int:
    """A legacy draft's vocabulary: its Markov table's width (under its legacy name, or the modern
    one a converter may already have written: markov_w1 {r, V}), else its vocab_size key or token
    list."""
    for name in (W1_WEIGHT, *(old for old, new in LEGACY_TENSORS.items() if new == W1_WEIGHT)):
        if name in source.tensors:
            return int(source.tensors[name].shape[1])
    n = source.kv.get(f"{source.arch}.vocab_size")
    if isinstance(n, int) and n > 0:
        return n
    if source.kv.get(Keys.Tokenizer.LIST):
        return len(source.kv[Keys.Tokenizer.LIST])
    raise FormatError(f"{source.where}: legacy draft without a Markov table or {source.arch}.vocab_size: "
                      "cannot tell its vocabulary size (fix it with `k3kit draft fix`, which takes the "
                      "target's tokenizer)")


def legacy_view(source: GGUFSource) -> tuple[dict[str, Any], dict[str, str]]:
    """A legacy `dflash-draft` file read as the dflash file `k3kit draft fix` makes of it:
    -> (its KVs as plain values, dflash tensor name -> the name stored in the file).

    The same plan as the fixer (k3kit.convert.draft_fix), so the two cannot disagree: arch
    `dflash`, legacy keys moved (the mask id from `dflash-draft.dflash.mask_token_id`), tensors
    renamed. The fixer copies the target's tokenizer in; loading needs only its size, since the
    session encodes and decodes with the target's own codec, so a vocabulary-sized stand-in does.
    """
    vocab = _legacy_vocab(source)
    tokenizer = {Keys.Tokenizer.MODEL: kv(Keys.Tokenizer.MODEL, GGUFValueType.STRING, "none"),
                 Keys.Tokenizer.LIST: kv(Keys.Tokenizer.LIST, GGUFValueType.ARRAY, [""] * vocab,
                                         GGUFValueType.STRING)}
    stand_in = SimpleNamespace(kv=tokenizer, paths=[source.path])
    path = Path(source.where)
    rules, _ = plan_fix(path, source.model, cast(Model, stand_in))
    kvs = apply_kv_rules(path, source.model.kv, rules)
    renames = rename_tensors(path, list(source.tensors), rules)
    return {k: kv_value(v) for k, v in kvs.items()}, {new: old for old, new in renames.items()}


def is_legacy(source: GGUFSource) -> bool:
    """A legacy arch, or the seed's half-fixed state: arch `dflash` with the mask id still under a
    legacy key and no tokenizer.ggml.mask_token_id."""
    if source.arch in LEGACY_ARCHES:
        return True
    return KEY_MASK_TOKEN_ID not in source.kv and any(
        k in source.kv for k in (f"{ARCH_DFLASH}.mask_token_id", f"{ARCH_DFLASH}.dflash.mask_token_id"))


def _quantized_draft(source: GGUFSource, cfg: DraftConfig, stored: dict[str, str],
                     options: LoadOptions) -> DSparkDraft:
    """A DSparkDraft whose matrices stay the file's bytes (QuantizedLinear / QuantizedEmbedding,
    as a target's quantized trunk), the rest (norms, a bias, matrices of rows <= SHORT_ROWS wide)
    read as float. `stored`: dflash tensor name -> the name in the file. Built on the meta device:
    no float copy of a quantized matrix is ever made."""
    with torch.device("meta"):
        draft = DSparkDraft(cfg)
    draft.rope_inv_freq, draft.rope_mag = rope_inv_freq(cfg)     # not meta: computed at init
    params = {gguf_tensor_name(n): n for n, _ in draft.named_parameters()}
    unknown = sorted(set(stored) - set(params) - BORROWED)
    if unknown:
        raise FormatError(f"{source.where}: tensors this draft does not have: {', '.join(unknown[:5])}")
    missing = sorted(set(params) - set(stored))
    if missing:
        raise FormatError(f"{source.where}: missing tensor {missing[0]!r}")

    def weight(module: str) -> GGMLWeight | None:
        gname = gguf_tensor_name(f"{module}.weight")
        info = source.tensors.get(stored.get(gname, ""))
        if info is None or len(info.shape) != 2 or int(info.shape[0]) <= SHORT_ROWS:
            return None
        return GGMLWeight(source.raw(stored[gname]), GGMLQuantizationType(info.ggml_type),
                          tuple(int(d) for d in info.shape))

    try:
        use_quantized_weights(draft, weight, options.dtype, options.arith)
    except ValueError as e:
        raise FormatError(f"{source.where}: {e}") from None
    for name, p in list(draft.named_parameters()):       # what stays float: norms, the confidence bias
        gname = gguf_tensor_name(name)
        value = source.tensor(stored[gname], torch.float32)
        if tuple(value.shape) != tuple(p.shape):
            raise FormatError(f"{source.where}: tensor {gname!r} has shape {tuple(reversed(value.shape))} "
                              f"(ggml order), expected {tuple(reversed(p.shape))}")
        mod, _, leaf = name.rpartition(".")
        setattr(draft.get_submodule(mod), leaf, torch.nn.Parameter(value, requires_grad=False))
    return draft


def load(source: GGUFSource, options: LoadOptions) -> DraftAdapter:
    """The registry entry: config from the KVs and tensor shapes. The matrices stay the file's
    bytes, multiplied in place by the native kernels (`--trunk float`: dequantized once, like a
    target's float trunk); the norms run in ggml's order, as llama.cpp's dflash graph runs them.
    A legacy `dflash-draft` file is read through `legacy_view`, its bytes as stored."""
    if is_legacy(source):
        kvs, stored = legacy_view(source)
    else:
        kvs, stored = source.kv, {n: n for n in source.tensors}
    t = {n: source.tensors[old] for n, old in stored.items()}
    if FC_WEIGHT not in t:
        raise FormatError(f"{source.where}: no {FC_WEIGHT}: not a DFlash/DSpark draft")
    n_taps = len(kvs.get(TARGET_LAYERS) or ())
    if n_taps == 0:
        raise FormatError(f"{source.where}: {TARGET_LAYERS} is missing or empty")
    fc_in = int(t[FC_WEIGHT].shape[0])            # ggml order: {n_taps * H_target, H}
    if fc_in % n_taps:
        raise FormatError(f"{source.where}: {FC_WEIGHT} input width {fc_in} is not a multiple of "
                          f"{n_taps} taps")
    w1, conf = t.get(W1_WEIGHT), t.get(CONF_WEIGHT)
    hidden = int(kvs.get(LLM.EMBEDDING_LENGTH.format(arch=ARCH_DFLASH)) or 0)
    cfg = DraftConfig.from_gguf_kv(
        kvs, vocab_size=_vocab_size(source.where, kvs, t),
        markov_rank=int(w1.shape[0]) if w1 is not None else 0,
        target_hidden_size=fc_in // n_taps, source=source.where,
        confidence_with_markov=conf is None or int(conf.shape[0]) != hidden)
    if options.trunk == "quantized":
        draft = _quantized_draft(source, cfg, {n: stored[n] for n in t}, options)
    else:
        draft = DSparkDraft(cfg)
        names = set(t) - BORROWED
        draft.load_gguf_tensors({n: source.tensor(stored[n], torch.float32) for n in names}, source.where)
    draft.use_norms("ggml")
    draft.eval()
    if options.dtype != torch.float32:
        draft.to(options.dtype)
    dev = options.devices[0]
    if dev.type != "cpu":
        draft.place(dev)
    return DraftAdapter(source, draft)
