"""The `dflash` GGUF architecture (DFlash and DSpark drafts) as the runtime's Draft.

Registered with the model-neutral loader like a target architecture, so
`load_model("draft.gguf")` gives a DraftAdapter. A draft cannot run alone: it borrows the
target's token embedding and LM head and reads the target's tapped hidden states, so
`attach(target)` checks that the two fit (tap layers exist, feature widths and vocabularies
agree, the mask token is in the target's vocabulary) and tells the target which layer inputs
to capture. The draft's weights are dequantized once, like a target trunk.
"""

from __future__ import annotations

from typing import Any

import torch

from k3kit.errors import FormatError, K3Error
from k3kit.models.dspark import DraftConfig, DSparkDraft, DSparkDrafter
from k3kit.runtime.loader import GGUFSource, LoadOptions

ARCHITECTURES = ("dflash",)


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
        self.draft.set_target(target.embed, target.head)
        target.set_taps(self.tap_inputs)

    def close(self) -> None:
        self.source.close()


def _vocab_size(source: GGUFSource) -> int:
    """From markov_w1 {r, V} (DSpark) or the tokenizer's token list (plain DFlash)."""
    info = source.tensors.get("markov_w1.weight")
    if info is not None:
        return int(info.shape[1])
    tokens = source.raw_kv.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.value)
    raise FormatError(f"{source.where}: no markov_w1 tensor and no tokenizer.ggml.tokens: "
                      "cannot tell the draft's vocabulary size")


def load(source: GGUFSource, options: LoadOptions) -> DraftAdapter:
    """The registry entry: config from the KVs and tensor shapes, weights dequantized once."""
    t = source.tensors
    if "fc.weight" not in t:
        raise FormatError(f"{source.where}: no fc.weight: not a DFlash/DSpark draft")
    n_taps = len(source.kv.get("dflash.target_layers") or ())
    if n_taps == 0:
        raise FormatError(f"{source.where}: dflash.target_layers is missing or empty")
    fc_in = int(t["fc.weight"].shape[0])            # ggml order: {n_taps * H_target, H}
    if fc_in % n_taps:
        raise FormatError(f"{source.where}: fc.weight input width {fc_in} is not a multiple of "
                          f"{n_taps} taps")
    w1, conf = t.get("markov_w1.weight"), t.get("conf_proj.weight")
    hidden = int(source.kv.get("dflash.embedding_length") or 0)
    cfg = DraftConfig.from_gguf_kv(
        source.kv, vocab_size=_vocab_size(source), markov_rank=int(w1.shape[0]) if w1 is not None else 0,
        target_hidden_size=fc_in // n_taps, source=source.where,
        confidence_with_markov=conf is None or int(conf.shape[0]) != hidden)
    draft = DSparkDraft(cfg)
    names = set(t) - DSparkDraft.BORROWED
    draft.load_gguf_tensors({n: source.tensor(n, torch.float32) for n in names}, source.where)
    draft.eval()
    if options.dtype != torch.float32:
        draft.to(options.dtype)
    dev = options.devices[0]
    if dev.type != "cpu":
        draft.to(dev)
    return DraftAdapter(source, draft)
