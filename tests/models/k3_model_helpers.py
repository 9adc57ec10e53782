"""Shared builders for the kimi_k3 model tests (tiny geometry, fixed seeds)."""

from __future__ import annotations

import torch

from k3kit.models.kimi_k3 import K3Model, init_random, tiny_config


def tiny_model(seed: int = 1, dtype: torch.dtype = torch.float32, **overrides) -> K3Model:
    model = init_random(K3Model(tiny_config(**overrides)), seed)
    return model.to(dtype)


def tokens(model: K3Model, n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (batch, n), generator=g)


def decode(model: K3Model, toks: torch.Tensor, chunks: list[int], state=None, **kw):
    """Feed `toks` [B, T] through `state` in the given chunk sizes; returns (logits, state, outputs)."""
    state = state if state is not None else model.new_state(toks.shape[0])
    outs, at = [], 0
    for n in chunks:
        outs.append(model(toks[:, at:at + n], state, **kw))
        at += n
    assert at == toks.shape[1]
    return torch.cat([o.logits for o in outs], dim=1), state, outs
