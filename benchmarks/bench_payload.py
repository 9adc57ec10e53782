"""Storage payload per token and expert-cache hit rate vs cache size, on a K3-geometry slice.

    python benchmarks/bench_payload.py [--experts 64] [--prompt 4] [--tokens 8] [--threads 1]
                                       [--dir /tmp] [--out benchmarks/figures/payload_vs_cache.png]
                                       [--expert-kernels native,torch]

Model: `k3kit synth` K3 geometry (hidden 7168, expert latent 3584 x FFN 3072 in MXFP4, i.e.
17.6 MB per routed expert, top-16 routing, K3 MLA dims), 8 heads instead of 96 (trunk load
time), 2 layers (KDA + MoE, MLA + MoE), vocab 512. Random weights route roughly uniformly,
which is the pessimistic case for a cache (real routing is more skewed).
For each budget the engine decodes the same greedy continuation; payload = expert bytes the
store read from the file during decode (the ledger), per decoded token. The uniform-routing
expectation for 0 cache (k distinct experts per layer per token, all read) is printed as the
peer figure. Each expert kernel is one curve: `native` caches experts as their MXFP4 bytes
(17.6 MB each), `torch` as bf16 tensors (66 MiB each), so the same MiB hold ~3.8x as many
experts with `native`. Writes a PNG with the curves.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--budgets", default="0,128,256,512,1024,2048,4096", help="cache sizes, MiB")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "figures" / "payload_vs_cache.png"))
    ap.add_argument("--expert-kernels", default="native,torch", help="comma list: native, torch, auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine_models import prompts

    from k3kit.adapters import load_model
    from k3kit.gguf.synth import K3, synthesize
    from k3kit.runtime.engine import generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling

    budgets = [float(b) for b in args.budgets.split(",")]
    curves: dict[str, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        r = synthesize(Path(tmp), replace(K3, n_dense_lead=0, n_head=8), 2, args.experts, vocab=512,
                       progress=False, name="k3slice")
        ref = None
        for kernel in args.expert_kernels.split(","):
            a = load_model(r.paths[0], LoadOptions(dtype=torch.bfloat16, expert_cache_mib=0,
                                                   expert_kernel=kernel))
            rows = curves.setdefault(kernel, [])
            try:
                m = a.memory()
                layers = m.experts
                per_expert = layers[0].file_bytes
                held = layers[0].cached_bytes / 2**20
                k = m.experts_per_token
                p = prompts(1, 400, seed=4, lo=args.prompt, hi=args.prompt)[0]
                print(f"[{kernel}] {args.experts} experts/layer x {len(layers)} MoE layers, top-{k}; one "
                      f"expert {per_expert / 1e6:.1f} MB in the file, {held:.1f} MiB in the cache "
                      f"({a.expert_kernel}); all experts {len(layers) * args.experts * held:.0f} MiB cached")
                print(f"{'cache MiB':>10s} {'experts':>8s} {'hit rate':>9s} {'MiB/token':>10s} "
                      f"{'peer MiB/token':>15s}")
                peer = len(layers) * k * per_expert / 2**20
                for b in budgets:
                    a.reset_expert_cache(b)
                    res = generate(a.model, p, max_tokens=args.tokens + 1,
                                   sampling=make_sampling(0.0, seed=0))
                    ref = ref or res.token_ids
                    assert res.token_ids == ref, "the cache or the kernel changed the output"
                    s = res.stats
                    rows.append((b, s.expert_cache_hit_rate, s.payload_bytes_per_token / 2**20))
                    print(f"{b:10.0f} {b / held:8.1f} {s.expert_cache_hit_rate:9.3f} {rows[-1][2]:10.1f} "
                          f"{peer:15.1f}")
            finally:
                a.close()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax2 = ax.twinx()
    for (kernel, rows), color in zip(curves.items(), ("tab:blue", "tab:green", "tab:purple"), strict=False):
        xs = [max(b, 16) for b, _, _ in rows]
        ax.plot(xs, [m for _, _, m in rows], "o-", color=color, label=f"{kernel}: payload per token")
        ax2.plot(xs, [h for _, h, _ in rows], "s:", color=color, alpha=0.6, label=f"{kernel}: hit rate")
    ax.axhline(peer, ls="--", color="gray", label=f"no cache, top-{k}: {peer:.0f} MiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("expert cache budget, MiB (0 plotted at 16)")
    ax.set_ylabel("MiB read per token")
    ax2.set_ylabel("hit rate (dotted)")
    ax2.set_ylim(0, 1)
    ax.set_title(f"K3-geometry slice, {args.experts} experts x {len(layers)} layers")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower left")
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
