"""How many rows to verify.

Verifying n rows (the anchor plus n-1 proposals) commits 1 + (accepted proposals) tokens.
Proposal k survives only if all before it do, so with per-proposal acceptance chances c_i the
prefix survival is a_k = prod_{i<=k} c_i and the expected commit is E(n) = 1 + sum_{k<n} a_k.
On a target whose verify rows are cheap (weights resident) the best n is the widest; when each
row drags in more streamed expert bytes, the extra rows cost more than their expected tokens,
so the scheduler maximises E(n) / (cost(n) + draft_cost) rather than E(n).

The c_k come from the draft's confidence head; without one, from the acceptance seen so far
at each depth (Laplace-smoothed conditional rates).

`verify_seconds` is a target-neutral estimate of a verify pass's wall time that a target's
`cost(n)` can build on: a fixed cost per pass and per layer, compute per row, a cost per
distinct routed expert, and, for the experts the cache does not hold, the time to read and
dequantize them. `PassRates` holds the machine's rates; the defaults were measured on the
project's 2-core VM with the torch runtime (benchmarks/bench_spec.py prints the calibration).
Only ratios between widths matter, so a uniformly faster or slower machine picks the same
widths; what changes the choice is the balance between per-pass and per-miss costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3kit.errors import K3Error
from k3kit.runtime.cost import expected_unique


def parse_budget(text: str) -> int | None:
    """`--verify-budget auto|N` -> None (cost-aware) or N rows (>= 1)."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise K3Error(f"--verify-budget: expected 'auto' or a row count >= 1, got {text!r}")
    return n


@dataclass
class ScheduleConfig:
    budget: int | None = None       # fixed verify rows (capped by the block); None: cost-aware
    threshold: float = 0.0          # drop proposals from the first one with confidence < threshold
    draft_cost: float | None = 0.0  # cost of one draft step, same unit as target.cost; None:
                                    # measured (seconds; for a target whose cost() is seconds)


@dataclass
class DepthAcceptance:
    """Acceptance seen at each proposal depth: tried[k] / accepted[k], k = 0-based proposal."""

    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, offered: int, m: int) -> None:
        while len(self.tried) < offered:
            self.tried.append(0)
            self.accepted.append(0)
        for k in range(min(offered, m + 1)):    # proposal k was judged iff all before passed
            self.tried[k] += 1
            if k < m:
                self.accepted[k] += 1

    def rates(self, n: int, prior_weight: float = 2.0) -> list[float]:
        """Conditional acceptance per depth, each shrunk towards the depth before it (depth 0
        towards 1/2). Depths never offered inherit the last estimate, so a narrow start does
        not lock the scheduler into staying narrow."""
        out, prior = [], 0.5
        for k in range(n):
            tried = self.tried[k] if k < len(self.tried) else 0
            acc = self.accepted[k] if k < len(self.accepted) else 0
            prior = (acc + prior_weight * prior) / (tried + prior_weight)
            out.append(prior)
        return out


    def upper(self, n: int, z: float = 1.64) -> list[float]:
        """Conditional acceptance per depth as high as the counts allow: each depth's Wilson score
        upper bound at `z` (one-sided 95% at 1.64), 1 before depth 0 is tried; depths never offered
        inherit the bound before them (a draft rejected at depth 0 every time says nothing of
        depth 1, and must not be taken as right there). What a decision to stop drafting rests
        on: it should need the counts, not the prior, to say no."""
        out, bound = [], 1.0
        z2 = z * z
        for k in range(n):
            tried = self.tried[k] if k < len(self.tried) else 0
            if tried:
                acc = self.accepted[k]
                spread = z * (acc * (tried - acc) / tried + z2 / 4) ** 0.5
                bound = min(1.0, (acc + z2 / 2 + spread) / (tried + z2))
            out.append(bound)
        return out


def prefix_survival(conf: Sequence[float]) -> list[float]:
    out, a = [], 1.0
    for c in conf:
        a *= float(c)
        out.append(a)
    return out


