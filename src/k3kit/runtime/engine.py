"""The generation loop over a model adapter: chunked prefill, decode, sampling, streaming.

The engine is model-neutral. It drives anything with the `CausalModel` shape (one sequence,
`forward(ids)` runs and commits rows and returns logits; k3kit.runtime.protocols) and talks
to the model's expert ledger only through `expert_stats()` (an `ExpertLedger`), so the
payload it reports is what the store actually read, not an estimate.

Decoding goes through a `DecodeStep`: given the last emitted token (not yet fed to the
model), feed it and return the next token(s). Plain autoregressive decoding is `ARStep`;
a speculative step (k3kit.runtime.speculative.SpeculativeDecoder: draft proposes, target
verifies several rows, commits the accepted ones) returns several tokens per call and slots
in without changing the loop. A step that needs the prompt's features (the draft's context)
also has `prefill(ids)`, used instead of `model.forward` for the prompt chunks, and one with
`finish()` hands back statistics whose `summary()` is merged into the result's stats.
With a `constraint` (k3kit.runtime.constraint: a grammar) the Sampler masks every pick with it
(a speculative step built from that Sampler masks its verify rows too), and generation ends, with
reason "stop", right after the token that completes the grammar.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from k3kit.kernels.qmatmul import keep_freed_heap
from k3kit.runtime.protocols import CausalModel, ExpertLedger
from k3kit.runtime.sampling import Sampler, Sampling, make_sampling

if TYPE_CHECKING:
    from k3kit.runtime.constraint import Constraint


class DecodeStep(Protocol):
    def __call__(self, anchor: int, remaining: int) -> list[int]: ...


class ARStep:
    """One row per model pass: feed the anchor, sample the next token."""

    def __init__(self, model: CausalModel, sampler: Sampler):
        self.model, self.sampler = model, sampler

    def __call__(self, anchor: int, remaining: int = 1) -> list[int]:
        return [self.sampler(self.model.forward([anchor])[-1])]


def peak_rss_bytes() -> int:
    """Peak resident set of this process.

    Linux: VmHWM from /proc/self/status. Not ru_maxrss: Linux carries a parent's peak into a
    child's ru_maxrss across (v)fork + exec, so a `k3kit generate` started from a big process
    would report that process's peak. Elsewhere ru_maxrss (KiB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_cache_hit_rate: float = 0.0
    payload_bytes: int = 0              # expert bytes read from the model file, prefill + decode
    prefill_payload_bytes: int = 0
    payload_bytes_per_token: float = 0.0   # decode-phase bytes per generated token
    peak_rss_bytes: int = 0
    stop_reason: str = "length"         # "length", "stop" (eos / end of turn, or the grammar complete)
    speculative: dict[str, Any] | None = None   # a speculative step's summary (target_passes, ...)

    def to_dict(self) -> dict[str, Any]:
        """Flat: a speculative step's figures sit next to the others."""
        d = asdict(self)
        d.update(d.pop("speculative") or {})
        return d


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]                # generated tokens only (a stop token included)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


class _Ledger:
    """Deltas of the model's expert counters (if it has any) between two points."""

    def __init__(self, model: Any):
        self.fn = model.expert_stats if isinstance(model, ExpertLedger) else None

    def read(self) -> tuple[int, int, int]:
        if self.fn is None:
            return 0, 0, 0
        s = self.fn()
        return int(s.hits), int(s.misses), int(s.bytes_read)


WARMUP_ROWS = 16        # the warm-up's prompt rows: past the kernels' many-row threshold (AMX from 12)
WARMUP_TOKENS = 8       # and the tokens it decodes (a speculative step drafts and verifies a block)


