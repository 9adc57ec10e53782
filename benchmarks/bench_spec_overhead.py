"""The batch server with a draft vs without, in process (no HTTP): what drafting costs where it does not pay.

    python benchmarks/bench_spec_overhead.py [--model PATH --draft PATH] [--concurrency 1,8,16]
                                             [--requests 2] [--max-tokens 32] [--threads 1]
                                             [--repeat 5] [--max-batch 256] [--declined]

Default: the shipped mini K3 and its drafter. Two BatchSchedulers share one loaded model, as
`k3kit serve` and `k3kit serve --draft` would build them (the same ScheduleConfig, `--feature-ring
f16`), each kept for the whole run like a server's, so the draft side's guard and cost fits learn
as they would in service. `--repeat` sweeps over the concurrencies, as bench_serve.py runs them: at
each N, N clients each send `--requests` greedy requests one after the other (bench_serve.py's
prompts, `--max-tokens`); AR and draft take turns, the order flipping every sweep. Reported per
N: aggregate generated tok/s of each (median, min-max),
draft / AR per repeat and its median, the share of the draft server's passes that drafted,
whether every request's tokens were AR's (greedy output must not depend on the draft), and the
same ratio in tokens per CPU second of the worker thread (median, min-max): the other jobs on a
shared machine move wall time far more than that.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import PROMPTS  # noqa: E402


def worker_cpu(sched: Any) -> float:
    """CPU seconds the scheduler's worker thread has run (what the machine's other load does not
    inflate as much as wall time: a descheduled thread is not charged)."""
    return time.clock_gettime(time.pthread_getcpuclockid(sched._thread.ident))


def run_clients(sched: Any, reqs: list[list[Any]]) -> tuple[float, float, list[list[list[int]]]]:
    """Every client's requests one after the other, all clients at once.
    -> (wall seconds, worker CPU seconds, tokens)."""
    from k3kit.serve.scheduler import FinishEvent, TokenEvent

    async def client(rs: list[Any]) -> list[list[int]]:
        out = []
        for r in rs:
            tokens: list[int] = []
            async for ev in sched.submit(r):
                if isinstance(ev, TokenEvent):
                    tokens += ev.tokens
                elif isinstance(ev, FinishEvent) and ev.reason not in ("stop", "length"):
                    raise RuntimeError(f"request ended with {ev.reason}: {ev.error}")
            out.append(tokens)
        return out

    async def main() -> list[list[list[int]]]:
        return list(await asyncio.gather(*[client(rs) for rs in reqs]))

    t0, c0 = time.perf_counter(), worker_cpu(sched)
    got = asyncio.run(main())
    return time.perf_counter() - t0, worker_cpu(sched) - c0, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--declined", action="store_true",
                    help="the draft server never drafts (its guard says no every pass): what the draft "
                         "side's bookkeeping alone costs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from k3kit.adapters.session import open_session
    from k3kit.mini.paths import shipped_draft, shipped_gguf
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling
    from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder
    from k3kit.runtime.speculative.schedule import DraftGuard
    from k3kit.serve.batch import BatchScheduler
    from k3kit.serve.scheduler import GenerationRequest

    session = open_session(args.model or shipped_gguf(), LoadOptions(), draft=args.draft or shipped_draft())
    model, codec, draft = session.model, session.codec, session.draft_model
    stop = codec.stop_ids()
    schedule = ScheduleConfig(draft_cost=None)      # `k3kit serve --draft`'s defaults

    def build(target: Any, sampler: Any) -> SpeculativeDecoder:
        return SpeculativeDecoder(target, draft, sampler.sampling, sampler.generator, schedule=schedule,
                                  ring_storage="f16", stop_ids=stop)

    ar = BatchScheduler(model, codec, loaded=session.target, max_batch=args.max_batch, max_queue=64)
    guard = None
    if args.declined:
        class Never(DraftGuard):
            def allow(self, n: int) -> bool:
                return False
        guard = Never()
    sp = BatchScheduler(model, codec, loaded=session.target, max_batch=args.max_batch, max_queue=64,
                        step_factory=build, guard=guard)
    prompts = [tuple(codec.encode(p)) for p in PROMPTS]
    sizes = [int(x) for x in args.concurrency.split(",")]
    print(f"{'N':>3} {'AR tok/s':>22} {'draft tok/s':>22} {'draft/AR per repeat':>40} {'median':>7} "
          f"{'drafted':>8} {'same':>5} {'cpu d/AR':>8}", flush=True)
    tok: dict[tuple[str, int], list[float]] = {}
    cpu_tok: dict[tuple[str, int], list[float]] = {}
    passes: dict[int, list[int]] = {n: [0, 0] for n in sizes}      # decode passes, drafted ones
    same: dict[int, bool] = {n: True for n in sizes}
    try:
        for rep in range(args.repeat):            # sweeps, as bench_serve.py runs them
            for n in sizes:
                reqs = [[GenerationRequest(prompts[(c + k) % len(prompts)], args.max_tokens,
                                           make_sampling(0.0, seed=0)) for k in range(args.requests)]
                        for c in range(n)]
                order = [("ar", ar), ("sp", sp)] if rep % 2 == 0 else [("sp", sp), ("ar", ar)]
                outs = {}
                for name, sched in order:
                    before = sched.stats()
                    dt, cpu, got = run_clients(sched, reqs)
                    after = sched.stats()
                    outs[name] = got
                    n_tok = sum(len(t) for c in got for t in c)
                    tok.setdefault((name, n), []).append(n_tok / dt)
                    cpu_tok.setdefault((name, n), []).append(n_tok / cpu)
                    if name == "sp":   # (getattr: the counters are new; this also runs on older trees)
                        for j, key in enumerate(("decode_passes", "drafted_passes")):
                            passes[n][j] += getattr(after, key, 0) - getattr(before, key, 0)
                same[n] = same[n] and outs["ar"] == outs["sp"]
                print(f"  sweep {rep} N={n}: AR {tok[('ar', n)][-1]:.1f}, draft {tok[('sp', n)][-1]:.1f} "
                      "tok/s", flush=True)
        print(f"{'N':>3} {'AR tok/s':>22} {'draft tok/s':>22} {'draft/AR per repeat':>40} {'median':>7} "
              f"{'drafted':>8} {'same':>5} {'cpu d/AR':>8}", flush=True)
        for n in sizes:
            ratios = [s / a for s, a in zip(tok[("sp", n)], tok[("ar", n)], strict=True)]
            cpu_ratios = [s / a for s, a in zip(cpu_tok[("sp", n)], cpu_tok[("ar", n)], strict=True)]

            def fmt(v: list[float]) -> str:
                return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
            print(f"{n:>3} {fmt(tok[('ar', n)]):>22} {fmt(tok[('sp', n)]):>22} "
                  f"{', '.join(f'{r:.2f}' for r in ratios):>40} {statistics.median(ratios):>7.3f} "
                  f"{passes[n][1] / max(1, passes[n][0]):>8.1%} "
                  f"{'yes' if same[n] else 'NO':>5} {statistics.median(cpu_ratios):>8.3f} "
                  f"({min(cpu_ratios):.2f}-{max(cpu_ratios):.2f})", flush=True)
    finally:
        ar.close()
        sp.close()
        session.close()


if __name__ == "__main__":
    main()
