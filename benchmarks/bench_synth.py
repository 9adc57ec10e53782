"""`k3kit synth` write speed against `cp` of the files it wrote, in the same run.

Synth should be I/O-bound: its bytes come from pre-generated random block pools, so writing
a K3-geometry model should run near the speed of copying the same bytes. Both sides end with
their files fsynced (synth fsyncs every shard; the copy is followed by `sync -f` on each
copy), and the page cache is flushed with `sync` before each timed step. Runs alternate
(synth, cp, synth, cp, ...) and the best of --reps is kept. The ratio is synth / cp speed
(1.0 = as fast as cp).

    python benchmarks/bench_synth.py [--dir DIR] [--layers 4] [--experts 16] [--vocab 2048]
                                     [--shards 4] [--reps 2]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from k3kit.gguf.synth import synthesize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-synth-", dir=args.dir))
    best_synth = best_cp = float("inf")
    nbytes = 0
    try:
        for _ in range(args.reps):
            for d in ("synth", "copy"):
                shutil.rmtree(root / d, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            t0 = time.perf_counter()
            result = synthesize(root / "synth", "k3", args.layers, args.experts, vocab=args.vocab,
                                shards=args.shards, seed=0, progress=False)
            best_synth = min(best_synth, time.perf_counter() - t0)
            nbytes = result.file_bytes

            subprocess.run(["sync"], check=True)
            (root / "copy").mkdir()
            t0 = time.perf_counter()
            subprocess.run(["cp", *result.paths, str(root / "copy")], check=True)
            subprocess.run(["sync", "-f", *map(str, (root / "copy").iterdir())], check=True)
            best_cp = min(best_cp, time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = nbytes / 1e9
    print(f"model: k3 geometry, {args.layers} layers, {args.experts} experts, vocab {args.vocab}, "
          f"{args.shards} shards, {gb:.3f} GB")
    print(f"synth: {best_synth:.2f} s  {gb / best_synth:.2f} GB/s  (plan + pools + write + fsync)")
    print(f"cp:    {best_cp:.2f} s  {gb / best_cp:.2f} GB/s  (cp + sync -f)")
    print(f"ratio synth/cp speed: {best_cp / best_synth:.2f}")


if __name__ == "__main__":
    main()
