"""k3kit's rows: each configuration's `pp` and `tg` tests over -r repetitions, llama-bench style.

One repetition is one `engine.generate` call on the next workload prompt: its prefill is a
`pp{P}` sample (P prompt tokens), its decode a `tg{N}` sample (N tokens decoded after the
prompt, which llama-bench would call `tg{N} @ d{P}`: `n_depth`). End-of-text is not a stop
(llama-bench ignores it too), so every sample decodes exactly N tokens. Before the samples of
a configuration the model is warmed once (llama-bench's warm-up run) on the first prompt; the
expert cache then carries over from one repetition to the next, as in a server.

The expert ledger is read at the end of the prefill (the first token's callback) and of the
decode, so hit rate and payload are split by phase: payload per token is expert bytes read
from the model file per prompt token (pp) or per decoded token (tg).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3kit.adapters.session import Session, open_session
from k3kit.bench.config import Config
from k3kit.bench.profile import RouteRecorder
from k3kit.errors import K3Error
from k3kit.runtime.engine import GenerationResult, generate, peak_rss_bytes
from k3kit.runtime.experts.pinning import PinPlan, pin
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import make_sampling
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder, parse_budget


@dataclass(frozen=True)
class RunSpec:
    """Run-wide settings (not swept)."""

    model: Path
    draft: Path | None = None
    n_prompt: int = 512
    n_gen: int = 128
    reps: int = 5
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    trunk: str | None = None             # None: the loader's default
    expert_prefetch: str = "auto"
    arith: str = "auto"
    cold: bool | str = False             # the expert read path: False (page cache) or "direct"
    cpu_moe: int = 0                     # --cpu-moe (-1) / --n-cpu-moe N
    prefill_chunk: int = 512             # llama-bench's n_batch
    feature_ring: str = "f16"
    draft_device: str | None = None
    pin_probs: dict[int, np.ndarray] | None = None   # --pin-experts: the profile's p_e per layer
    pin_where: str = ""


@dataclass
class Sample:
    """One repetition's figures."""

    prefill_s: float
    decode_s: float
    n_prompt: int
    n_gen: int
    pp_hits: int
    pp_misses: int
    pp_bytes: int
    tg_hits: int
    tg_misses: int
    tg_bytes: int
    token_ids: list[int]
    speculative: dict[str, Any] | None = None


@dataclass
class ConfigResult:
    config: Config
    label: str
    samples: list[Sample] = field(default_factory=list)
    expert_kernel: str = ""
    trunk: str = ""
    pinned: dict[str, object] | None = None
    peak_rss: int = 0
    test_time: str = ""
    weights_per_token: int = 0       # trunk bytes a decoded token reads (all but the embedding table)
    expert_bytes: float = 0.0        # one routed expert as the cache holds it (mean over MoE layers)


class Ledger:
    """The loaded model's expert counters as (hits, misses, bytes_read)."""

    def __init__(self, session: Session):
        self.session = session

    def read(self) -> tuple[int, int, int]:
        s = self.session.target.stats()
        return int(s.hits), int(s.misses), int(s.bytes_read)


def open_for(spec: RunSpec, cfg: Config) -> Session:
    kwargs: dict[str, Any] = {}
    if spec.trunk is not None:
        kwargs["trunk"] = spec.trunk
    options = LoadOptions(device=spec.device, dtype=spec.dtype, expert_cache_mib=cfg.expert_cache_mib,
                          expert_kernel=cfg.expert_kernel, expert_prefetch=spec.expert_prefetch,
                          arith=spec.arith, cold=spec.cold, cpu_moe=spec.cpu_moe, **kwargs)
    extra: dict[str, Any] = {"draft_device": spec.draft_device} if spec.draft_device else {}
    return open_session(spec.model, options, draft=spec.draft, block_size=cfg.block_size, **extra)


def store_of(session: Session) -> Any:
    """The target's expert store (an adapter attribute; None for a model without one)."""
    return getattr(session.target.model, "store", None)


def prepare(session: Session, spec: RunSpec, cfg: Config, default_threads: int) -> PinPlan | None:
    """Put a loaded session in `cfg`'s state: threads, draft block, an empty cache of its size, pins."""
    torch.set_num_threads(cfg.threads or default_threads)
    draft = session.draft_model
    if draft is not None:
        draft.set_block_size(cfg.block_size)
    session.target.reset_expert_cache(cfg.expert_cache_mib)
    if spec.pin_probs is None:
        return None
    store = store_of(session)
    if store is None:
        raise K3Error(f"{spec.model}: this model has no expert store to pin experts in")
    plan = pin(store, spec.pin_probs, spec.pin_where)
    store.reset_stats()
    return plan


