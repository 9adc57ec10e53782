"""Whole-model trunk requant (Q8_0 -> Q4_K, MXFP4 experts kept) against `cp` and llama.cpp.

A synthetic model with K3's real widths (hidden 7168, MLA 1536/512, dense FFN 18432,
latent MoE 3584 x 3072, MXFP4 experts) is requantized three ways from the same page-cached
source, one after the other:

* `cp -r` of the shards: the floor for moving the bytes at all;
* `k3kit requant` (default selection, --jobs N): write, fsync, verify, rename, journal;
* llama.cpp's `llama_model_quantize` (llama-cpp-python's low-level API) doing the same job:
  ftype MOSTLY_Q4_K_S with `pure`, keep_split, token_embd/output kept Q8_0 and tensor-type
  overrides `_exps` -> MXFP4 and `attn_k_b|ssm_f_b` -> Q8_0 (k3kit keeps those: ne0 128 is
  not a Q4_K row; llama.cpp would fall back to Q5_0). Same-type tensors are copied by both.

Then the two outputs are compared tensor by tensor (both use ggml's reference Q4_K
quantizer, so they should agree byte for byte). Speeds are MB/s of input model bytes.

    python benchmarks/bench_requant.py [--layers 2] [--experts 64] [--shards 4] [--jobs 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType

from k3kit.gguf import synth
from k3kit.gguf.requant import Options, requantize
from k3kit.gguf.shards import Model


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".gguf"))


def run_cp(src: Path, dst: Path) -> float:
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t0


def run_k3kit(first: Path, out: Path, jobs: int) -> tuple[float, dict]:
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    r = requantize(first, out, Options(), jobs=jobs, progress=False)
    return time.perf_counter() - t0, r.to_dict()


def run_llama(first: Path, out_prefix: Path, nthread: int, mini: bool = False) -> float:
    import llama_cpp.llama_cpp as L
    params = L.llama_model_quantize_default_params()
    params.nthread = nthread
    params.ftype = int(LlamaFileType.MOSTLY_Q4_K_S)
    params.allow_requantize = True
    params.pure = True
    params.keep_split = True
    params.output_tensor_type = int(Q.Q8_0)
    params.token_embedding_type = int(Q.Q8_0)
    rules = [(b"_exps", int(Q.MXFP4)), (b"attn_k_b|ssm_f_b", int(Q.Q8_0))]
    if mini:  # every tensor k3kit keeps for its shape (ne0 not a multiple of 256) stays Q8_0
        rules.append((b"attn_q_b|attn_v_b|ffn_routed_up|ffn_down_shexp|blk\\.3\\.attn_output", int(Q.Q8_0)))
    arr = (L.llama_model_tensor_override * (len(rules) + 1))()
    for i, (pat, t) in enumerate(rules):
        arr[i].pattern = pat
        arr[i].type = t
    arr[len(rules)].pattern = None
    params.tt_overrides = ctypes.cast(arr, type(params.tt_overrides))
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    rc = L.llama_model_quantize(str(first).encode(), str(out_prefix).encode(), ctypes.byref(params))
    subprocess.run(["sync"], check=True)
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return dt


def compare(a_first: Path, b_first: Path) -> tuple[int, int, list[str]]:
    a, b = Model.open(a_first), Model.open(b_first)
    try:
        same, diff = 0, []
        for name, t in a.tensors.items():
            u = b.tensors.get(name)
            if u is not None and u.ggml_type == t.ggml_type and np.array_equal(a.view(name), b.view(name)):
                same += 1
            else:
                diff.append(f"{name} ({t.ggml_type.name} vs {u.ggml_type.name if u else 'missing'})")
        return same, len(a.tensors), diff
    finally:
        a.close()
        b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="k3", choices=sorted(synth.GEOMETRIES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--skip-llama", action="store_true")
    args = ap.parse_args()

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_requant."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        vocab = 1024 if args.geometry == "k3" else None
        res = synth.synthesize(work / "src", args.geometry, args.layers, args.experts, vocab=vocab,
                               shards=args.shards, seed=1, progress=False)
        first = Path(res.paths[0])
        total = _size(work / "src")
        print(f"model: {args.geometry} geometry, {args.layers} layers, {args.experts} experts, "
              f"{args.shards} shards, "
              f"{total / 1e9:.3f} GB (synth {time.perf_counter() - t0:.1f} s); {os.cpu_count()} cores")

        t_cp = run_cp(work / "src", work / "cp")
        shutil.rmtree(work / "cp")
        t_k3, r = run_k3kit(first, work / "k3kit", args.jobs)
        trunk_in = sum(g["bytes_before"] for g in r["by_role"] if g["from"] != g["to"])
        print(f"requantized {r['requantized']} tensors ({trunk_in / 1e9:.3f} GB of Q8_0), "
              f"copied {r['copied']}; output {r['bytes_out'] / 1e9:.3f} GB")
        w = sum(s["write_seconds"] for s in r["shards"])
        v = sum(s["seconds"] - s["write_seconds"] for s in r["shards"])
        print(f"k3kit worker time: write (dequant + quantize + copy) {w:.1f} s, "
              f"verify (re-read, bounds, 1/16 rows requantized again, sha256) {v:.1f} s")
        rows = [("cp -r", t_cp), (f"k3kit requant --jobs {args.jobs}", t_k3)]
        if not args.skip_llama:
            (work / "llama").mkdir()
            t_ll = run_llama(first, work / "llama" / first.name.split("-00001-of-")[0], args.jobs,
                             mini=args.geometry == "mini")
            rows.append((f"llama_model_quantize nthread={args.jobs}", t_ll))
        print(f"{'method':36s} {'seconds':>8s} {'MB/s':>8s} {'x cp time':>10s}")
        for name, t in rows:
            print(f"{name:36s} {t:8.2f} {total / t / 1e6:8.1f} {t / t_cp:10.1f}")
        if not args.skip_llama:
            print(f"k3kit / llama.cpp time ratio: {t_k3 / t_ll:.2f} (below 1 = k3kit faster)")
            llama_first = sorted((work / "llama").glob("*.gguf"))[0]
            same, n, diff = compare(work / "k3kit" / first.name, llama_first)
            print(f"tensor bytes identical to llama.cpp's output: {same}/{n}")
            for d in diff[:10]:
                print(f"  differs: {d}")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
