"""The DFlash / DSpark network's config.

Parsing, bounds and the GGUF KVs are k3kit.convert.draft_config's (one parser for the converter,
the fixer and this network); DraftConfig keeps the fields that shape the network, so two
configs compare equal when they build the same network whatever file they came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from k3kit.convert.draft_config import (
    DraftNet,
    DraftSpec,
    parse_config,
    read_kvs,
    validate,
    write_kvs,
)
from k3kit.errors import ConvertError


@dataclass(frozen=True)
class DraftConfig(DraftNet):
    """The network's fields (DraftNet) with the ways to build them from a file."""

    def spec(self) -> DraftSpec:
        """This config as the shared parser's DraftSpec (nothing stated beyond the network)."""
        return DraftSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_spec(cls, spec: DraftSpec, source: str = "draft config") -> DraftConfig:
        if spec.hidden_act != "silu":        # llama.cpp also runs gelu; this network's MLP is SwiGLU
            raise ConvertError(f"{source}: hidden_act={spec.hidden_act!r}: k3kit's draft network "
                               "runs silu only")
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(cls)})

    def validate(self, source: str = "draft config") -> DraftConfig:
        validate(self.spec(), source)
        return self

    @classmethod
    def from_hf(cls, cfg: Mapping, source: str = "config.json") -> DraftConfig:
        """From an HF DFlash/DSpark draft config.json (k3kit.convert.draft_config.parse_config)."""
        return cls.from_spec(parse_config(cfg, source), source)

    def to_gguf_kv(self) -> dict[str, object]:
        """The `dflash` metadata of this network (plain values, arrays as lists), as the converter
        writes it, without the general.* keys, the context length and the tokenizer."""
        return {k.key: k.value.tolist() if isinstance(k.value, np.ndarray) else k.value
                for k in write_kvs(self.spec())}

    @classmethod
    def from_gguf_kv(cls, kv: Mapping[str, object], *, vocab_size: int, markov_rank: int = 0,
                     target_hidden_size: int | None = None, confidence_with_markov: bool = True,
                     source: str = "draft.gguf") -> DraftConfig:
        """From GGUF metadata; vocab, Markov rank and the confidence input width come from tensor
        shapes (markov_w1 {r, V}; conf_proj {H + r, 1} or {H, 1})."""
        return cls.from_spec(read_kvs(kv, vocab_size=vocab_size, markov_rank=markov_rank,
                                      target_hidden_size=target_hidden_size,
                                      confidence_with_markov=confidence_with_markov, where=source), source)
