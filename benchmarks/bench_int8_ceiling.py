"""How close the int8 Q8_0 product runs to what this CPU's integer multipliers allow, and what that
allows a batched serving pass.

An exact Q8_0 x Q8_0 product on AVX2 needs, per 32 products, one maddubs (u8 x s8 pair sums) and
one madd (widening them to 32 bits): Q8_0's values are signed, so two pair sums of 127 x 128 do
not fit 16 bits and cannot be added before widening (|q| . (x with q's sign), as ggml's AVX2 dot
does). Both are vector multiplies. The ceiling is a loop of exactly that work on data in L1 (8
rows x 8 vectors, one thread per core, no decoding, no scales, no memory traffic), compiled here
with the system C compiler; the peer is k3kit's own kernel (`matmul_q8`, 7168 x 2048 Q8_0, the
slice's trunk and LM head type) at the same thread counts, in the same run. The ratio is the
kernel's share of the ceiling.

The second table turns that into the K3 slice's 8-client serving goal (issue 13: an 8-row pass
at most twice the 1-row pass): `--q8-weights` Q8_0 weights multiply per row (the 2-layer slice:
2.58 G, its LM head included), and `--one-row-ms` is the measured 1-row pass; at the ceiling the
8-row pass's Q8_0 products alone take 8 x weights / ceiling.

    python benchmarks/bench_int8_ceiling.py [--threads 1,2] [--one-row-ms 120]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from k3kit.kernels import qmatmul

CEILING_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#define R 8
int main(int argc, char **argv) {
    const long iters = atol(argv[1]);
    const int threads = atoi(argv[2]);
    double best = 1e30;
    int32_t sink = 0;
    for (int rep = 0; rep < 5; rep++) {
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            int8_t x[R][8][32] __attribute__((aligned(32))), w[8][32] __attribute__((aligned(32)));
            for (int c = 0; c < 8; c++)
                for (int i = 0; i < 32; i++) {
                    w[c][i] = (int8_t)((c * 5 + i * 3 + omp_get_thread_num()) % 250 - 125);
                    for (int r = 0; r < R; r++) x[r][c][i] = (int8_t)((r * 7 + c * 3 + i) % 200 - 100);
                }
            const __m256i ones = _mm256_set1_epi16(1);
            __m256i s[R];
            for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
            for (long it = 0; it < iters; it++)
                for (int c = 0; c < 8; c++) {
                    __m256i q = _mm256_load_si256((const __m256i *)w[c]), a = _mm256_abs_epi8(q);
                    __asm__ volatile("" : "+x"(q), "+x"(a));
                    for (int r = 0; r < R; r++) {
                        const __m256i xv = _mm256_load_si256((const __m256i *)x[r][c]);
                        const __m256i p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(xv, q));
                        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
                    }
                }
            int32_t o[8];
            for (int r = 1; r < R; r++) s[0] = _mm256_add_epi32(s[0], s[r]);
            _mm256_storeu_si256((__m256i *)o, s[0]);
            sink += o[0];
        }
        const double dt = omp_get_wtime() - t0;
        if (dt < best) best = dt;
    }
    printf("%.6f %d\n", (double)iters * 8 * R * 32 * threads / best * 1e-9, (int)(sink & 1));
    return 0;
}
"""


def ceiling(threads: int, iters: int, exe: Path) -> float:
    """GMAC/s of the exact-int8 multiply loop over `threads` threads (best of 5)."""
    out = subprocess.run([str(exe), str(iters), str(threads)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


def build(tmp: Path) -> Path:
    src, exe = tmp / "ceiling.c", tmp / "ceiling"
    src.write_text(CEILING_C)
    cc = os.environ.get("CC", "cc")
    try:
        subprocess.run([cc, "-O2", "-mavx2", "-fopenmp", "-o", str(exe), str(src)], check=True,
                       capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"bench_int8_ceiling: cannot compile the ceiling loop with {cc}: {e}") from None
    return exe


def kernel_call(threads: int, rows: int) -> tuple[Callable[[], None], int]:
    """k3kit's Q8_0 matmul_q8 on `rows` rows of a 7168 x 2048 matrix: the call and its MACs."""
    from bench_qmatmul import random_blocks
    from gguf import GGMLQuantizationType as T

    n_in, n_out = 7168, 2048
    raw = random_blocks(T.Q8_0, n_out, n_in, np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((rows, n_in)).astype(np.float32)
    y = np.empty((rows, n_out), np.float32)
    ext = qmatmul._qmatmul
    def call() -> None:
        ext.matmul_q8(int(T.Q8_0), raw, x, y, n_out, n_in, rows, -1, threads, 1, -1)
    return call, rows * n_in * n_out


def kernel_gmacs(call: Callable[[], None], macs: int, n: int) -> float:
    """GMAC/s of the best of n calls (as the ceiling: the least disturbed run on a VM whose speed
    drifts)."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t)
    return macs / min(ts) * 1e-9


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="kernel calls per turn")
    ap.add_argument("--rounds", type=int, default=6, help="turns of ceiling and kernel, alternated")
    ap.add_argument("--iters", type=int, default=500_000, help="ceiling loop iterations per thread (x 5)")
    ap.add_argument("--q8-weights", type=float, default=2.58e9, help="Q8_0 weights a row multiplies per pass")
    ap.add_argument("--one-row-ms", type=float, default=None, help="the measured 1-row pass (ms)")
    args = ap.parse_args()
    x86 = platform.machine() in ("x86_64", "AMD64")
    if not qmatmul.native_available() or qmatmul.native_simd() == "none" or not x86:
        raise SystemExit("bench_int8_ceiling: needs the native kernels on an x86-64 CPU with AVX2")
    sys.path.insert(0, str(Path(__file__).parent))
    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(max(threads))
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, kernel simd {qmatmul.native_simd()}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for t in threads:     # the two alternated, `--rounds` turns each, the best of each kept
            call, macs = kernel_call(t, args.rows)
            kernel_gmacs(call, macs, 3)
            c = k = 0.0
            for _ in range(args.rounds):
                c = max(c, ceiling(t, args.iters, exe))
                k = max(k, kernel_gmacs(call, macs, args.reps))
            rows.append((t, c, k))
    print(f"| threads | ceiling GMAC/s (maddubs + madd, L1) | k3kit Q8_0, {args.rows} rows, GMAC/s "
          "| kernel / ceiling |")
    print("|---|---|---|---|")
    for t, c, k in rows:
        print(f"| {t} | {c:.1f} | {k:.1f} | {k / c:.2f} |")
    t, c, k = rows[-1]
    floor_ms = 8 * args.q8_weights / (c * 1e9) * 1e3
    at_kernel = 8 * args.q8_weights / (k * 1e9) * 1e3
    print(f"\n8-row pass, Q8_0 products only, {t} threads: >= {floor_ms:.0f} ms at the ceiling, "
          f"{at_kernel:.0f} ms at the kernel's rate")
    if args.one_row_ms:
        print(f"goal (8-row pass <= 2 x {args.one_row_ms:.0f} ms = {2 * args.one_row_ms:.0f} ms): "
              f"{'reachable' if floor_ms < 2 * args.one_row_ms else 'out of reach even at the ceiling'}; "
              f"best aggregate at the ceiling {8 * args.one_row_ms / floor_ms:.2f}x single stream "
              "(Q8_0 products alone)")


if __name__ == "__main__":
    main()
