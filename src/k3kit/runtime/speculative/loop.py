"""The decode loops: speculative (draft proposes, target verifies) and plain autoregressive.

Invariant between passes: the target has committed every output token except the last one
(the anchor); the feature ring holds exactly the committed positions; the anchor sits at
position == target.position. One pass = one draft step + one target verify of
[anchor, proposals[:n-1]], then commit(accepted + 1) and append those rows' tap features.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from k3kit.runtime.speculative.accept import accept_greedy, accept_sampled
from k3kit.runtime.speculative.feature_ring import FeatureRing
from k3kit.runtime.speculative.interface import Draft, Target
from k3kit.runtime.speculative.proposal import propose
from k3kit.runtime.speculative.sampling import Sampling, pick, probs
from k3kit.runtime.speculative.schedule import DepthAcceptance, ScheduleConfig, choose_width


@dataclass
class DecodeStats:
    prefill_rows: int = 0
    target_passes: int = 0                                     # verify calls after the prefill
    draft_steps: int = 0
    committed_per_pass: list[int] = field(default_factory=list)   # tokens emitted per pass
    acceptance_histogram: list[int] = field(default_factory=list)  # [m] = passes accepting m
    verify_rows: list[int] = field(default_factory=list)        # rows verified per pass
    target_counters: dict[str, int] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Tokens committed per target pass (1.0 for plain decoding)."""
        return sum(self.committed_per_pass) / max(1, len(self.committed_per_pass))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("target_counters"))
        d["tau"] = self.tau
        d["verify_rows_total"] = sum(self.verify_rows)
        return d


@dataclass
class DecodeResult:
    tokens: list[int]
    stats: DecodeStats


_REPLAY_COUNTERS = ("replay_fast_commits", "replay_full_replays", "replay_failed_fallbacks")


def _merge_counters(target: Target, stats: DecodeStats) -> None:
    """A target's own counters: from `counters()` if it has one, else the replay attributes."""
    counters = getattr(target, "counters", None)
    if callable(counters):
        stats.target_counters = {k: int(v) for k, v in counters().items()}
    else:
        stats.target_counters = {k: int(getattr(target, k)) for k in _REPLAY_COUNTERS if hasattr(target, k)}


def _prefill(target: Target, prompt_ids: Sequence[int], ring: FeatureRing | None, stats: DecodeStats,
             chunk: int) -> torch.Tensor:
    """Feed the prompt in chunks (bounded logits/taps memory); -> the last row's logits."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("empty prompt")
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        out = target.verify(part, capture=ring is not None, all_logits=False)
        target.commit(len(part))
        if ring is not None:
            ring.append(out.taps)
    stats.prefill_rows = len(prompt)
    return out.logits[-1]


def _stop_index(tokens: list[int], stop: set[int]) -> int | None:
    for i, t in enumerate(tokens):
        if t in stop:
            return i
    return None


def ar_generate(target: Target, prompt_ids: Sequence[int], max_tokens: int, sampling: Sampling,
                stop_ids: Iterable[int] = (), prefill_chunk: int = 512) -> DecodeResult:
    """Plain decoding, one target row per pass, same sampling: the reference for speculative."""
    stats, stop = DecodeStats(), set(stop_ids)
    gen = sampling.generator()
    last = _prefill(target, prompt_ids, None, stats, prefill_chunk)
    tokens: list[int] = []
    if max_tokens > 0:
        tokens.append(pick(last, sampling, gen))
    while len(tokens) < max_tokens and tokens[-1] not in stop:
        out = target.verify([tokens[-1]], capture=False)
        target.commit(1)
        tokens.append(pick(out.logits[-1], sampling, gen))
        stats.target_passes += 1
        stats.verify_rows.append(1)
        stats.committed_per_pass.append(1)
    _merge_counters(target, stats)
    return DecodeResult(tokens, stats)


def speculative_generate(target: Target, draft: Draft, prompt_ids: Sequence[int], max_tokens: int,
                         sampling: Sampling, *, schedule: ScheduleConfig | None = None,
                         ring: FeatureRing | None = None, ring_storage: str = "f16",
                         ring_capacity: int = 4096, stop_ids: Iterable[int] = (),
                         prefill_chunk: int = 512) -> DecodeResult:
    """Draft-and-verify decoding. Greedy output equals `ar_generate`'s token for token;
    sampled output has the same distribution."""
    schedule = schedule or ScheduleConfig()
    stats, stop = DecodeStats(), set(stop_ids)
    gen = sampling.generator()
    depth = DepthAcceptance()
    n_prop = draft.n_proposals
    stats.acceptance_histogram = [0] * (n_prop + 1)

    if ring is None:
        ring = FeatureRing(draft.feature_width, capacity=ring_capacity, storage=ring_storage)
    if ring.length != target.position:
        raise ValueError(f"feature ring holds {ring.length} positions, target is at {target.position}")
    last = _prefill(target, prompt_ids, ring, stats, prefill_chunk)

    tokens: list[int] = []
    if max_tokens > 0:
        tokens.append(pick(last, sampling, gen))
    while len(tokens) < max_tokens and tokens[-1] not in stop:
        anchor = tokens[-1]
        remaining = max_tokens - len(tokens)
        if schedule.budget == 1 or remaining == 1:     # nothing to propose: skip the draft
            props, width = None, 1
        else:
            draft.sync(ring)
            props = propose(draft, anchor, target.position, sampling, gen)
            stats.draft_steps += 1
            conf = (props.confidence.tolist() if props.confidence is not None
                    else depth.rates(len(props.tokens)))
            width = choose_width(conf, target.cost, min(len(props.tokens) + 1, remaining), schedule)
        cand = props.tokens[: width - 1] if props else []
        v = target.verify([anchor, *cand], capture=True)
        if sampling.greedy:
            m, nxt = accept_greedy(cand, v.logits)
        else:
            q = props.q[: len(cand)] if props else torch.zeros(0, v.logits.shape[1], dtype=torch.float64)
            m, nxt = accept_sampled(cand, q, probs(v.logits, sampling), gen)
        new = [*cand[:m], nxt]
        j = _stop_index(new, stop)
        if j is not None:
            new = new[: j + 1]
        n_commit = len(new)                 # anchor + accepted proposals up to the last new one
        target.commit(n_commit)
        ring.append(v.taps[:n_commit])
        tokens.extend(new)

        stats.target_passes += 1
        stats.verify_rows.append(len(cand) + 1)
        stats.committed_per_pass.append(len(new))
        stats.acceptance_histogram[m] += 1
        if cand:
            depth.record(len(cand), m)
    _merge_counters(target, stats)
    return DecodeResult(tokens, stats)
