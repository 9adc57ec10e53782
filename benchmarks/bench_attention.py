"""MLA's latent attention over a prompt chunk: the native products and causal softmax
(k3kit.kernels.attn, AVX-512) against torch's (MKL's bmm, masked_fill, softmax), same inputs.

    python benchmarks/bench_attention.py [--threads 1] [--reps 5] [--rows 256] [--at 0,4096,16384]

Per geometry (the shipped mini: 2 heads, 128 + 32 latent dims; K3: 96 heads, 512 + 64) and
position (`--at`: cached positions before the chunk), one call of mla.attend for `--rows` new
rows. Timed in turns (torch, native, torch, ...) so a noisy machine slows both alike; median ms,
and torch / native (> 1: native is faster), with the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from k3kit.bench.run import cpu_info
from k3kit.kernels import attn
from k3kit.models.kimi_k3 import mla

GEOMETRY = {"mini": (2, 128, 32), "K3": (96, 512, 64)}   # heads, kv_lora_rank, qk_rope_head_dim


def timed(f, reps: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--at", default="0,4096,16384")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if not attn.available():
        raise SystemExit("the native attention does not run here (no _attn extension or no AVX-512F)")
    print(f"{cpu_info()}, {args.threads} thread(s), {args.rows} rows per call")
    print("| geometry | cached positions | torch ms | native ms | torch / native | max |diff| |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, (H, L, pe) in GEOMETRY.items():
        for at in [int(x) for x in args.at.split(",")]:
            T, C = args.rows, L + pe
            Q = torch.randn(1, T, H, C, generator=g) * 0.1
            K = torch.randn(1, at + T, C, generator=g)
            scale = 1.0 / (C ** 0.5)
            outs: dict[str, torch.Tensor] = {}
            times: dict[str, list[float]] = {"torch": [], "native": []}

            def run(mode: str, Q=Q, K=K, L=L, at=at, scale=scale, outs=outs) -> None:
                attn._AVAILABLE = mode == "native"
                outs[mode] = mla.attend(Q, K, K[..., :L], at, scale)
            for _ in range(3):
                for mode in ("torch", "native"):
                    times[mode].append(timed(partial(run, mode), args.reps))
            attn._AVAILABLE = True
            t, n = statistics.median(times["torch"]), statistics.median(times["native"])
            diff = (outs["torch"] - outs["native"]).abs().max().item()
            print(f"| {name} | {at} | {t:.2f} | {n:.2f} | {t / n:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
