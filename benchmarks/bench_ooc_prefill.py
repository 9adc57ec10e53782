"""Prefill of a long prompt on a model bigger than RAM: expert bytes read per chunk, against the
disk's limit.

    python benchmarks/bench_ooc_prefill.py FILE [--prompt-tokens 512] [--chunk 256] [--threads 1]
        [--modes default,cold]

A prompt chunk routes each row to its top-k experts; the store is asked for each distinct expert
of a layer once per chunk (the MoE layer plans them all, then multiplies one expert's rows at a
time), so a chunk should read each of its experts once, whatever the cache holds, and the reads
should run at the disk's pace while the products overlap them. Per mode, in a child process of
its own (the file's pages dropped first, the disk's O_DIRECT limit measured right before): the
prompt (token ids drawn with a fixed seed) is prefilled with one greedy token after it; printed:
prefill seconds, the distinct (layer, expert) pairs the chunks planned (each chunk's MoE layers'
plans, summed over chunks), the misses and expert bytes the store read, bytes read per planned
expert (1.00 = each once per chunk, less when the cache still held some), the payload rate, its
fraction of the limit, and peak RSS. Modes: `default` (what `k3kit generate` does with no flags:
`--expert-io auto` and a cache sized from free RAM), `cold` (`--cold --expert-cache-mib 1024`).
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


def child(path: Path, mode: str, n_prompt: int, chunk: int, threads: int) -> None:
    import numpy as np
    import torch
    from ooc_disk import drop_cache, quick_seq, status

    from k3kit.adapters import load_model
    from k3kit.plan.expert_io import for_model
    from k3kit.runtime.engine import generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling

    torch.set_num_threads(threads)
    if mode == "default":
        choice = for_model(path, "auto", None)
        mib, cold = choice.cache_mib, choice.cold
    else:
        mib, cold = 1024.0, True
    lm = load_model(path, LoadOptions(expert_cache_mib=mib, cold=cold))
    adapter = lm.model
    store = adapter.store
    planned: list[int] = []
    plan = store.plan

    def counting_plan(layer: int, experts, *a, **kw):
        planned.append(len(set(experts)))
        return plan(layer, experts, *a, **kw)

    store.plan = counting_plan
    vocab = adapter.vocab_size
    ids = np.random.default_rng(0).integers(1000, vocab - 1000, n_prompt).tolist()
    drop_cache(path)
    limit = quick_seq(path, 0)
    store.reset_stats()
    t0 = time.perf_counter()
    r = generate(adapter, ids, max_tokens=1, sampling=make_sampling(0.0, seed=0), prefill_chunk=chunk)
    dt = time.perf_counter() - t0
    s = store.stats()
    per_expert = s.bytes_read / max(s.misses, 1)
    print(json.dumps({"mode": mode, "cache_mib": mib, "prefill_s": dt, "planned": sum(planned),
                      "misses": s.misses, "hits": s.hits, "bytes_read": s.bytes_read, "io_bytes": s.io_bytes,
                      "per_expert": per_expert, "limit_Bps": limit, "peak_rss": status("VmHWM"),
                      "prefill_tok_s": r.stats.prefill_tok_s}))
    lm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256, help="prompt rows per pass (--prefill-chunk)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="default,cold")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.file, args.child, args.prompt_tokens, args.chunk, args.threads)
        return
    from k3kit.bench.run import cpu_info
    size = args.file.stat().st_size / 1e9
    print(f"{cpu_info()}, {os.cpu_count()} CPUs, {args.threads} thread(s); {args.file} ({size:.1f} GB); "
          f"{args.prompt_tokens}-token prompt in chunks of {args.chunk}")
    print("| run | prefill s | planned experts | misses | MB read | read / planned | payload MB/s "
          "| limit MB/s | of limit | peak RSS GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        cmd = [sys.executable, str(Path(__file__).resolve()), str(args.file), "--child", mode,
               "--prompt-tokens", str(args.prompt_tokens), "--chunk", str(args.chunk),
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, cwd=HERE,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                 p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)))
        if out.returncode != 0:
            print(f"| {mode} | failed: {out.stderr.strip().splitlines()[-1:]} |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rate = r["bytes_read"] / r["prefill_s"]
        name = f"{mode} ({r['cache_mib']:.0f} MiB cache)"
        cells = [name, f"{r['prefill_s']:.1f}", r["planned"], r["misses"], f"{r['bytes_read'] / 1e6:.0f}",
                 f"{r['misses'] / max(r['planned'], 1):.2f}", f"{rate / 1e6:.0f}",
                 f"{r['limit_Bps'] / 1e6:.0f}", f"{rate / r['limit_Bps']:.2f}",
                 f"{r['peak_rss'] / 2**30:.2f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
