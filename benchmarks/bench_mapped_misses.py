"""Expert misses multiplied where they lie in the page cache vs copied out of it, in one process.

    python benchmarks/bench_mapped_misses.py --model SLICE.gguf [--threads 1] [--cache-mib 128]
                                             [--prompt 8] [--tokens 8] [--reps 3]
                                             [--modes copied,mapped-4k-sync,mapped-4k,mapped-sync,mapped]

`ExpertStore(map_misses=True)` (the default) serves a quantized miss whose slices are in the page
cache as views of the mapping; `map_misses=False` copies them into cache buffers (read ahead by
background threads). Modes:
  copied          map_misses=False;
  mapped-4k-sync  views mapped on the caller's thread, the page cache in 4 KiB pages (the experts'
                  page cache is dropped and read again with pread before the run): last session's
                  mapped path;
  mapped-4k       the same, views mapped one expert ahead by the mapping thread (map_ahead);
  mapped-sync     the page cache in 2 MiB folios (huge_pages: a slice found in 4 KiB pages is
                  read again once, during the untimed warm-up), mapped on the caller's thread;
  mapped          2 MiB folios and the mapping thread: the default.
One loaded model, the store switched and cleared before each run, the mode order rotating per
rep; each run is an untimed warm-up request, then the timed one: greedy decode through a cache
smaller than a token's experts. Prints per run decode tok/s, CPU seconds of the process (threads
included), the seconds the caller spent reading and waiting for reads, hits and misses; then
the medians, each mode / copied, and whether the tokens agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_slice import prompt_tokens  # noqa: E402

from k3kit.adapters import load_model  # noqa: E402
from k3kit.runtime.engine import generate  # noqa: E402
from k3kit.runtime.experts import ExpertStore  # noqa: E402
from k3kit.runtime.loader import LoadOptions  # noqa: E402
from k3kit.runtime.sampling import make_sampling  # noqa: E402

MODES = ("copied", "mapped-4k-sync", "mapped-4k", "mapped-sync", "mapped")


def small_pages(store: ExpertStore) -> None:
    """Put every expert range's page cache in 4 KiB pages: drop it, read it again with pread (the
    store's files are POSIX_FADV_RANDOM: no readahead, so no large folios)."""
    buf = np.empty(8 << 20, np.uint8)
    for tensors in store.layers.values():
        for t in tensors:
            f = store._files[t.path]            # type: ignore[index]
            f.release(t.offset, t.nbytes)
            os.posix_fadvise(f.fd, t.offset, t.nbytes, os.POSIX_FADV_DONTNEED)
            for lo in range(t.offset, t.offset + t.nbytes, buf.nbytes):
                f.pread_into(buf[:min(buf.nbytes, t.offset + t.nbytes - lo)], lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-mib", type=float, default=128)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    torch.set_num_threads(args.threads)
    opts = LoadOptions(expert_cache_mib=args.cache_mib, expert_kernel="native")
    runs: dict[str, list[tuple[float, float, list[int]]]] = {m: [] for m in modes}
    with load_model(Path(args.model), opts) as lm:
        store = lm.model.store
        prompt = prompt_tokens(args.prompt)
        generate(lm.model, prompt, max_tokens=2, sampling=make_sampling(0.0, seed=0))   # trunk faulted in
        for rep in range(args.reps):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                store.clear()
                store.map_misses = mode != "copied"
                store.huge_pages = "4k" not in mode
                store.map_ahead = not mode.endswith("sync")
                store._rehomed.clear()
                if "4k" in mode:
                    small_pages(store)
                generate(lm.model, prompt, max_tokens=3, sampling=make_sampling(0.0, seed=0))  # warm-up
                store.reset_stats()
                cpu = time.process_time()
                greedy = make_sampling(0.0, seed=0)
                r = generate(lm.model, prompt, max_tokens=args.tokens + 1, sampling=greedy)
                cpu = time.process_time() - cpu
                s = store.stats()
                runs[mode].append((r.stats.decode_tok_s, cpu, list(r.token_ids)))
                print(f"{mode:15s} decode {r.stats.decode_tok_s:.2f} tok/s, cpu {cpu:.2f} s, read "
                      f"{s.read_seconds:.3f} s, wait {s.wait_seconds:.3f} s, hits {s.hits}, misses "
                      f"{s.misses}, ahead {s.ahead_reads}", flush=True)
    base = statistics.median(d for d, _, _ in runs[modes[0]])
    want = runs[modes[0]][0][2]
    for mode, v in runs.items():
        med = statistics.median(d for d, _, _ in v)
        cpu = statistics.median(c for _, c, _ in v)
        print(f"{mode:15s} median decode {med:.2f} tok/s (min {min(d for d, _, _ in v):.2f}, max "
              f"{max(d for d, _, _ in v):.2f}), / {modes[0]} {med / base:.2f}, CPU s {cpu:.2f}, "
              f"same tokens: {all(t == want for _, _, t in v)}")


if __name__ == "__main__":
    main()
