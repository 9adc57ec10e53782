"""K3 matrices on one CUDA GPU, per ggml type: the Triton kernels against torch's dequant + matmul.

    python benchmarks/bench_gpu_qmatmul.py [--types Q8_0,Q4_K,...] [--shapes 7168x2048,2048x7168]
                                           [--rows 1,8,16,256] [--reps 20] [--budget-s 50] [--sweep TYPES]

Shapes are ggml order, n_in x n_out (7168 x 2048 and 2048 x 7168: a K3 expert's projections;
7168 x 18432: a trunk-sized matrix); random bytes with finite scales of a realistic size, made
on the GPU. First a correctness check per type and shape (before any timing): the Triton
dequantizer against k3kit.kernels.dequant's torch ops on the same device (bitwise), the GEMV
(1 row) and the GEMM (--rows' largest) against float64 products of the dequantized matrix. Then
per type, shape and row count, median of --reps timings with torch.cuda.Event (after warm-up):
  triton     k3kit.kernels.gpu.matmul (GEMV up to GEMV_MAX_ROWS rows, then gpu.PREFILL's way), bf16 x
  torch-deq  QuantizedLinear(mode="dequant"): W dequantized with torch ops per product (the path
             CUDA took before these kernels), then torch's bf16 GEMM
  bf16       torch's bf16 matmul on an already dequantized matrix (what a bf16 trunk costs)
with GB/s = the weight bytes each reads (ggml bytes; bf16: 2 bytes a value) / time, and the
ratios torch-deq / triton and bf16 / triton (> 1: triton is faster). --sweep Q4_K,... adds, for
those types on the largest shape, GEMV tile sizes (output rows per program x warps) at 1 row, to
choose kernels.GEMV_BN / GEMV_WARPS (each size is one more compile).
Stops starting new cases after --budget-s seconds (compiling the kernels is part of it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

TYPES = "Q8_0,Q4_K,MXFP4,Q6_K,Q5_K,IQ4_XS,IQ4_NL,F16,BF16"
SHAPES = "7168x2048,2048x7168,7168x18432"
F16_AT = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}


def random_raw(qtype: T, n_in: int, n_out: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 bytes of a ggml [n_in, n_out] tensor on the GPU: uniform bytes, finite f16 scales
    of size 1e-3 .. 1e-2 (random sign), MXFP4 exponents near 2^-6, F16/BF16 values ~ N(0, 0.02)."""
    dev = torch.device("cuda")
    if qtype in (T.F16, T.BF16):
        w = torch.randn(n_out * n_in, generator=gen, device=dev) * 0.02
        return w.to(torch.float16 if qtype == T.F16 else torch.bfloat16).view(torch.uint8)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    nb = n_in * n_out // elems
    b = torch.randint(0, 256, (nb, nbytes), generator=gen, device=dev, dtype=torch.uint8)
    if qtype == T.MXFP4:
        b[:, 0] = torch.randint(118, 124, (nb,), generator=gen, device=dev, dtype=torch.uint8)
    for off in F16_AT.get(qtype, ()):
        d = (torch.rand(nb, generator=gen, device=dev) * 9e-3 + 1e-3)
        d = d * (torch.randint(0, 2, (nb,), generator=gen, device=dev) * 2 - 1)
        b[:, off:off + 2] = d.half().view(torch.uint8).view(nb, 2)
    return b.view(-1)


