"""MLA's kv_b products at K3 geometry: the file's bytes (one native call over all heads) against
the float32 kv_b that loads made before (torch einsum / bmm over the dequantized halves).

    python benchmarks/bench_mla_heads.py [--rows 1,4,8,12,16,64,512] [--threads 1] [--reps 5]
                                         [--k-type Q8_0] [--v-type Q4_K] [--arith ggml]

Per row count (B * T rows of one call: 1 = a decode step, 4-12 = verify blocks, 64-512 = prefill
chunks), both halves: W_kb^T q (96 heads, [512 x 128] each, attn_k_b) and W_vb lat (96 heads,
[128 x 512], attn_v_b). `float` is what mla.absorb / the value einsum ran on a float32 kv_b
(the floats of HF's kv_b_proj: 50 MB per layer), `heads` is QuantizedHeads.matmul on the file's
bytes (10 MB with Q8_0 k_b + Q4_K v_b) in the chosen arithmetic. Timed in turns (float, heads,
float, ...) so that a noisy machine slows both alike; median (min-max) ms, and heads / float
(< 1: the file's bytes are faster). mla.HEADS_NATIVE_MAX_ROWS is where the model switches to
the float product for prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from k3kit.gguf.quants import random_blocks
from k3kit.kernels.dequant import block_size
from k3kit.kernels.qmatmul import QuantizedHeads, native_available
from k3kit.models.kimi_k3.mla import HEADS_NATIVE_MAX_ROWS

H, NOPE, L, V = 96, 128, 512, 128     # K3: heads, qk_nope_head_dim, kv_lora_rank, v_head_dim


def stack(qtype: GGMLQuantizationType, n_in: int, n_out: int, rng: np.random.Generator,
          arith: str) -> QuantizedHeads:
    n_blocks = n_in * n_out * H // block_size(qtype)[0]
    raw = torch.from_numpy(random_blocks(qtype, n_blocks, rng).reshape(-1).copy())
    return QuantizedHeads(raw, qtype, (n_in, n_out, H), arith=arith)


def timed(f: Callable[[], object], reps: int) -> float:
    f()
    n = 0
    t0 = time.perf_counter()
    while True:
        f()
        n += 1
        dt = time.perf_counter() - t0
        if n >= reps or dt > 0.5:
            return dt / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,12,16,64,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5, help="turns per product (each a median of calls)")
    ap.add_argument("--k-type", default="Q8_0")
    ap.add_argument("--v-type", default="Q4_K")
    ap.add_argument("--arith", default="ggml", choices=("ggml", "float"))
    args = ap.parse_args()
    if not native_available():
        raise SystemExit("the native extension is not built")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    kb = stack(GGMLQuantizationType[args.k_type], NOPE, L, rng, args.arith)
    vb = stack(GGMLQuantizationType[args.v_type], L, V, rng, args.arith)
    w_kb = kb.dequantize().transpose(1, 2).contiguous()      # [H, nope, L], as kv_b_proj held it
    w_vb = vb.dequantize().contiguous()                      # [H, v, L]
    print(f"K3 MLA kv_b, {H} heads: k_b {args.k_type} {kb.nbytes / 2**20:.1f} MiB, v_b {args.v_type} "
          f"{vb.nbytes / 2**20:.1f} MiB (float32 kv_b {(w_kb.numel() + w_vb.numel()) * 4 / 2**20:.1f} MiB); "
          f"{args.arith} arithmetic, {args.threads} thread(s); model switches to float above "
          f"{HEADS_NATIVE_MAX_ROWS} rows")
    print(f"{'rows':>5} {'float ms':>22} {'heads ms':>22} {'heads/float':>11}")
    for m in (int(r) for r in args.rows.split(",")):
        g = torch.Generator().manual_seed(m)
        q, lat = torch.randn(1, m, H, NOPE, generator=g), torch.randn(1, m, H, L, generator=g)

        def float_kv_b(q: torch.Tensor = q, lat: torch.Tensor = lat) -> None:
            if q.shape[1] == 1:      # mla.absorb_rows' one-row product
                torch.bmm(q[0].transpose(0, 1), w_kb)
            else:
                torch.einsum("bthd,hdl->bthl", q, w_kb)
            torch.einsum("bthl,hvl->bthv", lat, w_vb)

        def heads(q: torch.Tensor = q, lat: torch.Tensor = lat) -> None:
            kb.matmul(q[0].transpose(0, 1))
            vb.matmul(lat[0].transpose(0, 1))

        runs: dict[str, list[float]] = {"float": [], "heads": []}
        per = max(2, 64 // m)
        for _ in range(args.reps):
            runs["float"].append(timed(float_kv_b, per))
            runs["heads"].append(timed(heads, per))
        med = {k: statistics.median(v) for k, v in runs.items()}
        cols = [f"{med[k]:8.2f} ({min(v):.2f}-{max(v):.2f})" for k, v in runs.items()]
        print(f"{m:5d} {cols[0]:>22} {cols[1]:>22} {med['heads'] / med['float']:11.2f}")


if __name__ == "__main__":
    main()
