"""K3 matrices times m rows, per quantized type: the native kernels against dequantize + GEMM.

    python benchmarks/bench_qmatmul.py [--types Q8_0,Q4_K,...] [--shapes 7168x2048,7168x16384]
                                       [--rows 1,8,32,64,128] [--threads 1] [--reps 3] [--clock wall|cpu]
                                       [--levels avx512,avx2,scalar] [--paths] [--no-torch] [--no-int8]
                                       [--int8-paths] [--no-native]

Shapes are ggml order, n_in x n_out (7168 x 2048: a K3 expert; 7168 x 16384: a trunk-sized
matrix); random valid blocks with realistic scales. Per type, shape and row count, in one run:
  native    the kernel on the bytes at each SIMD level asked for (scalar only up to 4 rows):
            what a quantized trunk or expert cache runs; GF = GFLOP/s (2 m n_in n_out / time);
  tiles / panels (--paths)  the native kernel forced onto its per-row tiles or its panels (the
            many-row driver that decodes each block once); the automatic choice is `native`;
  deq+bf16  QuantizedMatrix with a bf16 compute dtype beyond NATIVE_MAX_ROWS: W dequantized in
            GEMM_CHUNK_BYTES chunks (natively), each multiplied by torch's bf16 GEMM;
  deq+f32   the same in float32 (which QuantizedMatrix never picks: see NATIVE_MAX_ROWS);
  bf16      torch's GEMM on an already dequantized bf16 matrix (a bf16 trunk's cost);
  int8      the "ggml" mode (matmul_q8): x rounded to ggml's Q8_0/Q8_K blocks, integer dot
            products (AVX512-VNNI where present), with its GB/s of weight bytes; "x 1 row", its
            time over the one-row time (when --rows starts with 1: the cost of batching rows);
            then the ratios native / int8 and deq+bf16 / int8 (> 1: int8 is faster);
  d256 / d512 / dT / panels (--int8-paths)  matmul_q8 forced onto each of its paths (the same
            bits): the 256-bit direct path (the one AVX2 runs), the 512-bit direct path
            (AVX512-VNNI) that folds each row's partial sums, the transposed 512-bit direct path,
            the panels; timed in turns (d256, d512, dT, panels, d256, ...) so that a noisy machine
            slows all alike; median (min-max) ms, and d512 / dT;
and checks the native product against the float64 product of the dequantized matrix (max error
relative to the largest output). Before the tables it measures this machine's memory bandwidth
(a numpy sum over a 512 MiB array, which one thread streams) so that one-row GB/s can be read
against it (the "of bw" column: a one-row product is a stream over the weight bytes).
--clock cpu times the calling thread's CPU time (only with
--threads 1): steadier than wall time on a machine shared with other work.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from k3kit.bench.run import cpu_info
from k3kit.kernels import qmatmul
from k3kit.kernels.dequant import dequantize
from k3kit.kernels.qmatmul import QuantizedMatrix

LEVELS = {"avx512": 2, "avx2": 1, "scalar": 0}
# Byte offsets of each type's f16 scales (IQ1_M spreads its d over the top nibbles of 4 words).
F16_AT = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,),
          T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ3_XXS: (0,), T.IQ1_S: (0,)}


def random_blocks(qtype: T, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with finite scales (f16 ~ 1e-3, e8m0 near 2^-6): valid blocks of `qtype`."""
    qk, nbytes = GGML_QUANT_SIZES[qtype]
    n = n_out * k // qk
    b = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    d = (np.abs(rng.standard_normal(n)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint16)
    if qtype == T.MXFP4:
        b[:, 0] = rng.integers(118, 130, size=n)
    elif qtype == T.IQ1_M:
        sc = b[:, 48:56].copy().view(np.uint16) & 0x0FFF
        for i in range(4):
            sc[:, i] |= ((d >> (4 * i)) & 0xF) << 12
        b[:, 48:56] = sc.view(np.uint8)
    else:
        for off in F16_AT[qtype]:
            b[:, off:off + 2] = d.view(np.uint8).reshape(n, 2)
    return b.reshape(-1)


def best(f: Callable[[], object], reps: int, clock: Callable[[], float]) -> float:
    f()
    times = []
    for _ in range(reps):
        t = clock()
        f()
        times.append(clock() - t)
    return min(times)


def memory_bandwidth(reps: int = 5) -> float:
    """GB/s of a numpy sum over a 512 MiB array (far beyond the caches): what one thread streams."""
    a = np.ones(128 << 20, dtype=np.float32)
    a.sum()
    t = min(_timed(a.sum) for _ in range(reps))
    return a.nbytes / t / 1e9


def _timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(t.name for t in (
        T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS, T.IQ1_S, T.IQ1_M,
        T.MXFP4)))
    ap.add_argument("--shapes", default="7168x2048", help="n_in x n_out, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--levels", default="avx512", help="SIMD levels to time (capped at what the CPU has)")
    ap.add_argument("--paths", action="store_true", help="also time the per-row tiles and the panels forced")
    ap.add_argument("--no-torch", action="store_true", help="skip the dequantize + GEMM and bf16 columns")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8-activation (ggml mode) columns")
    ap.add_argument("--no-native", action="store_true", help="skip the float32-activation native kernel")
    ap.add_argument("--int8-paths", action="store_true",
                    help="also time matmul_q8's 256-bit direct path, 512-bit direct path and panels in turns")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not qmatmul.native_available():
        raise SystemExit("the native kernels are not built (pip install -e . with a C compiler)")
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu times one thread: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    kernel = qmatmul._qmatmul
    levels = [lv for lv in args.levels.split(",") if LEVELS[lv] <= LEVELS[kernel.simd()]]
    bw = memory_bandwidth()
    print(f"{cpu_info()}; threads {args.threads}; best of {args.reps} ({args.clock} clock); "
          f"CPU paths: {kernel.simd()} and below; int8 path: {kernel.simd_i8()}; "
          f"memory bandwidth (numpy sum, 1 thread): {bw:.1f} GB/s")
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        k, n_out = (int(v) for v in shape.split("x"))
        print(f"\n{k} x {n_out} (n_in x n_out)\n| type | rows | " + " | ".join(
            ([] if args.no_native else [f"native {lv}" for lv in levels])
            + (["tiles", "panels"] if args.paths else [])
            + ([] if args.no_torch else ["deq+bf16 GEMM", "deq+f32 GEMM", "bf16 GEMM (pre-dequantized)"])
            + ([] if args.no_int8 else ["int8 (ggml)", "GB/s", "of bw", "x 1 row", "native/int8"]
               + ([] if args.no_torch else ["deq+bf16/int8"]))
            + (["d256", "d512", "dT", "panels", "d512/dT"] if args.int8_paths else [])
            + ["err"]) + " |")
        for name in args.types.split(","):
            qtype = T[name]
            raw = random_blocks(qtype, n_out, k, rng)
            w = dequantize(raw, qtype, (k, n_out), torch.float32)
            w_bf16 = w.bfloat16()
            q_bf16 = QuantizedMatrix(torch.from_numpy(raw), qtype, (k, n_out), torch.bfloat16)
            q_f32 = QuantizedMatrix(torch.from_numpy(raw), qtype, (k, n_out), torch.float32)
            t_one = 0.0
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                y = torch.empty(m, n_out)
                flops = 2.0 * m * k * n_out

                def cell(t: float, flops: float = flops) -> str:
                    return f"{t * 1e3:.1f} ms ({flops / t / 1e9:.0f} GF)"

                def native(lvl: int, path: int = -1) -> float:
                    return best(lambda: kernel.matmul(int(qtype), raw, x.numpy(), y.numpy(), n_out, k, m, lvl,  # noqa: B023
                                                      args.threads, path), args.reps, clock)

                t_native = float("nan") if args.no_native else native(-1)
                cells = [] if args.no_native else [
                    cell(native(LEVELS[lv])) if lv != "scalar" or m <= 4 else "" for lv in levels]
                if args.paths:
                    cells += [cell(native(-1, 0)), cell(native(-1, 1))]
                kernel.matmul(int(qtype), raw, x.numpy(), y.numpy(), n_out, k, m, -1, args.threads)
                ref = x.double() @ w.double().t()
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                t_deq = 0.0
                if not args.no_torch:
                    xb = x.bfloat16()
                    t_deq = best(lambda: q_bf16._gemm(xb), args.reps, clock)  # noqa: B023
                    cells += [cell(t_deq),
                              cell(best(lambda: q_f32._gemm(x), args.reps, clock)),  # noqa: B023
                              cell(best(lambda: torch.mv(w_bf16, xb[0]) if m == 1 else xb @ w_bf16.t(),  # noqa: B023
                                        args.reps, clock))]
                if not args.no_int8:
                    t8 = best(lambda: kernel.matmul_q8(int(qtype), raw, x.numpy(), y.numpy(), n_out, k, m,  # noqa: B023
                                                       -1, args.threads), args.reps, clock)
                    gbs = raw.nbytes / t8 / 1e9
                    if m == 1:
                        t_one = t8
                    cells += [cell(t8), f"{gbs:.1f}", f"{gbs / bw:.2f}" if m == 1 else "",
                              f"{t8 / t_one:.2f}" if t_one else "", f"{t_native / t8:.2f}"]
                    if not args.no_torch:
                        cells.append(f"{t_deq / t8:.2f}")
                if args.int8_paths:
                    runs: dict[int, list[float]] = {path: [] for path in (0, 2, 4, 1)}
                    for _ in range(max(args.reps, 5)):
                        for path, ts in runs.items():
                            t = clock()
                            kernel.matmul_q8(int(qtype), raw, x.numpy(), y.numpy(), n_out, k, m, -1,
                                             args.threads, 1, path)
                            ts.append(clock() - t)
                    cells += [f"{np.median(ts) * 1e3:.2f} ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})"
                              for ts in runs.values()]
                    cells.append(f"{np.median(runs[2]) / np.median(runs[4]):.2f}")
                print(f"| {name} | {m} | " + " | ".join(cells) + f" | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
