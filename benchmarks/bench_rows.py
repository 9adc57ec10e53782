"""What batching rows costs: matmul_q8 on m rows as a multiple of its one-row time, per type.

    python benchmarks/bench_rows.py [--types Q8_0,Q4_K,MXFP4,IQ1_S,IQ3_XXS] [--rows 1,2,4,8,16]
                                    [--shape 7168x2048] [--threads 1] [--reps 7] [--path -1] [--ab TREE]

A serving pass with 8 decoding sequences (or a speculative verify block) multiplies every weight
matrix by a few rows; the serving goal (8 clients >= 4x one) needs those few rows to cost little
more than one. Per type and row count this prints the median (min-max) ms of the default path
(`--path` forces one, as matmul_q8 takes it) and its multiple of the one-row median. The row
counts are timed in turns (1, 2, 4, ..., 1, 2, ...) so that a noisy machine slows all alike.
To compare two builds, `--ab TREE` loads TREE's built extension (src/k3kit/kernels/_qmatmul*.so)
beside this one and times both in the same turns, alternating which goes first: per type and
row count it prints that build's median over this one's and whether their outputs have the same
bits. Random valid blocks of bench_qmatmul's kind; 1 thread is timed with the thread's
CPU clock (steadier on a shared machine), more with wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from types import ModuleType

import numpy as np
from bench_qmatmul import random_blocks
from gguf import GGMLQuantizationType as T

from k3kit.kernels import qmatmul


def load_build(tree: str) -> ModuleType:
    """The _qmatmul extension built in another tree, loaded beside this one (its IQ tables set)."""
    found = sorted(Path(tree, "src", "k3kit", "kernels").glob("_qmatmul*.so"))
    if not found:
        raise SystemExit(f"--ab {tree}: no built _qmatmul*.so under src/k3kit/kernels")
    spec = importlib.util.spec_from_file_location("k3kit_ab._qmatmul", found[0])
    assert spec is not None and spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    qmatmul._init_tables(ext)
    return ext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q8_0,Q4_K,MXFP4,IQ1_S,IQ3_XXS")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--shape", default="7168x2048", help="n_in x n_out")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--path", type=int, default=-1, help="matmul_q8's path argument (-1: its own choice)")
    ap.add_argument("--ab", metavar="TREE", help="also time TREE's built extension, alternated with this one")
    args = ap.parse_args()
    if not qmatmul.native_available():
        raise SystemExit("the native kernels are not built (pip install -e . with a C compiler)")
    kernel = qmatmul._qmatmul
    other = load_build(args.ab) if args.ab else None
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    k, n_out = (int(v) for v in args.shape.split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{qmatmul.__file__}; {k} x {n_out} (n_in x n_out); threads {args.threads}; path {args.path}; "
          f"median (min-max) of {args.reps}, {'cpu' if args.threads == 1 else 'wall'} clock")
    print("| type | " + " | ".join(f"{m} row{'s' if m > 1 else ''} ms" for m in rows) + " | "
          + " | ".join(f"x{m}" for m in rows if m != rows[0]) + " |")
    if other is not None:
        print(f"--ab {args.ab}: its median / this one's per row count, and whether the outputs have the "
              "same bits")
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        qtype = T[name]
        raw = random_blocks(qtype, n_out, k, rng)
        xs = {m: rng.standard_normal((m, k)).astype(np.float32) for m in rows}
        builds = [kernel] if other is None else [kernel, other]
        ys = [{m: np.empty((m, n_out), np.float32) for m in rows} for _ in builds]
        times: list[dict[int, list[float]]] = [{m: [] for m in rows} for _ in builds]
        for rep in range(args.reps + 1):
            for m in rows:
                for b in (range(len(builds)) if rep % 2 == 0 else reversed(range(len(builds)))):
                    t = clock()
                    builds[b].matmul_q8(int(qtype), raw, xs[m], ys[b][m], n_out, k, m, -1, args.threads, 1,
                                        args.path)
                    if rep:   # the first turn warms caches and pages
                        times[b][m].append(clock() - t)
        med = {m: float(np.median(ts)) for m, ts in times[0].items()}
        cells = [f"{med[m] * 1e3:.2f} ({min(times[0][m]) * 1e3:.2f}-{max(times[0][m]) * 1e3:.2f})"
                 for m in rows]
        ratios = [f"{med[m] / med[rows[0]]:.2f}" for m in rows if m != rows[0]]
        print(f"| {name} | " + " | ".join(cells + ratios) + " |", flush=True)
        if other is not None:
            same = {m: np.array_equal(ys[0][m].view(np.uint32), ys[1][m].view(np.uint32)) for m in rows}
            ab = [f"{m} rows {float(np.median(times[1][m])) / med[m]:.3f} "
                  f"({'same bits' if same[m] else 'BITS DIFFER'})" for m in rows]
            print(f"  --ab / this, {name}: " + ", ".join(ab), flush=True)

if __name__ == "__main__":
    main()
