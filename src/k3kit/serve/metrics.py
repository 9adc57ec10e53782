"""GET /metrics: the scheduler's counters in Prometheus' text format (prometheus-client).

Every figure is read from one `Scheduler.stats()` snapshot when the page is scraped (a custom
collector on a registry of its own, so several servers in one process never share series).
Counters are totals since start (`rate()` them); gauges are now or the last request's figure.
The ratios come from k3kit.serve.stats.ratios, which GET /v1/k3kit/stats serves as well.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from k3kit.serve.scheduler import SchedulerStats
from k3kit.serve.stats import ratios

PREFIX = "k3kit"


class SchedulerCollector(Collector):
    def __init__(self, stats: Callable[[], SchedulerStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:       # still loading: no series yet
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        requests = CounterMetricFamily(f"{PREFIX}_requests", "finished requests by finish reason "
                                       "(stop, length, cancelled, error)", labels=["reason"])
        for reason in sorted(set(s.requests) | {"stop", "length", "cancelled", "error"}):
            requests.add_metric([reason], s.requests.get(reason, 0))
        yield requests
        yield counter("requests_rejected", "requests refused: the queue was full (HTTP 429)", s.rejected)
        yield gauge("sequences_active", "sequences holding model state now", s.active)
        yield gauge("queue_depth", "requests waiting for the model", s.queued)
        yield gauge("queue_capacity", "requests that may wait (--max-queue)", s.max_queue)
        yield counter("prompt_tokens", "prompt tokens prefilled", s.prompt_tokens)
        yield counter("prompt_cached_tokens", "prompt tokens restored from the prompt cache instead of "
                      "prefilled (the sum of the requests' usage.prompt_tokens_details.cached_tokens)",
                      s.prompt_cached_tokens)
        yield counter("generated_tokens", "tokens generated", s.generated_tokens)
        yield counter("prefill_seconds", "seconds spent in prefill", s.prefill_seconds)
        yield counter("decode_seconds", "seconds spent decoding", s.decode_seconds)
        yield gauge("prefill_tokens_per_second", "prefill speed of the last request", s.last_prefill_tok_s)
        yield gauge("decode_tokens_per_second", "decode speed of the last request", s.last_decode_tok_s)
        yield gauge("batch_rows", "rows in the last target pass", s.batch_rows)
        yield gauge("batch_sequences", "sequences in the last target pass",
                    s.batch_sequences)
        yield gauge("batch_rows_max", "rows per target pass at most (--max-batch)", s.max_batch)
        derived = ratios(s)
        yield counter("expert_cache_hits", "routed-expert lookups served by the cache", s.expert_hits)
        yield counter("expert_cache_misses", "routed-expert lookups read from the file", s.expert_misses)
        yield gauge("expert_cache_hit_rate", "hits / lookups since start", derived["expert_cache_hit_rate"])
        yield counter("expert_payload_bytes", "expert bytes read from the model file", s.expert_payload_bytes)
        yield gauge("expert_payload_bytes_per_token", "expert bytes read per token run (prompt and "
                    "generated) since start", derived["expert_payload_bytes_per_token"])
        yield counter("speculative_passes", "target passes verifying a draft block", s.spec_passes)
        yield counter("speculative_committed_tokens", "tokens those passes committed", s.spec_committed)
        yield counter("speculative_proposals", "draft proposals verified", s.spec_proposed)
        yield counter("speculative_accepted", "draft proposals accepted", s.spec_accepted)
        yield counter("decode_passes", "target passes with decoding sequences", s.decode_passes)
        yield counter("speculative_drafted_passes", "decode passes that ran a draft step first",
                      s.drafted_passes)
        yield counter("speculative_plain_sequences", "greedy requests served without the draft, where it "
                      "could not pay", s.plain_sequences)
        yield gauge("speculative_committed_per_pass", "tokens committed per target pass since start",
                    derived["speculative_committed_per_pass"])
        yield gauge("speculative_acceptance", "accepted / verified draft proposals since start",
                    derived["speculative_acceptance"])
        pc = s.prompt_cache
        if pc:
            for name, doc in (("hits", "requests restored from a saved state"),
                              ("misses", "requests the prompt cache had nothing for"),
                              ("cached_tokens", "prompt tokens restored instead of run"),
                              ("evictions", "entries dropped from RAM for the budget"),
                              ("disk_hits", "restores read from --prompt-cache-dir"),
                              ("disk_writes", "entries written to --prompt-cache-dir"),
                              ("disk_skipped", "cache files skipped: corrupt, foreign or truncated")):
                yield counter(f"prompt_cache_{name}", doc, pc.get(name, 0))
            for name, doc in (("entries", "entries held in RAM"),
                              ("ram_bytes", "bytes the entries in RAM hold"),
                              ("snapshot_bytes", "of which recurrent-state copies"),
                              ("disk_entries", "entries in --prompt-cache-dir"),
                              ("disk_bytes", "bytes of the entries in --prompt-cache-dir")):
                yield gauge(f"prompt_cache_{name}", doc, pc.get(name, 0))
            yield counter("prompt_cache_ahead_prefills", "conversations' next turns prefilled while their "
                          "clients were away", s.ahead_prefills)
            yield counter("prompt_cache_ahead_tokens", "prompt rows those prefills ran", s.ahead_tokens)


def metrics_page(stats: Callable[[], SchedulerStats | None]) -> Callable[[], tuple[bytes, str]]:
    """A function that renders the metrics page: (body, content type)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(stats))

    def render() -> tuple[bytes, str]:
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return render
