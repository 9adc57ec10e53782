"""Header-only `inspect` of a 32-shard model vs gguf-py's GGUFReader on the same files.

The model has K3's structure (93 layers, KDA/MLA pattern, stacked experts, a 160k-entry
gpt2-style tokenizer with merges in shard 1) but small matrices: what is measured is
header parsing, which depends on tensor and token counts, not on tensor sizes. Each side
runs in its own subprocess (best of --reps) so peak RSS is that side's alone. The ratio is
gguf-py / k3kit (higher is better for k3kit).

    python benchmarks/bench_inspect.py [--dir DIR] [--shards 32] [--vocab 160000] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from k3kit.gguf.reader import tensor_nbytes
from k3kit.gguf.writer import TensorSpec, kv, write_model

H, LATENT, FF, N_EXPERT, VOCAB_EMB = 512, 256, 128, 16, 4096


def model_specs(n_layers: int, vocab: int) -> tuple[list, list[TensorSpec]]:
    """KVs and tensors of a K3-shaped model with small matrices and a full-size tokenizer."""
    pool = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)

    def t(name, shape, qtype):
        n = tensor_nbytes(shape, qtype)
        start = (hash(name) & 0xFFFFF) % (len(pool) - n)
        return TensorSpec(name, shape, qtype, n, pool[start:start + n])

    heads_kv = [1 if (i % 4 == 3 or i == n_layers - 1) else 0 for i in range(n_layers)]
    tokens = [f"\u0120tok{i}" for i in range(vocab)]
    merges = [f"\u0120t ok{i}" for i in range(vocab)]
    kvs = [
        kv("general.architecture", V.STRING, "kimi-k3"), kv("general.name", V.STRING, "bench-k3"),
        kv("kimi-k3.block_count", V.UINT32, n_layers), kv("kimi-k3.context_length", V.UINT32, 1 << 20),
        kv("kimi-k3.embedding_length", V.UINT32, H), kv("kimi-k3.expert_count", V.UINT32, N_EXPERT),
        kv("kimi-k3.expert_used_count", V.UINT32, 4),
        kv("kimi-k3.attention.head_count_kv", V.ARRAY, heads_kv, V.UINT32),
        kv("tokenizer.ggml.model", V.STRING, "gpt2"), kv("tokenizer.ggml.pre", V.STRING, "kimi-k2"),
        kv("tokenizer.ggml.tokens", V.ARRAY, tokens, V.STRING),
        kv("tokenizer.ggml.token_type", V.ARRAY, np.ones(vocab, dtype=np.int32), V.INT32),
        kv("tokenizer.ggml.merges", V.ARRAY, merges, V.STRING),
    ]
    specs = [t("token_embd.weight", (H, VOCAB_EMB), Q.Q8_0)]
    for i in range(n_layers):
        p = f"blk.{i}."
        specs += [t(p + "attn_norm.weight", (H,), Q.F32), t(p + "ffn_norm.weight", (H,), Q.F32)]
        if heads_kv[i] == 0:
            specs += [t(p + n, (H, H), Q.Q8_0) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                          "ssm_g.weight", "attn_output.weight")]
            specs += [t(p + "ssm_conv1d_q.weight", (4, 1, H), Q.F32), t(p + "ssm_a", (8,), Q.F32),
                      t(p + "ssm_f_a.weight", (H, 64), Q.Q8_0), t(p + "ssm_beta.weight", (H, 8), Q.F32)]
        else:
            specs += [t(p + "attn_q_a.weight", (H, 256), Q.Q8_0), t(p + "attn_q_b.weight", (256, H), Q.Q8_0),
                      t(p + "attn_kv_a_mqa.weight", (H, 288), Q.Q8_0),
                      t(p + "attn_k_b.weight", (64, 256, 4), Q.Q8_0),
                      t(p + "attn_v_b.weight", (256, 64, 4), Q.Q8_0),
                      t(p + "attn_output.weight", (H, H), Q.Q8_0)]
        if i == 0:
            specs += [t(p + n, (H, 1024), Q.Q8_0) for n in ("ffn_gate.weight", "ffn_up.weight")]
            specs += [t(p + "ffn_down.weight", (1024, H), Q.Q8_0)]
        else:
            specs += [t(p + "ffn_gate_inp.weight", (H, N_EXPERT), Q.F32),
                      t(p + "exp_probs_b.bias", (N_EXPERT,), Q.F32),
                      t(p + "ffn_routed_down.weight", (H, LATENT), Q.Q8_0),
                      t(p + "ffn_routed_up.weight", (LATENT, H), Q.Q8_0),
                      t(p + "ffn_gate_exps.weight", (LATENT, FF, N_EXPERT), Q.MXFP4),
                      t(p + "ffn_up_exps.weight", (LATENT, FF, N_EXPERT), Q.MXFP4),
                      t(p + "ffn_down_exps.weight", (FF, LATENT, N_EXPERT), Q.MXFP4),
                      t(p + "ffn_gate_shexp.weight", (H, FF), Q.Q8_0),
                      t(p + "ffn_up_shexp.weight", (H, FF), Q.Q8_0),
                      t(p + "ffn_down_shexp.weight", (FF, H), Q.Q8_0)]
    specs += [t("output_norm.weight", (H,), Q.F32), t("output.weight", (H, VOCAB_EMB), Q.Q8_0)]
    return kvs, specs


def balanced_layout(specs: list[TensorSpec], n: int) -> list[list[str]]:
    """Exactly `n` shards of about equal bytes, tensors in order."""
    total = sum(s.nbytes for s in specs)
    groups: list[list[str]] = [[] for _ in range(n)]
    done = 0
    for s in specs:
        groups[min(n - 1, done * n // total)].append(s.name)
        done += s.nbytes
    return [g for g in groups if g]


K3KIT = """
import json, resource, sys, time
from k3kit.gguf.shards import Model
from k3kit.gguf.inspect import inspect_model
rss0 = int(open('/proc/self/statm').read().split()[1]) * 4096
t0 = time.perf_counter()
with Model.open(sys.argv[1]) as m:
    r = inspect_model(m)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_before": rss0, "tensors": r["n_tensors"], "bytes": r["total_bytes"]}))