def step_factory(session: Session, spec: RunSpec, cfg: Config) -> Callable[..., Any] | None:
    draft = session.draft_model
    if draft is None:
        return None
    schedule = ScheduleConfig(budget=parse_budget(cfg.verify_budget), threshold=cfg.confidence_threshold,
                              draft_cost=None)

    def build(model: Any, sampler: Any) -> SpeculativeDecoder:
        return SpeculativeDecoder(model, draft, sampler.sampling, sampler.generator, schedule=schedule,
                                  ring_storage=spec.feature_ring)
    return build


def one_run(session: Session, spec: RunSpec, cfg: Config, prompt: Sequence[int], n_gen: int) -> Sample:
    """One generate call: prefill `prompt`, then decode exactly n_gen tokens (no stop)."""
    ledger = Ledger(session)
    marks: list[tuple[int, int, int]] = []

    def on_token(_t: int) -> None:
        if not marks:
            marks.append(ledger.read())    # the first token comes right after the prefill

    h0, m0, b0 = ledger.read()
    # max_tokens n_gen + 1: the prefill's logits give the first token, the decode the other n_gen
    r: GenerationResult = generate(session.model, prompt, max_tokens=n_gen + 1 if n_gen else 0,
                                   sampling=make_sampling(0.0, seed=0), stop_ids=(),
                                   prefill_chunk=spec.prefill_chunk, on_token=on_token,
                                   step=step_factory(session, spec, cfg))
    h2, m2, b2 = ledger.read()
    h1, m1, b1 = marks[0] if marks else (h2, m2, b2)
    s = r.stats
    return Sample(s.prefill_seconds, s.decode_seconds, len(prompt), max(s.generated_tokens - 1, 0),
                  h1 - h0, m1 - m0, b1 - b0, h2 - h1, m2 - m1, b2 - b1, list(r.token_ids), s.speculative)


def run_config(session: Session, spec: RunSpec, cfg: Config, label: str, prompts: list[list[int]],
               default_threads: int, recorder: RouteRecorder | None,
               tick: Callable[[str], None]) -> ConfigResult:
    plan = prepare(session, spec, cfg, default_threads)
    mem = session.target.memory()
    units = [e.cached_bytes for e in mem.experts]
    out = ConfigResult(cfg, label, expert_kernel=session.target.expert_kernel, trunk=str(mem.trunk),
                       weights_per_token=mem.trunk_bytes - mem.input_bytes,
                       expert_bytes=sum(units) / len(units) if units else 0.0,
                       pinned=plan.to_dict() if plan is not None else None,
                       test_time=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"))
    tick("warm-up")
    one_run(session, spec, cfg, prompts[0], min(spec.n_gen, 2))
    if recorder is not None:
        recorder.start(session)
    for i, ids in enumerate(prompts):
        tick(f"prompt {i + 1}/{len(prompts)}")
        out.samples.append(one_run(session, spec, cfg, ids, spec.n_gen))
    if recorder is not None:
        recorder.stop()
    out.peak_rss = peak_rss_bytes()
    return out


def run_all(spec: RunSpec, configs: list[Config], labels: list[str], prompts: list[list[int]],
            recorder: RouteRecorder | None, progress: Callable[[str, str], None]
            ) -> tuple[list[ConfigResult], dict[str, Any]]:
    """Every configuration, reloading the model only when a load setting changes.

    Returns the results and the loaded model's facts as the engine saw them (kernel, codec)."""
    default_threads = torch.get_num_threads()
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)     # restored below: `bench` may run inside another program
    results: list[ConfigResult] = []
    session: Session | None = None
    key: tuple[Any, ...] | None = None
    info: dict[str, Any] = {}
    t_load = 0.0
    try:
        for cfg, label in zip(configs, labels, strict=True):
            if session is None or cfg.load_key() != key:
                if session is not None:
                    session.close()
                    session = None
                progress(label, "loading")
                t0 = time.perf_counter()
                session = open_for(spec, cfg)
                t_load += time.perf_counter() - t0
                key = cfg.load_key()
            s = session

            def tick(what: str, label: str = label) -> None:
                progress(label, what)
            results.append(run_config(s, spec, cfg, label, prompts, default_threads, recorder, tick))
            info = {"load_seconds": t_load}
    finally:
        if session is not None:
            session.close()
        torch.set_num_threads(default_threads)
        torch.set_grad_enabled(grad)
    return results, info


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """llama-bench's avg and stddev (sample standard deviation, 0 for one sample)."""
    if not xs:
        return 0.0, 0.0
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0
