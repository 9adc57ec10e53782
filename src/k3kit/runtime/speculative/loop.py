"""The decode loops: speculative (draft proposes, target verifies) and plain autoregressive.

Invariant between passes: the target has committed every output token except the last one
(the anchor); the feature ring holds exactly the committed positions; the anchor sits at
position == target.position. One pass = one draft step + one target verify of
[anchor, proposals[:n-1]], then commit(accepted + 1) and append those rows' tap features.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from k3kit.runtime.protocols import Draft, Target
from k3kit.runtime.speculative.decoder import DecodeStats, SpeculativeDecoder, merge_counters
from k3kit.runtime.speculative.feature_ring import FeatureRing
from k3kit.runtime.speculative.sampling import Sampling
from k3kit.runtime.speculative.schedule import ScheduleConfig


@dataclass
class DecodeResult:
    tokens: list[int]
    stats: DecodeStats


def _prefill(target: Target, prompt_ids: Sequence[int], stats: DecodeStats, chunk: int) -> torch.Tensor:
    """Feed the prompt in chunks (bounded logits memory); -> the last row's logits."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("empty prompt")
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        out = target.verify(part, capture=False, all_logits=False)
        target.commit(len(part))
    stats.prefill_rows = len(prompt)
    return out.logits[-1]


def ar_generate(target: Target, prompt_ids: Sequence[int], max_tokens: int, sampling: Sampling,
                stop_ids: Iterable[int] = (), prefill_chunk: int = 512) -> DecodeResult:
    """Plain decoding, one target row per pass, same sampling: the reference for speculative."""
    from k3kit.runtime.sampling import Sampler  # not at import: it imports this package

    stats, stop = DecodeStats(), set(stop_ids)
    sampler = Sampler(sampling, prompt_ids)
    last = _prefill(target, prompt_ids, stats, prefill_chunk)
    tokens: list[int] = []
    if max_tokens > 0:
        tokens.append(sampler(last))
    while len(tokens) < max_tokens and tokens[-1] not in stop:
        out = target.verify([tokens[-1]], capture=False)
        target.commit(1)
        tokens.append(sampler(out.logits[-1]))
        stats.target_passes += 1
        stats.verify_rows.append(1)
        stats.committed_per_pass.append(1)
    merge_counters(target, stats)
    return DecodeResult(tokens, stats)


def speculative_generate(target: Target, draft: Draft, prompt_ids: Sequence[int], max_tokens: int,
                         sampling: Sampling, *, schedule: ScheduleConfig | None = None,
                         ring: FeatureRing | None = None, ring_storage: str = "f16",
                         ring_capacity: int = 4096, stop_ids: Iterable[int] = (),
                         prefill_chunk: int = 512) -> DecodeResult:
    """Draft-and-verify decoding. Greedy output equals `ar_generate`'s token for token;
    sampled output has the same distribution."""
    from k3kit.runtime.sampling import Sampler  # not at import: it imports this package

    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("empty prompt")
    sampler = Sampler(sampling, prompt)
    dec = SpeculativeDecoder(target, draft, sampling, sampler.generator, schedule=schedule, ring=ring,
                             ring_storage=ring_storage, ring_capacity=ring_capacity, stop_ids=stop_ids,
                             history=sampler.history)
    for i in range(0, len(prompt), prefill_chunk):
        last = dec.prefill(prompt[i:i + prefill_chunk])[-1]
    stop = set(stop_ids)
    tokens: list[int] = []
    if max_tokens > 0:
        tokens.append(sampler(last))
    while len(tokens) < max_tokens and tokens[-1] not in stop:
        tokens.extend(dec.step(tokens[-1], max_tokens - len(tokens)))
    return DecodeResult(tokens, dec.finish())
