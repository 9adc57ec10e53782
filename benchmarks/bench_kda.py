"""The KDA recurrence of one K3 layer: torch's steps against the native fused step, same run.

    python benchmarks/bench_kda.py [--seqs 1,8] [--rows 1,16] [--heads 96] [--dim 128]
                                   [--threads 2] [--reps 15] [--levels avx512,avx2,scalar]
    python benchmarks/bench_kda.py --model SLICE.gguf [--seqs 1,8] [--passes 6] [--threads 2]

For B sequences (K3 geometry: 96 heads of 128 x 128 float32 states, 6.3 MB a sequence) and T
rows each (1: a decode pass's step; more: a prefill chunk or a verify block), in turns:
  torch   kda.delta_rule_torch, in place (what the serving path ran before: per row a decay
          multiply, k^T S, the delta update and q^T S as separate passes over the state);
  native  kda_step.rows, in place: one read and one write of each head's state for all T rows,
          at each SIMD level asked for (the same bits on each);
median (min-max) ms per call, the native path's state traffic in GB/s (read + write of the
states / time), and torch / native. The two agree to float32 rounding: the largest difference
of o and of S is printed. Wall clock; run under the machine lock, nothing else timed alongside.

--model: whole serving passes of a K3 GGUF (loaded as `k3kit serve` loads it) instead. Per
count of sequences: each sequence prefilled with a bench prompt (plain text) (all in one pass), then decode
passes of one row per sequence (forward_batch, greedy), alternating native steps and torch steps
(kda.NATIVE_STEPS) pass by pass, the same sequences going on: ms per pass and the part of it
spent in the KDA recurrence (kda.delta_rule), median (min-max), and torch / native.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3kit.bench.run import cpu_info
from k3kit.kernels import kda_step
from k3kit.models.kimi_k3.kda import delta_rule_torch

LEVELS = {"avx512": 2, "avx2": 1, "scalar": 0}


def inputs(B: int, T: int, H: int, D: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A state and T rows of inputs shaped as a K3 layer makes them (unit-norm q and k, decays
    in K3's gate range [-5, 0], beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(B, H, D, D, generator=gen) * 0.05
    q = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    g = -5.0 * torch.rand(B, T, H, D, generator=gen) ** 4
    beta = torch.rand(B, T, H, generator=gen)
    return S, q, k, v, g, beta


def timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def spread(ts: list[float]) -> str:
    return f"{statistics.median(ts):8.2f} ({min(ts):.2f}-{max(ts):.2f})"


def serving_passes(path: str, seqs: list[int], passes: int) -> None:
    """Decode passes of `seqs` sequences on the model at `path`, native and torch steps alternated."""
    from k3kit.adapters import load_model
    from k3kit.bench.workloads import shipped
    from k3kit.models.kimi_k3 import kda as kda_mod
    from k3kit.runtime.loader import LoadOptions

    loaded = load_model(path, LoadOptions())
    model = loaded.model
    prompts = [loaded.codec.encode(text) for text in shipped("chat")]   # plain text: slices have no template
    in_kda = [0.0]
    rule = kda_mod.delta_rule

    def timed_rule(*a: torch.Tensor, **kw: bool) -> tuple[torch.Tensor, torch.Tensor]:
        t = time.perf_counter()
        try:
            return rule(*a, **kw)
        finally:
            in_kda[0] += time.perf_counter() - t

    kda_mod.delta_rule = timed_rule     # type: ignore[assignment]
    print(f"{'seqs':>4} {'steps':<7} {'pass ms median (min-max)':>26} {'KDA ms median (min-max)':>26} "
          f"{'torch/native':>12}")
    try:
        for n in seqs:
            ids = [model.open_sequence() for _ in range(n)]
            logits = model.forward_batch([(s, prompts[i % len(prompts)]) for i, s in enumerate(ids)])
            nxt = [int(x) for x in logits.argmax(-1)]
            res: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
            for p in range(2 * passes + 2):
                native = p % 2 == 0
                kda_mod.NATIVE_STEPS = native
                in_kda[0] = 0.0
                t = time.perf_counter()
                logits = model.forward_batch([(s, [nxt[i]]) for i, s in enumerate(ids)])
                ms = (time.perf_counter() - t) * 1e3
                nxt = [int(x) for x in logits.argmax(-1)]
                if p >= 2:                      # the first pair warms
                    res[native][0].append(ms)
                    res[native][1].append(in_kda[0] * 1e3)
            for i in ids:
                model.close_sequence(i)
            for native in (False, True):
                ratio = (f"{statistics.median(res[False][0]) / statistics.median(res[True][0]):11.2f}x"
                         if native else "")
                print(f"{n:4d} {'native' if native else 'torch':<7} {spread(res[native][0]):>26} "
                      f"{spread(res[native][1]):>26} {ratio:>12}")
    finally:
        kda_mod.delta_rule = rule           # type: ignore[assignment]
        kda_mod.NATIVE_STEPS = True
        loaded.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--levels", default="avx512")
    ap.add_argument("--model", help="a K3 GGUF: time whole serving passes instead")
    ap.add_argument("--passes", type=int, default=6, help="--model: timed passes per peer")
    args = ap.parse_args()
    if kda_step.available() == "none":
        raise SystemExit("bench_kda: the _kda extension is not built (python setup.py build_ext --inplace)")
    torch.set_num_threads(args.threads)
    levels = [lv for lv in args.levels.split(",") if lv]
    shape = f"H={args.heads} d={args.dim}" if not args.model else args.model
    print(f"cpu: {cpu_info()}; torch threads {args.threads}; native path {kda_step.available()}; {shape}")
    if args.model:
        serving_passes(args.model, [int(s) for s in args.seqs.split(",")], args.passes)
        return
    print(f"{'seqs':>4} {'rows':>4} {'peer':<14} {'ms median (min-max)':>26} {'GB/s':>6} {'torch/peer':>10}")
    with torch.no_grad():
        for B in (int(s) for s in args.seqs.split(",")):
            for T in (int(r) for r in args.rows.split(",")):
                compare(B, T, args.heads, args.dim, levels, args.reps)


def compare(B: int, T: int, H: int, D: int, levels: list[str], reps: int) -> None:
    """One table block: B sequences of T rows, torch's steps and the native levels in turns."""
    S, q, k, v, g, beta = inputs(B, T, H, D)
    o_ref, S_ref = delta_rule_torch(S, q, k, v, g, beta)
    diffs = []
    for lv in levels:
        o, S_new = kda_step.rows(S, k, v, g, beta, q, simd=LEVELS[lv])
        assert o is not None
        diffs.append(f"{lv} |do| {(o - o_ref).abs().max().item():.1e} "
                     f"|dS| {(S_new - S_ref).abs().max().item():.1e}")
    S_t, S_n = S.clone(), S.clone()     # each peer steps its own state in place
    peers: dict[str, Callable[[], object]] = {
        "torch": lambda: delta_rule_torch(S_t, q, k, v, g, beta, inplace=True)}
    for lv in levels:
        peers[f"native {lv}"] = (lambda lv=lv: kda_step.rows(S_n, k, v, g, beta, q, inplace=True,
                                                             simd=LEVELS[lv]))
    times: dict[str, list[float]] = {name: [] for name in peers}
    for f in peers.values():
        f()                                 # warm
    for _ in range(reps):                   # in turns: a noisy moment slows all alike
        for name, f in peers.items():
            times[name].append(timed(f))
    state_gb = 2 * S.numel() * 4 / 1e9       # read + write once
    t_torch = statistics.median(times["torch"])
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = f"{state_gb / (med / 1e3):6.1f}" if name != "torch" else f"{'':>6}"
        print(f"{B:4d} {T:4d} {name:<14} {spread(ts):>26} {gbs} {t_torch / med:9.2f}x")
    print(f"{'':10}agreement with torch: {'; '.join(diffs)}")


if __name__ == "__main__":
    main()