def warm_up(model: CausalModel, *, step: Callable[[Any, Sampler], DecodeStep] | None = None,
            token: int = 0) -> bool:
    """llama.cpp's warm-up run, for a model whose experts all fit its cache: read every expert in
    (`preload_experts`), then a throwaway generation of WARMUP_TOKENS after WARMUP_ROWS copies
    of `token`, through `step` (the decode strategy the real run uses), so that a fresh process's
    first passes pay their one-time costs (kernels', the allocator's and a draft's first use, the
    experts' reads) before the run is timed: on the shipped mini they made the first drafted pass
    of `generate --draft default` 50 ms against 10 warm. The model's counters are zeroed after it.
    A model whose experts do not fit reads as it routes, and a warm-up would read experts the
    run may never use: nothing is done; nor for a context shorter than the warm-up's. -> whether
    it ran."""
    preload = getattr(model, "preload_experts", None)
    ctx = getattr(model, "context_length", None)
    if isinstance(ctx, int) and ctx < WARMUP_ROWS + WARMUP_TOKENS:
        return False
    if not callable(preload) or not preload():
        return False
    generate(model, [token] * WARMUP_ROWS, max_tokens=WARMUP_TOKENS, sampling=make_sampling(0.0, seed=0),
             step=step)
    model.reset()
    reset = getattr(model, "reset_counters", None)
    if callable(reset):
        reset()
    return True


def generate(model: CausalModel, prompt_ids: Sequence[int], *, max_tokens: int, sampling: Sampling,
             stop_ids: Iterable[int] = (), prefill_chunk: int = 256,
             on_token: Callable[[int], None] | None = None,
             step: Callable[[Any, Sampler], DecodeStep] | None = None,
             detokenize: Callable[[list[int]], str] | None = None,
             constraint: Constraint | None = None) -> GenerationResult:
    """Prefill `prompt_ids` in chunks, then decode up to `max_tokens` tokens.

    on_token(id) is called as each token is accepted (stream text from it); `step` builds the
    decode strategy (default ARStep); `detokenize` turns the emitted ids (stop excluded) into
    the result's text; `constraint` a grammar the output follows (the module docstring). The model
    is reset first: one call = one sequence.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("empty prompt")
    if prefill_chunk < 1:
        raise ValueError("prefill_chunk must be >= 1")
    stop = set(stop_ids)
    keep_freed_heap()        # per-token tensors reuse heap pages instead of faulting fresh ones in
    sampler = Sampler(sampling, prompt, constraint)
    ledger = _Ledger(model)
    stats = GenerationStats(prompt_tokens=len(prompt))
    model.reset()
    decoder = (step or ARStep)(model, sampler)
    prefill = getattr(decoder, "prefill", None) or model.forward

    h0, m0, b0 = ledger.read()
    t0 = time.perf_counter()
    logits = None
    for i in range(0, len(prompt), prefill_chunk):
        logits = prefill(prompt[i:i + prefill_chunk])
    assert logits is not None
    t1 = time.perf_counter()
    _, _, b1 = ledger.read()

    out: list[int] = []

    def emit(tokens: list[int]) -> bool:
        for t in tokens:
            if len(out) >= max_tokens:
                return True
            out.append(t)
            if t in stop:
                stats.stop_reason = "stop"
                return True
            if on_token is not None:
                on_token(t)
            if sampler.ended_at is not None and len(out) >= sampler.ended_at:
                stats.stop_reason = "stop"
                return True
        return len(out) >= max_tokens

    if max_tokens > 0:
        done = emit([sampler(logits[-1])])
        while not done:
            done = emit(decoder(out[-1], max_tokens - len(out)))
    t2 = time.perf_counter()
    h2, m2, b2 = ledger.read()
    finish = getattr(decoder, "finish", None)
    if finish is not None:
        stats.speculative = finish().summary()

    stats.generated_tokens = len(out)
    stats.prefill_seconds, stats.decode_seconds = t1 - t0, t2 - t1
    stats.prefill_tok_s = len(prompt) / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0
    # the first token comes from the prefill's logits; the decode phase made the rest
    decoded = max(len(out) - 1, 0)
    stats.decode_tok_s = decoded / stats.decode_seconds if stats.decode_seconds > 0 and decoded else 0.0
    stats.expert_hits, stats.expert_misses = h2 - h0, m2 - m0
    looked = stats.expert_hits + stats.expert_misses
    stats.expert_cache_hit_rate = stats.expert_hits / looked if looked else 0.0
    stats.payload_bytes, stats.prefill_payload_bytes = b2 - b0, b1 - b0
    stats.payload_bytes_per_token = (b2 - b1) / decoded if decoded else 0.0
    stats.peak_rss_bytes = peak_rss_bytes()
    emitted = out[:-1] if out and out[-1] in stop else out
    text = detokenize(emitted) if detokenize is not None else ""
    return GenerationResult(text, out, stats)
