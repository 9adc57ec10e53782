"""Expert misses multiplied where they lie in the page cache vs copied out of it, in one process.

    python benchmarks/bench_mapped_misses.py --model SLICE.gguf [--threads 1] [--cache-mib 128]
                                             [--prompt 8] [--tokens 8] [--reps 3]

`ExpertStore(map_misses=True)` (the default) serves a quantized miss whose slices are in the page
cache as views of the mapping; `map_misses=False` copies them into cache buffers (read ahead by
background threads). One loaded model, the store switched between the two and cleared before each
run, the order alternating per rep; greedy decode through a cache smaller than a token's experts.
Prints per run decode tok/s, CPU seconds of the process (readers included), the seconds the caller
spent reading and waiting for reads, and the misses; then the medians, mapped / copied, and whether
the tokens agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_slice import prompt_tokens  # noqa: E402

from k3kit.adapters import load_model  # noqa: E402
from k3kit.runtime.engine import generate  # noqa: E402
from k3kit.runtime.loader import LoadOptions  # noqa: E402
from k3kit.runtime.sampling import make_sampling  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-mib", type=float, default=128)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    opts = LoadOptions(expert_cache_mib=args.cache_mib, expert_kernel="native")
    runs: dict[bool, list[tuple[float, float, list[int]]]] = {True: [], False: []}
    with load_model(Path(args.model), opts) as lm:
        store = lm.model.store
        prompt = prompt_tokens(args.prompt)
        generate(lm.model, prompt, max_tokens=2, sampling=make_sampling(0.0, seed=0))   # trunk faulted in
        for rep in range(args.reps):
            for mapped in ((True, False) if rep % 2 == 0 else (False, True)):
                store.map_misses = mapped
                store.clear()
                store.reset_stats()
                cpu = time.process_time()
                greedy = make_sampling(0.0, seed=0)
                r = generate(lm.model, prompt, max_tokens=args.tokens + 1, sampling=greedy)
                cpu = time.process_time() - cpu
                s = store.stats()
                runs[mapped].append((r.stats.decode_tok_s, cpu, list(r.token_ids)))
                print(f"{'mapped' if mapped else 'copied'}: decode {r.stats.decode_tok_s:.2f} tok/s, "
                      f"cpu {cpu:.2f} s, read {s.read_seconds:.3f} s, wait {s.wait_seconds:.3f} s, "
                      f"misses {s.misses}, read ahead {s.ahead_reads}", flush=True)
    med = {k: statistics.median(d for d, _, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c, _ in v) for k, v in runs.items()}
    same = all(a[2] == b[2] for a, b in zip(runs[True], runs[False], strict=True))
    print(f"median decode: mapped {med[True]:.2f}, copied {med[False]:.2f} tok/s, mapped / copied "
          f"{med[True] / med[False]:.2f}; CPU s mapped {cpu[True]:.2f}, copied {cpu[False]:.2f}; "
          f"same tokens: {same}")


if __name__ == "__main__":
    main()
