"""GET /v1/k3kit/stats: the scheduler's figures as JSON, for the chat page's live panel.

The page needs what /metrics exports, but as one JSON object it can read without a Prometheus
parser. Both are rendered from the same `Scheduler.stats()` snapshot, and the figures derived
from counters (hit rate, payload per token, committed per pass, acceptance) come from `ratios`,
which /metrics uses too: the panel and a scrape taken while nothing runs agree to the last bit,
and there is no second count that could drift from the first.

`History` keeps the counters of the last few minutes, sampled when the endpoint is read (at most
one sample a second), so the page's plots (tokens per second, hit rate) are differences of the
scheduler's own counters, and a page opened late draws what earlier readers saw.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from k3kit.serve.scheduler import SchedulerStats

HISTORY_SECONDS = 300.0      # what the plots cover
SAMPLE_EVERY = 1.0           # s between two kept samples at least

# the counters a history sample keeps: what the plots difference
SAMPLED = ("generated_tokens", "prompt_tokens", "expert_hits", "expert_misses", "expert_payload_bytes",
           "spec_passes", "spec_committed", "decode_passes")


def ratios(s: SchedulerStats) -> dict[str, float]:
    """The figures derived from counters since start, exactly as /metrics exports them."""
    looked = s.expert_hits + s.expert_misses
    tokens = s.prompt_tokens + s.generated_tokens
    return {
        "expert_cache_hit_rate": s.expert_hits / looked if looked else 0,
        "expert_payload_bytes_per_token": s.expert_payload_bytes / tokens if tokens else 0,
        "speculative_committed_per_pass": s.spec_committed / s.spec_passes if s.spec_passes else 0,
        "speculative_acceptance": s.spec_accepted / s.spec_proposed if s.spec_proposed else 0,
    }


class History:
    """The last `seconds` of counter samples, one per `every` seconds at most (thread-safe)."""

    def __init__(self, seconds: float = HISTORY_SECONDS, every: float = SAMPLE_EVERY,
                 clock: Callable[[], float] = time.time) -> None:
        self.seconds, self.every, self._clock = seconds, every, clock
        self._samples: deque[dict[str, float]] = deque()
        self._lock = threading.Lock()

    def record(self, s: SchedulerStats) -> list[dict[str, float]]:
        """Add a sample of `s` unless the last one is younger than `every`; the samples kept, oldest first."""
        now = self._clock()
        with self._lock:
            if not self._samples or now - self._samples[-1]["t"] >= self.every:
                self._samples.append({"t": now, **{k: float(getattr(s, k)) for k in SAMPLED}})
            while self._samples and now - self._samples[0]["t"] > self.seconds:
                self._samples.popleft()
            return list(self._samples)


def stats_body(s: SchedulerStats | None, history: History, *, model_id: str, draft: bool) -> dict[str, Any]:
    """The endpoint's JSON: the snapshot's fields as SchedulerStats names them, `ratios`, the history.
    `stats` is null while the model loads."""
    body: dict[str, Any] = {"object": "k3kit.stats", "model": model_id, "time": time.time(), "draft": draft,
                            "loaded": s is not None, "stats": None, "ratios": None, "history": []}
    if s is not None:
        body["stats"] = asdict(s)
        body["ratios"] = ratios(s)
        body["history"] = history.record(s)
    return body