def expected_tokens(survival: Sequence[float], n_rows: int) -> float:
    """E[tokens committed] when verifying n_rows = anchor + (n_rows - 1) proposals."""
    return 1.0 + sum(survival[: n_rows - 1])


def choose_width(conf: Sequence[float], cost: Callable[[int], float], max_rows: int,
                 cfg: ScheduleConfig) -> int:
    """Verify rows in 1..max_rows (max_rows <= proposals + 1)."""
    limit = max(1, max_rows)
    if cfg.threshold > 0:
        k = 0
        while k < len(conf) and conf[k] >= cfg.threshold:
            k += 1
        limit = min(limit, k + 1)
    if cfg.budget is not None:
        return min(cfg.budget, limit)
    surv = prefix_survival(conf)
    best, best_rate = 1, -1.0
    for n in range(1, limit + 1):
        c = cost(n) + (cfg.draft_cost or 0.0)
        if not c > 0:
            raise ValueError(f"verify cost must be positive, got {c} for {n} rows")
        rate = expected_tokens(surv, n) / c
        if rate > best_rate * (1 + 1e-12):      # ties keep the narrower width
            best, best_rate = n, rate
    return best


@dataclass(frozen=True)
class PassRates:
    """How fast the machine does each part of a verify pass (seconds, bytes, elements).

    Defaults: measured with `benchmarks/bench_spec.py --calibrate` on the 2-core VM (torch,
    1 thread, the shipped mini K3; median verify time inside real decoding): a resident 1-row
    pass 9 ms, +1.6 ms per extra row (rows and the distinct experts they add), and about
    0.75 ms per missed expert (24.6 k MXFP4 weights dequantized to f32, the file pages
    released; reads that bypass the page cache add little for a 13 KB expert)."""

    layer_s: float = 0.8e-3            # fixed per layer per pass: kernel launches, interpreter
    row_layer_s: float = 0.045e-3      # per row per layer on top of the matmuls (recurrent steps)
    flops: float = 2.0e10              # dense f32 matmul rate, FLOP/s
    mem_bw: float = 1.0e10             # bytes/s reading resident weights (trunk once per pass)
    expert_s: float = 60e-6            # per distinct expert per pass: gather + three small matmuls
    dequant_elems_s: float = 3.3e7     # weights/s a missed expert is dequantized (and released) at
    read_bw: float = 1.0e9             # file bytes/s for a missed expert, page cache warm
    cold_read_bw: float = 3.0e8        # ... with reads that bypass the page cache
    cold_read_s: float = 2.0e-5        # ... plus a fixed latency per missed expert


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer as the cost model sees it (sizes per expert)."""

    n_experts: int
    top_k: int
    elements: int                      # weights of one expert (all its tensors)
    resident_bytes: int                # its size in the cache, what the cache charges
    file_bytes: int                    # its size in the model file, what a miss reads
    cached: int = 0                    # experts of this layer in the cache now
    dequant_on_miss: bool = True       # False when the cache keeps the quantized bytes


def hit_fraction(layer: ExpertLayer, distinct: float, pass_distinct: float, cache_experts: float) -> float:
    """Chance that an expert a pass routes to in `layer` is already cached.

    An LRU cache of `cache_experts` experts, with every pass touching `pass_distinct` over all
    layers, still holds the experts of about h = cache_experts / pass_distinct earlier passes;
    with uniform routing an expert was used by one of them with chance 1 - (1 - d/E)^h. If a
    single pass touches more experts than the cache holds, each layer's experts are evicted by
    the other layers' before they come round again, and nothing hits (LRU thrashing). The
    estimate never exceeds what the cache holds of the layer right now (a cache still filling)."""
    if layer.n_experts <= 0 or cache_experts < pass_distinct or pass_distinct <= 0:
        return 0.0
    h = cache_experts / pass_distinct
    steady = 1.0 - (1.0 - min(1.0, distinct / layer.n_experts)) ** h
    return min(steady, layer.cached / layer.n_experts)


def verify_seconds(n_rows: int, *, layers: int, trunk_params: int, trunk_bytes: int,
                   moe: Sequence[ExpertLayer], cache_bytes: int, cold: bool = False,
                   rates: PassRates = PassRates()) -> float:
    """Estimated wall time of one verify pass of `n_rows` rows (see PassRates).

    Distinct experts per layer follow uniform top-k routing (`expected_unique`), which
    overestimates them for wide passes (real routers favour some experts, and neighbouring
    tokens share them: the mini K3 touches 82 where this says 107 at 8 rows), so the estimate
    leans towards narrower verifies when misses are expensive."""
    if n_rows < 1:
        raise ValueError(f"n_rows must be >= 1, got {n_rows}")
    t = layers * (rates.layer_s + n_rows * rates.row_layer_s)
    t += trunk_bytes / rates.mem_bw + 2.0 * trunk_params * n_rows / rates.flops
    distinct = [expected_unique(n_rows, m.top_k, m.n_experts) for m in moe]
    pass_distinct = sum(distinct)
    resident = sum(m.resident_bytes for m in moe) / max(1, len(moe))
    cache_experts = cache_bytes / resident if resident > 0 else 0.0
    read_bw = rates.cold_read_bw if cold else rates.read_bw
    for m, d in zip(moe, distinct, strict=True):
        misses = d * (1.0 - hit_fraction(m, d, pass_distinct, cache_experts))
        t += d * (rates.expert_s + m.resident_bytes / rates.mem_bw)
        t += 2.0 * m.elements * m.top_k * n_rows / rates.flops
        dequant = m.elements / rates.dequant_elems_s if m.dequant_on_miss else 0.0
        t += misses * (dequant + m.file_bytes / read_bw + (rates.cold_read_s if cold else 0.0))
    return t


@dataclass
class Claim:
    """One speculating sequence as the batch allocator sees it."""

    survival: Sequence[float]     # prefix survival a_k of its proposals (prefix_survival)
    max_rows: int                 # widest block it may verify (proposals + 1, tokens left, threshold)
    draft_cost: float = 0.0       # what drafting it first costs (0: already drafted)


def allocate_widths(claims: Sequence[Claim], cost: Callable[[int], float], base_rows: int,
                    base_tokens: float, room: int, spent: float = 0.0, row_cost: float = 0.0,
                    block_cost: float = 0.0) -> list[int]:
    """Verify widths (each >= 1) for sequences sharing one target pass.

    The pass already holds `base_rows` rows (every decoder's anchor row, prompt chunks) that
    commit `base_tokens` tokens; at most `room` more rows fit. Widening sequence i from w to k
    adds sum(a_i[w-1:k-1]) expected tokens and costs cost(R + k - w) - cost(R), plus its draft
    step if it was at width 1 and not drafted yet. Greedy marginal allocation: take the widening
    with the best tokens per second while it raises the pass's tokens per second (E / T). With
    many users the pass is long and the marginal row is cheap relative to it, but E is large
    too, so a sequence must offer a likely token to earn a row; the expected gain must pay for
    the draft step, or the sequence is not drafted at all (width 1). `spent`: time the pass's
    step has taken already (draft steps run before it): the rate counts it, which favours
    wider blocks once the drafts are paid for, as choose_width does for one sequence.
    `row_cost` / `block_cost`: what a verify row beyond the anchor / a verify block of more than
    one row costs on top of cost() (a block's recurrence runs per sequence, row by row, where
    single rows of many sequences step together)."""
    memo: dict[int, float] = {}

    def c(n: int) -> float:
        if n not in memo:
            memo[n] = cost(n)
        return memo[n]

    widths = [1] * len(claims)
    rows, tokens = base_rows, float(base_tokens)
    spent += c(max(rows, 1))
    while room > 0:
        best: tuple[float, int, int, float, float] | None = None      # (ratio, i, k, dE, dT)
        for i, cl in enumerate(claims):
            w = widths[i]
            draft = cl.draft_cost if w == 1 else 0.0
            gain = 0.0
            for k in range(w + 1, min(cl.max_rows, w + room) + 1):
                gain += float(cl.survival[k - 2])
                dt = c(rows + k - w) - c(rows) + draft + row_cost * (k - w) + (block_cost if w == 1 else 0.0)
                ratio = gain / dt if dt > 0 else float("inf")
                if best is None or ratio > best[0]:
                    best = (ratio, i, k, gain, dt)
        if best is None:
            break
        _, i, k, gain, dt = best
        if not (tokens + gain) * spent > tokens * (spent + dt) * (1 + 1e-12):      # E/T would not rise
            break
        room -= k - widths[i]
        rows += k - widths[i]
        widths[i] = k
        tokens += gain
        spent += dt
    return widths


class DraftCost:
    """Seconds of one draft step for n sequences drafted together, fitted to the steps run:
    t(n) = f + p * n, one forward's fixed cost plus what each sequence adds (a server drafts all
    its speculating sequences in one forward, so a sequence's share falls as more draft), least
    squares with forgetting (recent steps weigh most). Until two sizes have been seen, each
    sequence is taken to cost what it did alone (p only): never cheaper than measured."""

    def __init__(self, forget: float = 0.95) -> None:
        self.forget = forget
        self.s = [0.0] * 5          # weighted sums of 1, n, n^2, t, n*t

    def record(self, n: int, seconds: float) -> None:
        if n < 1 or seconds <= 0:
            return
        new = (1.0, n, n * n, seconds, n * seconds)
        self.s = [self.forget * a + b for a, b in zip(self.s, new, strict=True)]

    def coefficients(self) -> tuple[float, float] | None:
        """(f, p) in seconds, or None before any step."""
        s0, s1, s2, t0, t1 = self.s
        if s0 <= 0:
            return None
        det = s0 * s2 - s1 * s1
        if det > 1e-9 * s0 * s2:
            f, p = (s2 * t0 - s1 * t1) / det, (s0 * t1 - s1 * t0) / det
            if p < 0:
                return t0 / s0, 0.0
            if f >= 0:
                return f, p
        return 0.0, t1 / s2

    def per_sequence(self, n: int) -> float | None:
        """One sequence's share of a step that drafts n together (None: no step measured yet)."""
        c = self.coefficients()
        return None if c is None else (c[0] + c[1] * n) / max(1, n)


class DraftGuard:
    """Whether drafting has really paid at a given number of decoding sequences, from the passes run.

    allocate_widths judges a draft by a model of the pass; this judges it by what passes realized:
    committed tokens per second of the whole pass (its draft steps included), apart for passes that
    drafted and passes that did not, per number of decoders `n`. A pass's rate is noisy (a drafted
    pass commits 1 to block+1 tokens; the machine's other load moves pass times by 15% and more),
    so each side keeps the ratio estimate R = sum(tokens) / sum(seconds) over its passes, with
    forgetting (`forget` per pass of that side: recent passes weigh most), and its standard error
    (the ratio estimator's: the spread of tokens_i - R * seconds_i). A verdict needs `samples`
    drafted passes AND a difference of `z` standard errors from (1 + `margin`) x the undrafted
    rate, and one against drafting `samples` undrafted passes too (for one for it, two do):
    where the two are within the noise, nothing is condemned and the allocator decides (its
    passes go on being measured, the undrafted side kept at least a third of the drafted one's
    weight, so the evidence grows on both). Once significant, greedy sequences draft at `n` only
    if drafting realized more (their output does not depend on it), and now and then the other
    way is tried once to see whether that still holds: after `probe_every` questions at `n`, then
    twice as many each time the verdict stands (a probe that drafts where drafting loses costs a
    pass's draft step); a probe that realizes more than (1 + margin) x the undrafted passes sends
    the drafted side back to being measured (`_recheck`: a verdict from a cold start's passes
    would otherwise outlive it by far). Before `samples` drafted passes at `n`: the allocator
    decides, except where drafting lost (at the nearest smaller count that has a verdict): then
    the count starts undrafted (more users leave less room for speculation) and drafts only to
    probe. Every input comes through record(), so the verdicts follow from the pass times given
    and nothing else."""

    MARGIN = 0.25

    def __init__(self, samples: int = 6, probe_every: int = 32, max_interval: int = 512,
                 forget: float = 0.95, z: float = 2.0, judge: bool = True, margin: float = MARGIN) -> None:
        """`judge=False`: allow() always leaves the choice to the allocator (tests that need
        drafting to happen whatever a loaded machine's pass times say).
        `margin`: how much more than the undrafted passes drafted ones must realize to count as
        paying: their rate is held against (1 + margin) x the undrafted rate. What a pass's own
        rate does not show, and drafting costs: drafted sequences finish at different passes, so
        the prompts that follow them no longer share one prefill pass, and the decoding states of
        the pass after a drafted one are stacked anew (measured on the mini, 2 cores, 8 clients:
        drafted passes realized 1.2x the undrafted ones and the run was 0.9x AR; at 4 clients 1.36x
        and 1.10x)."""
        if (samples < 1 or not 2 <= probe_every <= max_interval or not 0 < forget <= 1 or z < 0
                or margin < 0):
            raise ValueError("samples must be >= 1, 2 <= probe_every <= max_interval, forget in (0, 1], "
                             "z >= 0 and margin >= 0")
        self.samples, self.probe_every, self.max_interval = samples, probe_every, max_interval
        self.forget, self.z, self.judge, self.margin = forget, z, judge, margin
        # (n, drafted) -> weighted sums [w, w^2, tokens, seconds, tokens^2, tokens*seconds, seconds^2]
        self.sums: dict[tuple[int, bool], list[float]] = {}
        self.count: dict[tuple[int, bool], int] = {}
        self.asked: dict[int, int] = {}                    # allow() calls per n
        self.last: dict[int, bool] = {}                    # the verdict probes were last timed for, per n
        self.interval: dict[int, int] = {}                 # questions between probes, per n
        self.next_probe: dict[int, int] = {}

    def record(self, n: int, drafted: bool, tokens: float, seconds: float) -> None:
        """A pass with `n` decoders, which drafted or not, committed `tokens` in `seconds`."""
        if n < 1 or seconds <= 0:
            return
        if drafted:
            self._recheck(n, tokens / seconds)
        key, f = (n, drafted), self.forget
        old = self.sums.get(key, [0.0] * 7)
        new = (1.0, 1.0, tokens, seconds, tokens * tokens, tokens * seconds, seconds * seconds)
        self.sums[key] = [f * a + b for a, b in zip(old, new, strict=True)]
        self.sums[key][1] = f * f * old[1] + 1.0              # sum of squared weights
        self.count[key] = self.count.get(key, 0) + 1

    def _recheck(self, n: int, rate: float) -> None:
        """A drafted pass where drafting stands condemned (a probe) that realized more than
        (1 + margin) x the undrafted passes at n: the verdict may rest on passes that no longer say
        how this machine runs (a cold start's first draft steps weigh in it until forgotten, which at
        one probe in 32..512 questions takes thousands of passes), so the drafted side where it was reached is
        measured again (`samples` passes, the allocator deciding) and judged afresh."""
        source = next((m for m in range(n, 0, -1) if self.measured(m)), None)
        if source is None or self._judged(source) is not False:
            return
        undrafted = self.rate(n, False)
        if undrafted is None or rate <= (1 + self.margin) * undrafted:
            return
        for m in {source, n}:
            self.sums.pop((m, True), None)
            self.count.pop((m, True), None)

    def rate(self, n: int, drafted: bool) -> float | None:
        """Realized tokens per second (the ratio estimate), None before any pass."""
        s = self.sums.get((n, drafted))
        return None if s is None or s[3] <= 0 else s[2] / s[3]

    def _stat(self, n: int, drafted: bool) -> tuple[float, float]:
        """(R, variance of R) of one side."""
        w, w2, t, sec, tt, ts, ss = self.sums[(n, drafted)]
        r = t / sec
        resid = max(0.0, (tt - 2 * r * ts + r * r * ss) / w)
        return r, resid * w2 / (sec * sec)

    def measured(self, n: int) -> bool:
        """Enough passes at n for a verdict: `samples` drafted ones and a few undrafted ones (a
        verdict against drafting asks for `samples` of those too, see _judged)."""
        return (self.count.get((n, True), 0) >= self.samples
                and self.count.get((n, False), 0) >= min(2, self.samples))

    def _judged(self, n: int) -> bool | None:
        """n's own verdict: both sides measured and `z` standard errors apart (None: not so).
        Drafting is only condemned on `samples` undrafted passes: a wrong False costs the gain until
        a probe turns it, a wrong True only leaves the choice to the allocator, as before a verdict."""
        if not self.measured(n):
            return None
        rt, vt = self._stat(n, True)
        rf, vf = self._stat(n, False)
        rf, vf = (1 + self.margin) * rf, (1 + self.margin) ** 2 * vf     # what drafting must beat
        if (rt - rf) ** 2 <= self.z ** 2 * (vt + vf) and rt != rf:
            return None
        if rt >= rf:
            return True
        return False if self.count.get((n, False), 0) >= self.samples else None

    def verdict(self, n: int) -> bool | None:
        """True: drafting has realized more than (1 + margin) x the undrafted rate at n, beyond the
        noise; False: less; None: not known. A count not measured both ways takes the nearest
        smaller one's verdict, except that what drafting gained there is scaled down to n first:
        a pass's fixed cost, which drafting spreads over more tokens, is already shared by more
        sequences, so a ratio r realized at m is taken as 1 + (r - 1) m / n at n (on the mini, 2
        cores: 2.03, 1.80, 1.46, 1.00 realized at 1, 2, 4, 8 decoders; from 4 this foresees 1.23
        at 8), and where that falls short of the margin drafting starts there condemned (it is
        only probed, until the probes have measured n itself)."""
        for m in range(n, 0, -1):
            if self.measured(m):
                judged = self._judged(m)
                if m == n or judged is False:
                    return judged
                r = self._stat(m, True)[0] / self._stat(m, False)[0]
                return False if 1 + (r - 1) * m / n < 1 + self.margin else judged
        return None

    def _probe(self, n: int, k: int, verdict: bool) -> bool:
        """Is question k at n the one to try the other way? The interval doubles (up to
        `max_interval`) each time a verdict holds, and starts again at `probe_every` when it turns."""
        if self.last.get(n) != verdict:
            self.last[n] = verdict
            self.interval[n] = self.probe_every
            self.next_probe[n] = k + self.probe_every
        if k < self.next_probe[n]:
            return False
        self.interval[n] = min(2 * self.interval[n], self.max_interval)
        self.next_probe[n] = k + self.interval[n]
        return True

    def allow(self, n: int) -> bool:
        """May greedy sequences draft in this pass of `n` decoders?"""
        k = self.asked[n] = self.asked.get(n, 0) + 1
        if not self.judge:
            return True
        own = self._judged(n)
        if own is not None:
            return own != self._probe(n, k, own)           # the other way now and then, to recheck
        if self.count.get((n, True), 0) < self.samples:
            if self.verdict(n) is False:
                return self._probe(n, k, False)            # fewer users lost with drafts: start without
            return True                                    # the allocator decides; its passes are measured
        if self.count.get((n, False), 0) < self.samples:
            return False                                   # drafted enough here: measure the other side
        # measured both ways, within the noise: the allocator decides, the undrafted side kept in view
        return 3 * self.sums[(n, False)][0] >= self.sums[(n, True)][0]
