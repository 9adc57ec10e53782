"""Prefill and AR decode tok/s: k3kit's engine vs llama.cpp, same GGUF, same thread count.

    python benchmarks/bench_decode.py [--threads 1] [--prompt 64] [--tokens 32] [--dir /tmp]
                                      [--slice-prompts 4,64] [--slice-tokens 3] [--slice-layers 2]
                                      [--slice-experts 16] [--slice-caches 4096,128] [--model PATH]
                                      [--expert-kernels auto,native,torch]

Models: the shipped mini K3 if built (else a random tiny K3 converted with `k3kit convert
target`, Q8_0 trunk, 16 MXFP4 experts), and a K3-geometry slice from `k3kit synth` (hidden
7168, K3 expert and MLA dims, 8 heads, 2 layers, 16 experts, vocab 512; the same file as
tests/runtime/test_engine_memory.py; `--slice-layers` / `--slice-experts` make it deeper: each
layer is ~2 GB, held by both engines in turn). Engine: f32 compute on the small model, bf16 on the
slice, expert cache big enough for every expert and, on the slice, 128 MiB; each expert kernel
asked for (native: quantized cache, MXFP4 blocks multiplied directly; torch: dequantized cache).
llama.cpp: llama-cpp-python, F32 KV cache, weight repacking off (on a CPU with AMX-INT8 llama.cpp
aborts on kimi-k3 files with it; off everywhere, so that the figures compare across machines).

Each model runs two requests on one load, the same prompt twice, on both sides (on the slice, for
each prompt length): "cold" is the first request after load (the engine reads every
expert it routes to; llama.cpp faults its mapped weights in from the page
cache), "warm" the second (a server's steady state: the engine's expert cache holds what the
prompt routes to, llama.cpp's pages are mapped; what llama-bench's warm-up run and `k3kit
generate`'s warm-up give a timed run). Cold is compared with cold, warm with warm.
Prints tok/s of both and the ratio engine / llama.cpp.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))


def llama_speed(path: Path, prompt: list[int], n: int, threads: int, requests: int = 1
                ) -> list[tuple[float, float]]:
    """(prefill tok/s, decode tok/s) of `requests` greedy runs of `prompt` on one loaded model."""
    import llama_cpp

    from k3kit.bench.llama_cpp import model_params
    with model_params(llama_cpp, repack=False):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n + 8, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, type_k=0, type_v=0, verbose=False)

    def last_token() -> int:
        """Greedy pick from the last evaluated row (without logits_all, `llm.scores` has no rows)."""
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),))))

    out = []
    try:
        for _ in range(requests):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            t1 = time.perf_counter()
            tok = last_token()
            for _ in range(n):
                llm.eval([tok])
                tok = last_token()
            t2 = time.perf_counter()
            out.append((len(prompt) / (t1 - t0), n / (t2 - t1)))
    finally:
        llm.close()
    return out


def engine_speed(path: Path, prompt: list[int], n: int, dtype: torch.dtype, cache_mib: float,
                 requests: int = 1, kernel: str = "auto") -> list[tuple[float, float, dict]]:
    """(prefill tok/s, decode tok/s, stats) of `requests` greedy runs of `prompt` on one adapter:
    the expert cache carries over from one request to the next, as in a server."""
    from k3kit.adapters import load_model
    from k3kit.runtime.engine import generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling
    out = []
    options = LoadOptions(dtype=dtype, expert_cache_mib=cache_mib, expert_kernel=kernel)
    with load_model(path, options) as loaded:
        for _ in range(requests):
            r = generate(loaded.model, prompt, max_tokens=n + 1, sampling=make_sampling(0.0, seed=0),
                         prefill_chunk=512)
            out.append((r.stats.prefill_tok_s, r.stats.decode_tok_s, r.stats.to_dict()))
    return out


def row(name: str, ours: tuple[float, float], peer: tuple[float, float]) -> None:
    print(f"{name:44s} prefill {ours[0]:9.2f} vs {peer[0]:9.2f} tok/s (x{ours[0] / peer[0]:.3f})   "
          f"decode {ours[1]:8.2f} vs {peer[1]:8.2f} tok/s (x{ours[1] / peer[1]:.3f})", flush=True)


def detail(st: dict) -> None:
    print(f"{'':44s} hit rate {st['expert_cache_hit_rate']:.2f}, misses {st['expert_misses']}, payload/token "
          f"{st['payload_bytes_per_token'] / 2**20:.1f} MiB, bench process peak RSS so far "
          f"{st['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--slice-prompts", default="4,64", help="comma-separated slice prompt lengths")
    ap.add_argument("--slice-tokens", type=int, default=3)
    ap.add_argument("--slice-layers", type=int, default=2, help="the slice's layers (each ~2 GB)")
    ap.add_argument("--slice-experts", type=int, default=16, help="routed experts per slice layer")
    ap.add_argument("--slice-caches", default="4096,128", help="comma-separated expert cache sizes (MiB)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--model", default=None, help="small model GGUF (default: shipped mini or a tiny one)")
    ap.add_argument("--no-slice", action="store_true")
    ap.add_argument("--expert-kernels", default="auto",
                    help="comma list of engine expert kernels to run (auto, native, torch)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = args.expert_kernels.split(",")
    from engine_models import SHIPPED, prompts, tiny_gguf

    from k3kit.gguf.synth import K3, synthesize

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        if args.model:
            small, label = Path(args.model), Path(args.model).name
        elif SHIPPED.exists():
            small, label = SHIPPED, "shipped mini K3"
        else:
            small, _ = tiny_gguf(tmp / "tiny", "Q8_0")
            label = "tiny random K3 (Q8_0 trunk)"
        p = prompts(1, 400, seed=2, lo=args.prompt, hi=args.prompt)[0]
        print(f"threads {args.threads}; prompt {args.prompt} tokens, decode {args.tokens} tokens (greedy)")
        peers = llama_speed(small, p, args.tokens, args.threads, requests=2)
        for k in kernels:
            ours = engine_speed(small, p, args.tokens, torch.float32, 1024, requests=2, kernel=k)
            for i, when in enumerate(("cold", "warm")):
                row(f"{label}, f32, all cached, {k}, {when}", ours[i][:2], peers[i])
        if args.no_slice:
            return
        r = synthesize(tmp / "slice", replace(K3, n_dense_lead=0, n_head=8), args.slice_layers,
                       args.slice_experts, vocab=512, progress=False, name="k3slice")
        sl = r.paths[0]
        print(f"K3 slice ({args.slice_layers} layers, {args.slice_experts} experts, "
              f"{Path(sl).stat().st_size / 1e9:.1f} GB): decode {args.slice_tokens} tokens (greedy), "
              "two requests per prompt, one load")
        for n_prompt in (int(x) for x in args.slice_prompts.split(",")):
            p = prompts(1, 400, seed=3, lo=n_prompt, hi=n_prompt)[0]
            peer = llama_speed(sl, p, args.slice_tokens, args.threads, requests=2)
            for k in kernels:
                for cache in (float(c) for c in args.slice_caches.split(",")):
                    ours = engine_speed(sl, p, args.slice_tokens, torch.bfloat16, cache, requests=2, kernel=k)
                    for i, when in enumerate(("cold", "warm")):
                        row(f"slice, p{n_prompt}, {cache} MiB, {k}, {when}", ours[i][:2], peer[i])
                        detail(ours[i][2])


if __name__ == "__main__":
    main()
