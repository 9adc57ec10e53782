"""A model bigger than RAM while its expert cache fills: decode tok/s per window of tokens.

    python benchmarks/bench_cache_fill.py FILE [--tokens 96] [--window 16] [--threads 1]
        [--ab TREE] [--reps 1]

The default load (`--expert-io auto`: O_DIRECT reads into an expert cache sized from the RAM
left) starts empty and fills over the first tokens; every miss until then needs fresh memory,
which on lazily backed virtual machines costs more than the read (k3kit.runtime.experts.grow).
Each run is a child process of its own (a fresh cache, nothing of the previous run's memory
left to reuse): greedy decoding of `--tokens` after the prompt "The fox", the time of every
token, reported per `--window` tokens, with the cache's hits, misses and resident bytes at the
end. The peer in the same run: a 1 GiB cache with O_DIRECT reads (`--cold --expert-cache-mib
1024`, full after two tokens, then recycling). `--ab TREE` also runs the default load on
another checkout's sources (TREE/src, extensions built or copied in), alternated `--reps` times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(path: str, mode: str, tokens: int, threads: int) -> None:
    import torch

    from k3kit.adapters import load_model
    from k3kit.plan.expert_io import for_model
    from k3kit.runtime.engine import generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling

    torch.set_num_threads(threads)
    if mode == "default":
        choice = for_model(Path(path), "auto", None)
        mib, cold = choice.cache_mib, choice.cold
    else:
        mib, cold = 1024.0, True
    lm = load_model(path, LoadOptions(expert_cache_mib=mib, cold=cold))
    marks: list[float] = []
    r = generate(lm.model, lm.codec.encode("The fox"), max_tokens=tokens, sampling=make_sampling(0.0, seed=0),
                 on_token=lambda _: marks.append(time.perf_counter()))
    s = lm.model.store.stats()
    print(json.dumps({"gaps": [b - a for a, b in zip(marks, marks[1:], strict=False)], "tokens": r.token_ids,
                      "hits": s.hits, "misses": s.misses, "resident_mib": s.resident_bytes / (1 << 20),
                      "cache_mib": mib}))
    lm.close()


def run(tree: Path, path: str, mode: str, tokens: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    cmd = [sys.executable, str(Path(__file__).resolve()), path, "--child", mode, "--tokens", str(tokens),
           "--threads", str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"{mode} run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def windows(gaps: list[float], w: int) -> list[float]:
    return [len(g) / sum(g) for g in (gaps[i:i + w] for i in range(0, len(gaps), w)) if g]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ab", type=Path, default=None, help="another checkout: its default load too")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.file, args.child, args.tokens, args.threads)
        return
    from k3kit.bench.run import cpu_info
    here = HERE.parent
    runs = [("this, default", here, "default"), ("this, 1 GiB cold", here, "cold")]
    if args.ab is not None:
        runs.append((f"{args.ab}, default", args.ab, "default"))
    print(f"{cpu_info()}, {os.cpu_count()} CPUs, {args.threads} thread(s); {args.file}")
    results: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    for _ in range(args.reps):
        for name, tree, mode in runs:
            results[name].append(run(tree, args.file, mode, args.tokens, args.threads))
    first = next(iter(results.values()))[0]["tokens"]
    n = args.tokens - 1
    heads = [f"{i + 1}-{min(i + args.window, n)}" for i in range(0, n, args.window)]
    print("| run | " + " | ".join(heads) + " | all | hits / misses | cache MiB held / budget |")
    print("|---|" + "---:|" * (len(heads) + 3))
    for name, rs in results.items():
        for r in rs:
            w = windows(r["gaps"], args.window)
            total = len(r["gaps"]) / sum(r["gaps"])
            print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in w) + f" | {total:.2f} | {r['hits']} / "
                  f"{r['misses']} | {r['resident_mib']:.0f} / {r['cache_mib']:.0f} |")
            if r["tokens"] != first:
                print(f"  {name}: tokens differ from the first run's", file=sys.stderr)
    print("(tok/s per window of decoded tokens; the first token after the prompt is not timed)")


if __name__ == "__main__":
    main()
