"""K3-geometry slices: k3kit's quantized trunk vs llama.cpp, prefill and decode, 1 and 2 threads.

    python benchmarks/bench_slice.py [--dir /tmp/C] [--files mxfp4,iq,q4k,q2k] [--threads 1,2]
                                     [--prompt 64] [--tokens 16] [--reps 2] [--configs ...]
                                     [--lock /tmp/k3bench.lock] [--keep] [--reuse]

Files (`k3kit synth --geometry k3 --layers 2 --experts 16`, full K3 vocabulary, one at a time,
deleted after use unless --keep; with --reuse an existing DIR/slice-NAME/*.gguf is used as it is
and never deleted, e.g. shared slices: `--dir /tmp/slices --reuse`):
  mxfp4  Q8_0 trunk, MXFP4 experts;
  iq     Q8_0 trunk, IQ1_S gate/up + IQ3_XXS down experts;
  q4k    Q4_K trunk (`--trunk-type Q4_K`: the trunk `k3kit requant --to Q4_K` makes), MXFP4 experts;
  q2k    Q8_0 trunk, Q2_K gate/up + Q3_K down experts (a "Q2" file's expert types).
Each run is its own process (one loaded model at a time, peak RSS measured per run); a round
(llama.cpp, then each k3kit configuration) holds flock(2) on LOCK, so that timed runs on a
shared machine do not overlap; rounds repeat `--reps` times, so the sides alternate. Every
run makes two requests of the same prompt on one load (greedy, prefill `--prompt` tokens then
`--tokens` decoded) and reports the second: warm (llama.cpp's pages mapped; k3kit's expert
cache as the first request left it).
k3kit configurations (`--configs`, comma list of MODE:DTYPE:CACHE_MIB):
  ggml:f32:4096   the int8-activation mode (ggml's arithmetic), every expert cached;
  ggml-d256:f32:4096  the same with the int8 kernels' 256-bit direct path (the one before the
                  512-bit path) for few rows: the same bits, the previous speed;
  ggml-fold:f32:4096  the same with the 512-bit direct path that folds each row's sums (the one
                  before the transposed direct path) and its row thresholds: the same bits;
  ggml-trim:f32:4096  the same with glibc's default heap trimming (generate() no longer has it:
                  qmatmul.keep_freed_heap), which page-faults each token's transients in afresh;
  ggml:f32:128    the same through a 128 MiB expert cache (most experts re-read per token);
  float:bf16:4096 float32-activation kernels, bf16 compute (dequantize + bf16 GEMM for many rows).
always `--trunk quantized`, native expert kernels. llama.cpp: llama-cpp-python, F32 KV cache, its
default weight repacking, except on a CPU with AMX-INT8, where llama.cpp aborts on kimi-k3 files
with it (`--llama-no-repack` / `--llama-repack` decide; the header says which). `--llama-both` runs
both llama.cpp peers in every round (repacking on, then off), e.g. with a llama.cpp built without
AMX (`LLAMA_CPP_LIB_PATH=DIR`, named in the header), where its CPU repack path works on this kind of
file. Prints a markdown table: median tok/s of the reps with the spread (min-max), the ratio
k3kit / llama.cpp of the medians (one per peer, `on / off` with --llama-both), peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from k3kit.bench.llama_cpp import model_params, repack_choice
from k3kit.bench.run import cpu_info

ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "mxfp4": [],
    "iq": ["--expert-type", "IQ1_S", "--expert-type-down", "IQ3_XXS"],
    "q4k": ["--trunk-type", "Q4_K"],
    "q2k": ["--expert-type", "Q2_K", "--expert-type-down", "Q3_K"],
}


def prompt_tokens(n: int) -> list[int]:
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from engine_models import prompts
    return list(prompts(1, 400, seed=3, lo=n, hi=n)[0])


def child_llama(path: str, threads: int, n_prompt: int, n_gen: int, repack: bool) -> dict:
    import llama_cpp
    import numpy as np
    prompt = prompt_tokens(n_prompt)
    with model_params(llama_cpp, repack):
        llm = llama_cpp.Llama(model_path=path, n_ctx=n_prompt + n_gen + 8, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, type_k=0, type_v=0, verbose=False)

    def last_token() -> int:
        """Greedy pick from the last evaluated row (without logits_all, `llm.scores` has no rows)."""
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),))))

    out = {}
    for _ in range(2):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tok = last_token()
        toks = [tok]
        for _ in range(n_gen):
            llm.eval([tok])
            tok = last_token()
            toks.append(tok)
        t2 = time.perf_counter()
        out = {"prefill": n_prompt / (t1 - t0), "decode": n_gen / (t2 - t1), "tokens": toks}
    llm.close()
    return out


def child_k3(path: str, threads: int, n_prompt: int, n_gen: int, mode: str, dtype: str, cache: float) -> dict:
    import torch

    from k3kit.adapters import load_model
    from k3kit.kernels import qmatmul
    from k3kit.runtime.engine import generate
    from k3kit.runtime.loader import DTYPES, LoadOptions
    from k3kit.runtime.sampling import make_sampling
    torch.set_num_threads(threads)
    if mode == "ggml-d256":            # the int8 kernels before the 512-bit direct path (same bits)
        mode, qmatmul.I8_PATH = "ggml", 3
    if mode == "ggml-fold":            # the int8 kernels before the transposed direct path (same bits)
        mode, qmatmul.I8_PATH = "ggml", 5
    if mode == "ggml-trim":            # glibc's default heap trimming (before keep_freed_heap)
        mode, qmatmul._heap_kept = "ggml", False
    qmatmul.DEFAULT_ARITH = mode       # every QuantizedMatrix made from here on (trunk and experts)
    prompt = prompt_tokens(n_prompt)
    options = LoadOptions(dtype=DTYPES[dtype], expert_cache_mib=cache, expert_kernel="native",
                          trunk="quantized")
    out = {}
    with load_model(Path(path), options) as loaded:
        for _ in range(2):
            r = generate(loaded.model, prompt, max_tokens=n_gen + 1, sampling=make_sampling(0.0, seed=0),
                         prefill_chunk=512)
            out = {"prefill": r.stats.prefill_tok_s, "decode": r.stats.decode_tok_s,
                   "tokens": list(r.token_ids)}
    return out


def run_child(argv: list[str]) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"child {' '.join(argv)} failed:\n{p.stderr[-3000:]}")
    r: dict = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"<!-- {' '.join(argv[:1] + argv[2:])}: prefill {r['prefill']:.2f} decode {r['decode']:.2f} tok/s, "
          f"RSS {r['rss_mib']:.0f} MiB -->", flush=True)
    return r


@contextlib.contextmanager
def machine_lock(path: str) -> Iterator[None]:
    """Hold flock(2) on `path` (as `flock PATH cmd` does) for the duration; '' holds nothing."""
    if not path:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cell(vals: list[float]) -> str:
    return f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})"


def llama_peers(asked: bool | None, both: bool) -> tuple[list[tuple[str, bool]], str]:
    """([(row label, repack on)] of the llama.cpp peers run in every round, the header's words on it).

    One peer (repack_choice decides) unless `both`: then repacking on and off, in that order, so
    that a llama.cpp whose repack path works here is measured both ways against the same k3kit runs."""
    if both:
        return [("llama.cpp repack on", True), ("llama.cpp repack off", False)], \
            "llama.cpp repack on and off (both asked for)"
    repack, note = repack_choice(asked)
    return [("llama.cpp", repack)], note


def library_note(environ: Mapping[str, str] = os.environ) -> str:
    """Where llama-cpp-python loads libllama from, when not its own build (LLAMA_CPP_LIB_PATH)."""
    lib = environ.get("LLAMA_CPP_LIB_PATH")
    return f"; llama.cpp libraries from LLAMA_CPP_LIB_PATH={lib}" if lib else ""


def table_rows(name: str, threads: str, res: dict[str, list[dict]], peers: list[str]) -> list[str]:
    """The markdown rows of one file and thread count: every engine, its ratios to each peer's medians
    (joined by ' / ' when there are several peers), tokens equal to the first peer's first run."""
    pp = [statistics.median(r["prefill"] for r in res[p]) for p in peers]
    tg = [statistics.median(r["decode"] for r in res[p]) for p in peers]
    first = res[peers[0]][0]["tokens"]
    rows = []
    for label, runs in res.items():
        p = [r["prefill"] for r in runs]
        d = [r["decode"] for r in runs]
        xp = " / ".join(f"{statistics.median(p) / v:.2f}" for v in pp)
        xd = " / ".join(f"{statistics.median(d) / v:.2f}" for v in tg)
        same = "" if label == peers[0] else f"{sum(r['tokens'] == first for r in runs)}/{len(runs)}"
        rows.append(f"| {name} | {threads} | {label} | {cell(p)} | {cell(d)} | {xp} | {xd} | "
                    f"{max(r['rss_mib'] for r in runs):.0f} | {same} |")
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--files", default="mxfp4,iq,q4k")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--configs", default="ggml:f32:4096,ggml:f32:128,float:bf16:4096")
    ap.add_argument("--lock", default="/tmp/k3bench.lock", help="flock file of every timed run ('': none)")
    repack = ap.add_mutually_exclusive_group()
    repack.add_argument("--llama-no-repack", dest="llama_repack", action="store_const", const=False,
                        default=None, help="llama.cpp weight repacking off")
    repack.add_argument("--llama-repack", dest="llama_repack", action="store_const", const=True,
                        help="llama.cpp weight repacking on, even on an AMX-INT8 CPU (default: on, "
                        "except there)")
    repack.add_argument("--llama-both", action="store_true",
                        help="two llama.cpp peers in every round, repacking on then off (ratios to each)")
    ap.add_argument("--keep", action="store_true", help="keep the synthesized files")
    ap.add_argument("--reuse", action="store_true",
                    help="use DIR/slice-NAME/*.gguf if it exists (never deleted) instead of synthesizing")
    ap.add_argument("--child", nargs=argparse.REMAINDER)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.child:
        kind, path, threads, n_prompt, n_gen, *rest = args.child
        if kind == "llama":
            r = child_llama(path, int(threads), int(n_prompt), int(n_gen), rest[0] == "1")
        else:
            r = child_k3(path, int(threads), int(n_prompt), int(n_gen), rest[0], rest[1], float(rest[2]))
        r["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(r))
        return
    configs = [c.split(":") for c in args.configs.split(",")]
    peers, repack_note = llama_peers(args.llama_repack, args.llama_both)
    print(f"{cpu_info()}, {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"prompt {args.prompt}, decode {args.tokens} (greedy), second request of two per load; "
          f"{args.reps} reps alternating; {repack_note}{library_note()}")
    vs = "" if len(peers) == 1 else " (vs on / off)"
    print(f"| file | threads | engine | prefill tok/s | decode tok/s | prefill x{vs} | decode x{vs} | "
          "peak RSS MiB | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.files.split(","):
        out = Path(args.dir) / f"slice-{name}"
        existing = sorted(out.glob("*.gguf")) if args.reuse and out.is_dir() else []
        made = not existing
        if made:
            if out.exists():
                shutil.rmtree(out)
            subprocess.run(["k3kit", "synth", "--geometry", "k3", "--layers", "2", "--experts", "16",
                            "-o", str(out), "--name", f"k3slice-{name}", *FILES[name]],
                           check=True, capture_output=True)
        path = str(existing[0] if existing else next(out.glob("*.gguf")))
        try:
            results: dict[str, dict[str, list[dict]]] = {t: {} for t in args.threads.split(",")}
            for _ in range(args.reps):
                with machine_lock(args.lock):    # a round per hold: llama.cpp then each config, per threads
                    for threads, res in results.items():
                        base = [path, threads, str(args.prompt), str(args.tokens)]
                        for label, repack in peers:
                            res.setdefault(label, []).append(
                                run_child(["llama", *base, "1" if repack else "0"]))
                        for mode, dtype, cache in configs:
                            res.setdefault(f"k3kit {mode} {dtype} {cache} MiB", []).append(
                                run_child(["k3", *base, mode, dtype, cache]))
            for threads, res in results.items():
                print("\n".join(table_rows(name, threads, res, [label for label, _ in peers])), flush=True)
        finally:
            if made and not args.keep:
                shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
