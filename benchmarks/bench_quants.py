"""Quantize throughput of k3kit's numpy codecs against ggml's reference quantizers.

Both sides quantize (then dequantize: the `deq` rows) the same float32 matrix in one thread
(ggml_quantize_chunk runs in the calling thread; numpy's elementwise ufuncs are single-threaded).
Runs alternate between the two sides and the best of N is kept, so background load hits both
alike. The ratio printed is k3kit / ggml (higher is better, 1.0 = as fast as C).

    python benchmarks/bench_quants.py [--rows 512] [--cols 4096] [--reps 5] [--types Q4_K,Q8_0,MXFP4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from k3kit.gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "interop"))
import ggml_oracle  # noqa: E402


def best_of(fn, reps: int) -> float:
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--types", default="Q4_K,Q8_0,MXFP4")
    args = ap.parse_args()

    ggml = ggml_oracle.load()
    if ggml is None:
        print("llama_cpp (libggml-base) not found: pip install llama-cpp-python==0.3.36", file=sys.stderr)
        return 2
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    print(f"data: {args.rows} x {args.cols} float32 gaussian, best of {args.reps}, single thread")
    print(f"{'type':6s} {'k3kit Melem/s':>14s} {'ggml Melem/s':>13s} {'ratio':>6s}  bit-exact")
    for name in args.types.split(","):
        t = GGMLQuantizationType[name]
        ours = quants.quantize(x, t)
        ref = ggml.quantize(x, t)
        k3 = g = float("inf")
        for _ in range(args.reps):  # alternate so load spikes hit both sides
            k3 = min(k3, best_of(lambda t=t: quants.quantize(x, t), 1))
            g = min(g, best_of(lambda t=t: ggml.quantize(x, t), 1))
        same = bool(np.array_equal(ours, ref))
        print(f"{name:6s} {x.size / k3 / 1e6:14.1f} {x.size / g / 1e6:13.1f} {g / k3:6.2f}  {same}")
        dk = dg = float("inf")
        for _ in range(args.reps):
            dk = min(dk, best_of(lambda t=t, r=ref: quants.dequantize(r, t, x.size), 1))
            dg = min(dg, best_of(lambda t=t, r=ref: ggml.dequantize(r, t, x.size), 1))
        deq_same = bool(np.array_equal(quants.dequantize(ref, t, x.size), ggml.dequantize(ref, t, x.size)))
        print(f"{'  deq':6s} {x.size / dk / 1e6:14.1f} {x.size / dg / 1e6:13.1f} {dg / dk:6.2f}  {deq_same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
