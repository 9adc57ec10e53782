"""One K3 expert matrix times m rows: the native MXFP4 kernel against dequantize-then-matmul.

    python benchmarks/bench_qmatmul.py [--threads 1] [--rows 1,2,4,8,16,32,64] [--reps 5]

The matrix is K3's expert shape (7168 x 2048, MXFP4, random blocks with realistic scales).
Per row count it times, in one run:
  native   QuantizedMatrix's kernel on the bytes (each vector path the CPU has, and scalar
           for m <= 4), what a quantized expert cache runs for a hit or a miss;
  miss     dequantize to bf16, then torch's matmul: what a dequantizing cache pays on a miss;
  hit      torch's matmul on an already dequantized bf16 matrix: a dequantizing cache's hit.
and prints the ratios native / miss and native / hit (above 1 = native is faster). Also
checks the products agree (max error relative to the largest output).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from k3kit.runtime import qmatmul
from k3kit.runtime.dequant import dequantize

N_OUT, K = 2048, 7168


def best(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def time_rows(kernel, raw: np.ndarray, w_bf16: torch.Tensor, m: int, have: list[str],
              levels: dict[str, int], reps: int) -> tuple[dict[str, float], float, float, tuple]:
    """Best times of each native path, of a miss (dequant + matmul) and of a hit, for m rows."""
    x = torch.randn(m, K)
    y = torch.empty(m, N_OUT)
    xb = x.bfloat16()
    res = {}
    for name in have:
        if name == "scalar" and m > 4:
            continue
        lvl = levels[name]
        res[name] = best(lambda: kernel.matmul(raw, x.numpy(), y.numpy(), N_OUT, K, m, lvl), reps)  # noqa: B023
    miss = best(lambda: xb @ dequantize(raw, T.MXFP4, (K, N_OUT), torch.bfloat16).t(), max(2, reps // 2))
    hit = best(lambda: torch.mv(w_bf16, xb[0]) if m == 1 else xb @ w_bf16.t(), reps)
    return res, miss, hit, (x, y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not qmatmul.native_available():
        raise SystemExit("the native kernel is not built (pip install -e . with a C compiler)")
    kernel = qmatmul._mxfp4
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(N_OUT, K // 32, 17), dtype=np.uint8)
    blocks[:, :, 0] = rng.integers(118, 130, size=(N_OUT, K // 32))
    raw = blocks.reshape(-1)
    w_bf16 = dequantize(raw, T.MXFP4, (K, N_OUT), torch.bfloat16)
    levels = {"avx512": 2, "avx2": 1, "scalar": 0}
    have = [name for name, lvl in levels.items() if lvl <= levels[kernel.simd()]]
    print(f"threads {args.threads}; matrix {N_OUT} x {K} MXFP4 ({raw.nbytes / 2**20:.1f} MiB); "
          f"best of {args.reps}; CPU paths: {', '.join(have)}")
    for m in (int(r) for r in args.rows.split(",")):
        res, miss, hit, (x, y) = time_rows(kernel, raw, w_bf16, m, have, levels, args.reps)
        kernel.matmul(raw, x.numpy(), y.numpy(), N_OUT, K, m)
        ref = (x.double() @ w_bf16.double().t())
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        nat = res[have[0]]
        paths = "  ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in res.items())
        print(f"m={m:3d}  {paths}  | miss {miss * 1e3:6.2f} ms  hit {hit * 1e3:6.2f} ms  | "
              f"native/miss x{miss / nat:5.2f}  native/hit x{hit / nat:5.2f}  err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