def cuda_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `fn` over `reps` calls, each timed with CUDA events (after 2 warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def check(qtype: T, raw: torch.Tensor, n_in: int, n_out: int, rows: int) -> str:
    """'ok' or what differs: Triton dequantizer vs torch ops (bits), products vs float64."""
    from k3kit.kernels import gpu
    from k3kit.kernels.dequant import dequantize

    ref = dequantize(raw, qtype, (n_in, n_out), torch.float32)
    got = gpu.dequantize(raw, qtype, (n_in, n_out))
    bad = int((got.view(torch.int32) != ref.view(torch.int32)).sum())
    if bad:
        return f"dequantize: {bad} values differ in their bits"
    bf = dequantize(raw, qtype, (n_in, n_out), torch.bfloat16).view(torch.int16)
    bad = int((gpu.dequantize(raw, qtype, (n_in, n_out), torch.bfloat16).view(torch.int16) != bf).sum())
    if bad:
        return f"dequantize to bf16: {bad} values differ in their bits"
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, rows):
        x = torch.randn(m, n_in, generator=gen, device="cuda").bfloat16()
        y = gpu.matmul(x, raw, qtype, n_in, n_out, torch.bfloat16, prefill="dot").double()
        wr = ref if m <= gpu.GEMV_MAX_ROWS else ref.bfloat16()      # the GEMM rounds W to bf16
        exact = x.double() @ wr.double().t()
        bound = (x.double().abs() @ ref.double().abs().t()) * (n_in + 8) * 2.0**-24
        excess = float(((y - exact).abs() - bound).max())
        if excess > 0:
            return f"{m} rows: error exceeds the float32 bound by {excess:.3g}"
    return "ok"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rows", default="1,8,16,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=50.0)
    ap.add_argument("--sweep", default="", help="types whose GEMV tile sizes to time")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_qmatmul: no CUDA device: this benchmark times GPU kernels (nothing measured)",
              file=sys.stderr)
        return 2
    from k3kit.kernels import gpu
    if not gpu.available("cuda"):
        print("bench_gpu_qmatmul: triton is not installed (pip install 'k3kit[gpu]')", file=sys.stderr)
        return 2
    from k3kit.kernels.dequant import dequantize
    from k3kit.layers.quantized_linear import GGMLWeight, QuantizedLinear

    types = [T[t.strip()] for t in args.types.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    largest = max(shapes, key=lambda s: s[0] * s[1])
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; median of {args.reps} (torch-deq: {max(3, args.reps // 5)})")
    print(f"{'type':6} {'shape':>11} {'rows':>4} | {'triton ms':>9} {'GB/s':>6} | {'torch-deq':>9} "
          f"{'GB/s':>6} | {'bf16 ms':>8} {'GB/s':>6} | {'deq/tri':>7} {'bf16/tri':>8}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    failed = 0
    for qtype in types:
        for n_in, n_out in shapes:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {qtype.name} {n_in}x{n_out} and later skipped")
                return 1 if failed else 0
            raw = random_raw(qtype, n_in, n_out, gen)
            verdict = check(qtype, raw, n_in, n_out, max(rows))
            if verdict != "ok":
                failed += 1
                print(f"{qtype.name:6} {n_in}x{n_out}: CHECK FAILED: {verdict}")
                continue
            wb = dequantize(raw, qtype, (n_in, n_out), torch.bfloat16)
            layer = QuantizedLinear(GGMLWeight(raw, qtype, (n_in, n_out)), torch.bfloat16, mode="dequant")
            for m in rows:
                x = torch.randn(m, n_in, generator=gen, device="cuda").bfloat16()
                print(row_line(qtype, raw, wb, layer, x, args.reps))
            if qtype.name in args.sweep.split(",") and (n_in, n_out) == largest:
                sweep(qtype, raw, n_in, n_out, args.reps)
            del wb, layer
            torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t0:.1f} s; {failed} check(s) failed")
    return 1 if failed else 0


def row_line(qtype: T, raw: torch.Tensor, wb: torch.Tensor, layer: torch.nn.Module, x: torch.Tensor,
             reps: int) -> str:
    """One table line: x's rows times the matrix three ways."""
    from k3kit.kernels import gpu

    n_out, n_in = wb.shape
    tri = cuda_ms(lambda: gpu.matmul(x, raw, qtype, n_in, n_out, torch.bfloat16), reps)
    deq = cuda_ms(lambda: layer(x), max(3, reps // 5))
    bf = cuda_ms(lambda: x @ wb.t(), reps)
    gbs = raw.numel() / 1e6
    return (f"{qtype.name:6} {n_in:>5}x{n_out:<5} {x.shape[0]:>4} | {tri:9.3f} {gbs / tri:6.0f} | {deq:9.3f} "
            f"{gbs / deq:6.0f} | {bf:8.3f} {wb.numel() * 2e-6 / bf:6.0f} | {deq / tri:7.1f} {bf / tri:8.2f}")


def sweep(qtype: T, raw: torch.Tensor, n_in: int, n_out: int, reps: int) -> None:
    """Other kernel choices on one matrix, GB/s of weight bytes: the per-row GEMV's tile sizes
    at 1 row; the one-program GEMV (`_gemv_rows`) against it at 1, 8 and 16 rows; the tl.dot GEMM
    against the dequant + torch GEMM way at 256 rows (bf16)."""
    from k3kit.kernels import gpu
    from k3kit.kernels.gpu import kernels as km

    gb = raw.numel() / 1e6
    out = []
    gemv = partial(km.gemv, w=raw, qtype=int(qtype), n_in=n_in, n_out=n_out)
    x1 = torch.randn(1, n_in, device="cuda")
    for bn in (4, 8, 16, 32):
        ms = cuda_ms(partial(gemv, x1, rows_kernel=False, bn=bn), reps)
        out.append(f"BN{bn} {gb / ms:.0f}")
    print(f"  sweep {qtype.name} {n_in}x{n_out} per-row GEMV, 1 row, GB/s: " + ", ".join(out))
    for m in (1, 8, 16):
        x = torch.randn(m, n_in, device="cuda")
        res = [f"per-row {gb / cuda_ms(partial(gemv, x, rows_kernel=False), reps):.0f}"]
        for bn in (8, 16, 32):
            ms = cuda_ms(partial(gemv, x, rows_kernel=True, bn=bn), reps)
            res.append(f"one-program BN{bn} {gb / ms:.0f}")
        print(f"  sweep {qtype.name} {m} rows, GB/s: " + ", ".join(res))
    xb = torch.randn(256, n_in, device="cuda").bfloat16()
    res = []
    for how in ("dot", "dequant"):
        ms = cuda_ms(partial(gpu.matmul, xb, raw, qtype, n_in, n_out, torch.bfloat16, prefill=how), reps)
        res.append(f"{how} {ms:.3f} ms")
    print(f"  sweep {qtype.name} 256 rows bf16: " + ", ".join(res))


if __name__ == "__main__":
    sys.exit(main())