"""

GGUF_PY = """
import json, resource, sys, time
from gguf import GGUFReader
rss0 = int(open('/proc/self/statm').read().split()[1]) * 4096
t0 = time.perf_counter()
n = b = 0
for p in sys.argv[1:]:
    r = GGUFReader(p)
    n += len(r.tensors)
    b += sum(int(t.n_bytes) for t in r.tensors)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_before": rss0, "tensors": n, "bytes": b}))
"""


def measure(script: str, args: list[str], reps: int) -> dict:
    best = None
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True,
                             text=True).stdout
        r = json.loads(out)
        if best is None or r["seconds"] < best["seconds"]:
            best = r
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="where to write the model (default: a temp dir, removed after)")
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--layers", type=int, default=93)
    ap.add_argument("--vocab", type=int, default=160_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="k3kit-bench-inspect-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        kvs, specs = model_specs(args.layers, args.vocab)
        paths = write_model(work / "bench-k3.gguf", kvs, specs, layout=balanced_layout(specs, args.shards))
        size = sum(p.stat().st_size for p in paths)
        print(f"model: {len(paths)} shards, {len(specs)} tensors, {size / 1e6:.0f} MB on disk, "
              f"vocab {args.vocab} (tokens + merges + token_type), best of {args.reps}")
        ours = measure(K3KIT, [str(paths[0])], args.reps)
        peer = measure(GGUF_PY, [str(p) for p in paths], args.reps)
        assert (ours["tensors"], ours["bytes"]) == (peer["tensors"], peer["bytes"]), (ours, peer)
        print(f"{'':26s} {'seconds':>9s} {'peak RSS MB':>12s} {'RSS growth MB':>14s}")
        for label, r in (("k3kit Model.open+inspect", ours), ("gguf-py GGUFReader x32", peer)):
            print(f"{label:26s} {r['seconds']:9.3f} {r['peak_rss'] / 1e6:12.0f} "
                  f"{(r['peak_rss'] - r['rss_before']) / 1e6:14.0f}")
        print(f"time ratio gguf-py / k3kit: {peer['seconds'] / ours['seconds']:.1f}x; "
              f"peak RSS ratio: {peer['peak_rss'] / ours['peak_rss']:.2f}x")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
