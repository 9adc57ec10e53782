"""A model bigger than RAM: k3kit with a bounded expert cache vs llama.cpp (mmap) on the same file.

The file: `k3kit synth`'s K3 geometry (hidden 7168, expert latent 3584, expert FFN 3072, MXFP4
experts, Q8_0 trunk) with 4 layers of 896 experts (layer 0 dense): ~52 GB, >= 1.3x this machine's
RAM (checked). Made once under --dir (or given with --file) and reused; --delete removes it after.

Steps, each a subprocess under `flock /tmp/k3bench.lock` (each well under 10 minutes):
  seq      the disk's sequential read bandwidth on the file itself: --seq-gib of its expert region
           read in 16 MiB requests with O_DIRECT, and buffered after POSIX_FADV_DONTNEED (the
           larger is "the physical limit" below)
  k3kit    one process per read mode (`default`: what `k3kit generate` does with no flags, always
           run first: `--expert-io auto` and the expert cache it sizes from the RAM left, prefetch
           as the loader decides; `page`: through the page cache; `cold`: what `k3kit
           generate --cold` does, O_DIRECT reads straight into the cache's buffers; `fadvise`:
           the previous --cold, pread with fadvise around every read), the model loaded once, then greedy
           runs of --tokens tokens with a --cache-mib expert cache, prefetch off and on
           alternating (--repeats each), the file dropped from the page cache before each run
  llama    llama-cpp-python's low-level API as users run it (mmap), `default` (its loader tries
           to repack the experts into a CPU_REPACK buffer as large as the experts) and
           `norepack` (llama_model_params.use_extra_bufts = False); without --llama, `default`
           is left out on a CPU with AMX-INT8 (llama.cpp aborts on kimi-k3 files with repacking
           there: k3kit.bench.llama_cpp.repack_choice); the process's anonymous
           memory is capped (RLIMIT_DATA and a watchdog on RssAnon, --anon-limit-gib) so a
           repack that does not fit fails instead of taking the machine down
  ab       (`--ab cold,fadvise --pairs 3`: only this step) the read modes compared in one process
           on one loaded model, `ExpertStore.set_cold` between runs, order alternated per pair;
           the limit (one and four O_DIRECT streams, 256 MiB each, the larger) measured right
           before AND right after every run. `valid_run` is the rule for discarding a run: before
           and after agree within 1.5x and the run's own decode disk rate is not above 1.1x the
           larger (else the disk switched between burst and throttle during it). Prints each
           run, medians over the valid ones and each valid pair's payload ratio. A mode may carry
           its prefetch setting and reader count: `cold/ungated`, `cold/off`, `cold/on/8`.
  io       (`--step io`) the read path alone: planned batches of 16 random experts fetched with
           no products, per mode, alternated: whether a mode is slower at the disk or on the CPU.


Per run: the bytes this process read from storage during decode (/proc/self/io) over the store's
ledger (io_bytes) for the same tokens: 1.00 when every byte read went through the ledger; peak
RSS (VmHWM), decode tok/s, expert payload bytes per token (k3kit's ledger),
bytes the disk delivered per decoded token and the decode-phase disk MB/s (from /proc/diskstats
of the file's device, between the first and the last generated token), and that rate as a
fraction of the disk's sequential bandwidth measured right before that run (512 MiB, O_DIRECT:
this machine's virtual disk gives ~700 MB/s in bursts and ~100 MB/s when throttled, so one
figure at the start would not describe a run minutes later), and the issue's figure: the routed
expert payload delivered (payload per token x tok/s) as a fraction of that limit. Bytes read on
a wrong prefetch guess count as disk traffic, never as payload. The last lines print k3kit /
llama.cpp ratios.

--threads: on this 2-core machine one compute thread leaves the other core to the readers (and
to whatever else runs); with 2, a reader or another process that takes a core stalls every
2-thread product at its barrier (measured on a loaded machine: a 5.8 MB MXFP4 product 1.0 ms
with 1 thread, 12-16 ms with 2). Compare both with two runs.

Prefetch: each k3kit run is made with prefetch off and on (`--expert-prefetch off|on` on the
CLI; `auto`, the default, turns it on when the cache cannot hold every expert).

    python benchmarks/bench_out_of_core.py --dir /work/ooc --tokens 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from k3kit.bench.llama_cpp import model_params, repack_choice

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ooc_disk import (  # noqa: E402
    GIB,
    cpu_times,
    disk_read_bytes,
    drop_cache,
    mem_total,
    proc_read_bytes,
    quick_limit,
    quick_seq,
    status,
    step_seq,
)
from ooc_report import fmt_rate, report_ab  # noqa: E402

LOCK = "/tmp/k3bench.lock"
PROMPT = "The fox"   # 4 tokens: a long prompt would read most experts of every layer in prefill


# ---------------------------------------------------------------- steps (run under the lock)

def step_check(path: Path, n: int) -> dict[str, Any]:
    """What the scale check adds to a miss: `n` experts of layer 1 read on the caller's thread
    (no read-ahead), from storage (cold) and from the page cache, check on and off alternating."""
    from k3kit.gguf.shards import Model
    from k3kit.runtime.experts import ExpertStore
    model = Model.open(path)
    names = [f"blk.1.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    out: dict[str, Any] = {}
    for mode in ("cold", "page"):
        per: dict[bool, list[float]] = {True: [], False: []}
        check_s = []
        for rep in range(4):
            for on in (rep % 2 == 0, rep % 2 == 1):
                experts = list(range(rep * 2 * n + on * n, rep * 2 * n + on * n + n))
                cold = "fadvise" if mode == "cold" else False
                with ExpertStore.from_gguf(model, {1: names}, keep="quantized", read_ahead=False,
                                           check_scales=on, cold=cold) as st:
                    if mode == "page":
                        st.get(1, experts)          # warm the page cache, then time the misses
                        st.clear()
                        st.reset_stats()
                    t0 = time.perf_counter()
                    for e in experts:
                        st.get(1, [e])
                    per[on].append((time.perf_counter() - t0) / n)
                    if on:
                        check_s.append(st.stats().check_seconds / n)
        out[mode] = {"miss_s_check": statistics.median(per[True]),
                     "miss_s_nocheck": statistics.median(per[False]), "check_s": statistics.median(check_s),
                     "expert_bytes": sum(model.tensors[x].nbytes // model.tensors[x].shape[2] for x in names)}
    model.close()
    return out


def step_k3kit(path: Path, mode: str, tokens: int, cache_mib: float, threads: int, trunk: str,
               dtype: str, repeats: int, prefetch: list[str]) -> dict[str, Any]:
    import torch

    from k3kit.adapters import load_model
    from k3kit.models.kimi_k3.moe import set_expert_prefetch
    from k3kit.runtime.engine import generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling

    torch.set_num_threads(threads)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    t0 = time.perf_counter()
    io: dict[str, Any] = {}
    if mode == "default":       # what `k3kit generate MODEL` does with no flags: --expert-io auto
        from k3kit.plan.expert_io import for_model
        choice = for_model(path, "auto", None)
        cold: bool | str = choice.cold
        cache_mib, prefetch, io = choice.cache_mib, ["auto"], choice.to_dict()
        print(choice.line(), file=sys.stderr, flush=True)
    else:
        cold = {"cold": True, "fadvise": "fadvise", "page": False}[mode]
    lm = load_model(path, LoadOptions(expert_cache_mib=cache_mib, cold=cold, trunk=trunk, dtype=dt))
    load_s = time.perf_counter() - t0
    adapter = lm.model
    prompt = lm.codec.encode(PROMPT)
    runs = []
    try:
        for _ in range(repeats):
            for pf in prefetch:
                if pf != "auto":        # auto: the loader's choice (--expert-prefetch auto)
                    set_expert_prefetch(adapter.model.modules(), pf == "on")
                lm.reset_expert_cache(cache_mib)
                drop_cache(path)
                seq = quick_seq(path, len(runs))
                marks: list[tuple[float, int, int, int]] = []
                store = adapter.store

                def on_token(_: int, marks: list[tuple[float, int, int, int]] = marks,
                             store: Any = store) -> None:
                    marks.append((time.perf_counter(), disk_read_bytes(path), proc_read_bytes(),
                                  store.stats().io_bytes))

                d0 = disk_read_bytes(path)
                r = generate(adapter, prompt, max_tokens=tokens, sampling=make_sampling(0.0, seed=0),
                             on_token=on_token)
                d1 = disk_read_bytes(path)
                s = r.stats
                es = adapter.store.stats()
                (ta, da, pa, la), (tb, db, pb, lb) = marks[0], marks[-1]
                runs.append({
                    "direct": store.direct_io, "ledger_io_bytes": lb - la, "proc_read_bytes": pb - pa,
                    "prefetch": pf, "tokens": r.token_ids, "decode_tok_s": s.decode_tok_s,
                    "prefill_tok_s": s.prefill_tok_s, "prompt_tokens": s.prompt_tokens,
                    "payload_per_token": s.payload_bytes_per_token, "hit_rate": s.expert_cache_hit_rate,
                    "disk_bytes": d1 - d0, "decode_disk_per_token": (db - da) / max(len(marks) - 1, 1),
                    "decode_disk_Bps": (db - da) / (tb - ta) if tb > ta else 0.0,
                    "prefetched": es.prefetched, "prefetch_used": es.prefetch_used,
                    "wasted_bytes": es.wasted_bytes, "wait_s": es.wait_seconds, "check_s": es.check_seconds,
                    "misses": es.misses, "read_s": es.read_seconds, "ahead_reads": es.ahead_reads,
                    "seq_Bps": seq, "guesses": es.guesses, "guesses_right": es.guesses_right,
                })
    finally:
        lm.close()
    return {"mode": mode, "load_s": load_s, "peak_rss": status("VmHWM"), "runs": runs,
            "trunk": trunk, "dtype": dtype, "prompt_ids": prompt, "cache_mib": cache_mib, "expert_io": io}


def step_ab(path: Path, modes: list[str], pairs: int, tokens: int, cache_mib: float, threads: int,
            trunk: str, dtype: str, prefetch: str) -> dict[str, Any]:
    """Read modes A/B in one process on one loaded model (`ExpertStore.set_cold` between runs):
    a mode is `cold`, `fadvise` or `page`, optionally with its own prefetch setting after a slash
    (`cold/off`, `cold/ungated`: hints read whatever their precision; else `prefetch`) and
    background reader count after a second slash (`cold/on/8`);
    `pairs` pairs, the order alternating (A B, B A, ...), the disk's limit measured right before
    AND right after each run, so a run during which the disk changed state can be recognized
    (`valid_run`). One JSON line per run as it ends: a step killed at its timeout keeps them."""
    import torch

    from k3kit.adapters import load_model
    from k3kit.models.kimi_k3.moe import set_expert_prefetch
    from k3kit.runtime.engine import generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling

    torch.set_num_threads(threads)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    cold = {"cold": True, "fadvise": "fadvise", "page": False}
    lm = load_model(path, LoadOptions(expert_cache_mib=cache_mib, cold=cold[modes[0].split("/")[0]],
                                      trunk=trunk, dtype=dt))
    adapter = lm.model
    prompt = lm.codec.encode(PROMPT)
    set_expert_prefetch(adapter.model.modules(), prefetch == "on")
    precision, default_readers = adapter.store.prefetch_precision, adapter.store.read_threads
    # warm-up (not recorded): the trunk's pages come in here, not in the first measured run
    generate(adapter, prompt, max_tokens=2, sampling=make_sampling(0.0, seed=0))
    runs: list[dict[str, Any]] = []
    k = 0
    try:
        for i in range(pairs):
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                read, _, rest = mode.partition("/")
                pf, _, readers = rest.partition("/")
                pf = pf or prefetch
                adapter.store.read_threads = int(readers or default_readers)
                adapter.store.set_cold(cold[read])
                set_expert_prefetch(adapter.model.modules(), pf != "off")
                adapter.store.prefetch_precision = 0.0 if pf == "ungated" else precision
                lm.reset_expert_cache(cache_mib)
                drop_cache(path)
                before1, before4 = quick_limit(path, k)
                marks: list[tuple[float, int]] = []

                def on_token(_: int, marks: list[tuple[float, int]] = marks) -> None:
                    marks.append((time.perf_counter(), disk_read_bytes(path)))

                cpu0, t0, d0 = cpu_times(), time.perf_counter(), disk_read_bytes(path)
                r = generate(adapter, prompt, max_tokens=tokens, sampling=make_sampling(0.0, seed=0),
                             on_token=on_token)
                cpu1, t1, d1 = cpu_times(), time.perf_counter(), disk_read_bytes(path)
                after1, after4 = quick_limit(path, k + 1)
                k += 2
                before, after = max(before1, before4), max(after1, after4)
                s, es = r.stats, adapter.store.stats()
                (ta, da), (tb, db) = marks[0], marks[-1]
                run = {"pair": i, "mode": mode, "direct": adapter.store.direct_io, "tokens": r.token_ids,
                       "decode_tok_s": s.decode_tok_s, "prefill_tok_s": s.prefill_tok_s,
                       "payload_per_token": s.payload_bytes_per_token,
                       "seq_before": before, "seq_after": after, "seq1_before": before1,
                       "seq4_before": before4, "seq1_after": after1, "seq4_after": after4,
                       "decode_disk_Bps": (db - da) / (tb - ta) if tb > ta else 0.0,
                       "disk_bytes": d1 - d0, "wall_s": t1 - t0,
                       "cpu_user_s": cpu1[0] - cpu0[0], "cpu_sys_s": cpu1[1] - cpu0[1],
                       "misses": es.misses, "io_bytes": es.io_bytes, "read_s": es.read_seconds,
                       "load_avg_1min": os.getloadavg()[0],      # other processes on the 2 cores
                       "wait_s": es.wait_seconds, "check_s": es.check_seconds, "prefetched": es.prefetched,
                       "prefetch_used": es.prefetch_used, "wasted_bytes": es.wasted_bytes,
                       "guesses": es.guesses, "guesses_right": es.guesses_right, "peak_rss": status("VmHWM")}
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        lm.close()
    return {"runs": runs, "peak_rss": status("VmHWM"), "prompt_ids": prompt}


def step_io(path: Path, modes: list[str], pairs: int, batches: int, cache_mib: float,
            read_threads: int) -> dict[str, Any]:
    """The read path alone, no products: `batches` batches of 16 random experts of the MoE layers,
    each planned (queued for the background readers) and then fetched, as the model does, per
    read mode, alternating, the limit measured before and after each."""
    import random

    from k3kit.gguf.shards import Model
    from k3kit.runtime.experts import ExpertStore
    model = Model.open(path)
    moe = sorted({int(n.split(".")[1]) for n in model.tensors if "_exps." in n})
    layers = {il: [f"blk.{il}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")] for il in moe}
    cold = {"cold": True, "fadvise": "fadvise"}
    n_exp = model.tensors[layers[moe[0]][0]].shape[2]
    rng = random.Random(0)
    runs = []
    k = 100
    for i in range(pairs):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            drop_cache(path)
            before = quick_seq(path, k)
            with ExpertStore.from_gguf(model, layers, keep="quantized", cold=cold[mode], cache_mib=cache_mib,
                                       read_threads=read_threads) as st:
                cpu0, t0, d0 = cpu_times(), time.perf_counter(), disk_read_bytes(path)
                for b in range(batches):
                    il = moe[b % len(moe)]
                    ids = rng.sample(range(n_exp), 16)
                    st.plan(il, ids)
                    for e in ids:
                        st.get(il, [e])
                cpu1, t1, d1 = cpu_times(), time.perf_counter(), disk_read_bytes(path)
                es = st.stats()
                direct = st.direct_io
            after = quick_seq(path, k + 1)
            k += 2
            run = {"pair": i, "mode": mode, "direct": direct, "payload_Bps": es.bytes_read / (t1 - t0),
                   "disk_Bps": (d1 - d0) / (t1 - t0), "seq_before": before, "seq_after": after,
                   "cpu_user_s": cpu1[0] - cpu0[0], "cpu_sys_s": cpu1[1] - cpu0[1],
                   "wall_s": t1 - t0, "bytes": es.bytes_read, "read_s": es.read_seconds,
                   "check_s": es.check_seconds, "wait_s": es.wait_seconds}
            runs.append(run)
            print(json.dumps(run), flush=True)
    model.close()
    return {"runs": runs}


def step_llama(path: Path, variant: str, prompt: list[int], tokens: int, threads: int,
               anon_limit: int) -> dict[str, Any]:
    """One greedy run; the result is printed by the caller's subprocess as JSON."""
    import llama_cpp
    import numpy as np

    resource.setrlimit(resource.RLIMIT_DATA, (anon_limit, anon_limit))
    peak_anon = [0]

    t_start = time.perf_counter()

    def watchdog() -> None:
        k = 0
        while True:
            anon = status("RssAnon")
            peak_anon[0] = max(peak_anon[0], anon)
            k += 1
            if k % 100 == 0:    # a progress line: the last JSON line if the step is killed
                print(json.dumps({"variant": variant, "ok": False, "peak_rss": status("VmHWM"),
                                  "rss_file": status("RssFile"), "peak_anon": peak_anon[0],
                                  "error": f"still running after {time.perf_counter() - t_start:.0f} s "
                                  f"(RSS {status('VmRSS') / GIB:.1f} GiB, of it file pages "
                                  f"{status('RssFile') / GIB:.1f} GiB)"}), flush=True)
            if anon > anon_limit:
                print(json.dumps({"variant": variant, "ok": False, "peak_rss": status("VmHWM"),
                                  "peak_anon": anon, "error": f"killed: RssAnon {anon / GIB:.1f} GiB "
                                  f"> {anon_limit / GIB:.1f} GiB"}), flush=True)
                os._exit(3)
            time.sleep(0.1)

    threading.Thread(target=watchdog, daemon=True).start()
    t0 = time.perf_counter()
    try:
        with model_params(llama_cpp, repack=variant == "default"):
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + tokens + 8, n_batch=512,
                                  n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    except Exception as e:     # the failure is the result: report it
        return {"variant": variant, "ok": False, "load_s": time.perf_counter() - t0,
                "peak_rss": status("VmHWM"), "peak_anon": peak_anon[0], "error": f"{type(e).__name__}: {e}"}
    load_s = time.perf_counter() - t0
    drop_cache(path)
    seq = quick_seq(path, 8 + (variant == "default"))
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    out = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
    ta, da = time.perf_counter(), disk_read_bytes(path)
    for _ in range(tokens - 1):
        llm.eval([out[-1]])
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    tb, db = time.perf_counter(), disk_read_bytes(path)
    res = {"variant": variant, "ok": True, "load_s": load_s, "tokens": out,
           "prefill_tok_s": len(prompt) / (t1 - t0), "decode_tok_s": (tokens - 1) / (tb - ta),
           "decode_disk_per_token": (db - da) / (tokens - 1), "decode_disk_Bps": (db - da) / (tb - ta),
           "peak_rss": status("VmHWM"), "rss_file_end": status("RssFile"), "peak_anon": peak_anon[0],
           "seq_Bps": seq}
    llm.close()
    return res


# ---------------------------------------------------------------- the driver

def locked(args: list[str], timeout: float) -> dict[str, Any]:
    """Run this script's step `args` under the machine lock (waiting for it as long as it
    takes; then `timeout` seconds for the step itself); its last stdout line is JSON."""
    cmd = ["flock", LOCK, "timeout", "-s", "KILL", str(int(timeout)), sys.executable, __file__, *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode in (-9, 137):
        last = json.loads(lines[-1]) if lines else {}
        return last | {"ok": False, "error": f"killed after {timeout:.0f} s; last: {last.get('error')}"}
    if not lines:
        err = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "error": f"exit {r.returncode}: {err}", "wall_s": time.perf_counter() - t0}
    final = [ln for ln in lines if "still running" not in ln]     # not a watchdog progress line
    out: dict[str, Any] = json.loads((final or lines)[-1])
    out.setdefault("ok", r.returncode == 0)
    out["exit"] = r.returncode
    return out


def ensure_file(args: argparse.Namespace) -> Path:
    if args.file:
        return Path(args.file)
    from k3kit.gguf.synth import default_name, plan
    p = plan("k3", args.layers, args.experts)
    path = Path(args.dir) / (default_name(p.geometry, args.layers, args.experts) + ".gguf")
    if not path.exists():
        cmd = ["flock", LOCK, sys.executable, "-m", "k3kit.cli", "synth", "-o", args.dir, "--geometry", "k3",
               "--layers", str(args.layers), "--experts", str(args.experts), "--json"]
        print("synthesizing", path, flush=True)
        subprocess.run(cmd, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
    return path


def llama_variants_for(asked: str | None) -> tuple[list[str], str]:
    """The llama.cpp variants to run and what to say about repacking: --llama as given, else
    `default` (repacking on) and `norepack`, without `default` where repack_choice turns it off."""
    if asked is not None:
        variants = [v for v in asked.split(",") if v]
        return variants, ("llama.cpp repack as asked for: " + (", ".join(variants) or "no llama.cpp runs"))
    repack, note = repack_choice(None)
    return (["default", "norepack"] if repack else ["norepack"]), note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", help="reuse this GGUF instead of synthesizing one")
    ap.add_argument("--dir", default="/work/ooc", help="where to synthesize the file")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per run")
    ap.add_argument("--cache-mib", type=float, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trunk", default="quantized", choices=["quantized", "float"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--modes", default="cold,page", help="k3kit read modes: cold, fadvise, page (the "
                    "default run, `k3kit generate` with no flags, is always measured too, first)")
    ap.add_argument("--prefetch", default="off,on", help="prefetch settings, alternated")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ab", help="only the read-mode A/B in one process, e.g. cold,fadvise (see `ab`)")
    ap.add_argument("--pairs", type=int, default=3, help="--ab pairs, order alternated")
    ap.add_argument("--llama", default=None, help="llama.cpp variants ('' = none; default: default,norepack, "
                    "or norepack alone on an AMX-INT8 CPU)")
    ap.add_argument("--seq-gib", type=float, default=4)
    ap.add_argument("--anon-limit-gib", type=float, default=16)
    ap.add_argument("--timeout", type=float, default=570, help="seconds per locked step")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--delete", action="store_true", help="delete the synthesized file at the end")
    ap.add_argument("--allow-small", action="store_true", help="run on a file < 1.3x RAM (smoke test)")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.step:     # inside the lock
        path = Path(args.file)
        if args.step == "seq":
            res = step_seq(path, args.seq_gib)
        elif args.step == "check":
            res = step_check(path, 8)
        elif args.step == "io":
            res = step_io(path, args.modes.split(","), args.repeats, args.tokens, args.cache_mib,
                          args.threads)
        elif args.step == "ab":
            res = step_ab(path, args.modes.split(","), args.repeats, args.tokens, args.cache_mib,
                          args.threads, args.trunk, args.dtype, args.prefetch)
        elif args.step.startswith("k3kit-"):
            res = step_k3kit(path, args.step[6:], args.tokens, args.cache_mib, args.threads, args.trunk,
                             args.dtype, args.repeats, args.prefetch.split(","))
        else:
            res = step_llama(path, args.step[6:], json.loads(args.prompt_ids), args.tokens, args.threads,
                             int(args.anon_limit_gib * GIB))
        print(json.dumps(res), flush=True)
        return

    path = ensure_file(args)
    size, ram = path.stat().st_size, mem_total()
    print(f"file {path}: {size / 1e9:.1f} GB = {size / ram:.2f}x RAM ({ram / GIB:.1f} GiB)", flush=True)
    if size < 1.3 * ram and not args.allow_small:
        sys.exit(f"{path}: {size / 1e9:.1f} GB is less than 1.3x RAM; not an out-of-core run")
    common = ["--file", str(path), "--tokens", str(args.tokens), "--threads", str(args.threads)]
    if args.ab:
        r = locked(["--step", "ab", *common, "--modes", args.ab, "--repeats", str(args.pairs), "--cache-mib",
                    str(args.cache_mib), "--trunk", args.trunk, "--dtype", args.dtype, "--prefetch",
                    args.prefetch.split(",")[-1]], args.timeout)
        if not r.get("runs"):
            sys.exit(f"ab step failed: {r.get('error')}")
        out = {"file": str(path), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "runs": r["runs"]} | report_ab(r["runs"])
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return
    llama_variants, repack_note = llama_variants_for(args.llama)
    print(repack_note, flush=True)
    results: dict[str, Any] = {"file": str(path), "file_bytes": size, "ram_bytes": ram,
                               "llama_repack": repack_note,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "args": {k: v for k, v in vars(args).items() if k != "step"}}

    seq = locked(["--step", "seq", "--file", str(path), "--seq-gib", str(args.seq_gib)], args.timeout)
    results["seq"] = seq
    limit = seq.get("seq_Bps", 0.0)
    print(f"sequential read: O_DIRECT {fmt_rate(seq.get('direct_Bps', 0))} MB/s, buffered "
          f"{fmt_rate(seq.get('buffered_Bps', 0))} MB/s, O_DIRECT 4 streams "
          f"{fmt_rate(seq.get('direct_x4_Bps', 0))} MB/s -> limit {fmt_rate(limit)} MB/s", flush=True)

    check = locked(["--step", "check", "--file", str(path)], args.timeout)
    results["check"] = check
    for mode in ("cold", "page"):
        c = check.get(mode)
        if c:
            print(f"scale check, {mode} miss of {c['expert_bytes'] / 1e6:.1f} MB: "
                  f"{c['check_s'] * 1e3:.2f} ms check; miss {c['miss_s_check'] * 1e3:.1f} ms with, "
                  f"{c['miss_s_nocheck'] * 1e3:.1f} ms without", flush=True)

    rows: list[dict[str, Any]] = []
    k3 = {}
    modes = [m for m in args.modes.split(",") if m]
    for mode in ["default", *[m for m in modes if m != "default"]]:
        r = locked(["--step", f"k3kit-{mode}", *common, "--cache-mib", str(args.cache_mib), "--trunk",
                    args.trunk, "--dtype", args.dtype, "--repeats", str(args.repeats), "--prefetch",
                    args.prefetch], args.timeout)
        k3[mode] = r
        if not r.get("runs"):
            rows.append({"name": f"k3kit {mode}", "error": r.get("error")})
            continue
        for pf in dict.fromkeys(x["prefetch"] for x in r["runs"]):
            rs = [x for x in r["runs"] if x["prefetch"] == pf]
            tps = [x["decode_tok_s"] for x in rs]
            name = (f"k3kit {mode} prefetch {pf}" if mode != "default"
                    else f"k3kit default ({r['expert_io'].get('mode')}, {r['cache_mib']:.0f} MiB)")
            rows.append({"name": name, "peak_rss": r["peak_rss"],
                         "ledger_vs_proc": sum(x["proc_read_bytes"] for x in rs)
                         / max(sum(x["ledger_io_bytes"] for x in rs), 1),
                         "tok_s": statistics.median(tps), "tok_s_all": tps,
                         "payload": statistics.median(x["payload_per_token"] for x in rs),
                         "disk_per_token": statistics.median(x["decode_disk_per_token"] for x in rs),
                         "disk_Bps": statistics.median(x["decode_disk_Bps"] for x in rs),
                         "frac": statistics.median(x["decode_disk_Bps"] / x["seq_Bps"] for x in rs),
                         "payload_frac": statistics.median(x["payload_per_token"] * x["decode_tok_s"]
                                                           / x["seq_Bps"] for x in rs),
                         "seq_Bps": statistics.median(x["seq_Bps"] for x in rs),
                         "tokens": rs[0]["tokens"], "prefetched": rs[0]["prefetched"],
                         "prefetch_used": sum(x["prefetch_used"] for x in rs),
                         "prefetched_all": sum(x["prefetched"] for x in rs), "wait_s": rs[0]["wait_s"],
                         "guesses": sum(x.get("guesses", 0) for x in rs),
                         "guesses_right": sum(x.get("guesses_right", 0) for x in rs)})
    results["k3kit"] = k3

    prompt_ids = next((k["prompt_ids"] for k in k3.values() if k.get("prompt_ids")), [1, 2, 3, 4])
    llama = {}
    for variant in llama_variants:
        r = locked(["--step", f"llama-{variant}", *common, "--anon-limit-gib", str(args.anon_limit_gib),
                    "--prompt-ids", json.dumps(prompt_ids)], args.timeout)
        llama[variant] = r
        row = {"name": f"llama.cpp {variant}", "peak_rss": r.get("peak_rss", 0)}
        if r.get("ok"):
            row |= {"tok_s": r["decode_tok_s"], "disk_per_token": r["decode_disk_per_token"],
                    "disk_Bps": r["decode_disk_Bps"], "tokens": r["tokens"], "seq_Bps": r["seq_Bps"],
                    "frac": r["decode_disk_Bps"] / r["seq_Bps"]}
        else:
            row["error"] = r.get("error")
        rows.append(row)
    results["llama"] = llama
    results["rows"] = rows

    print(f"\n{'run':<34} {'peak RSS GiB':>12} {'tok/s':>7} {'payload MB/tok':>14} {'disk MB/tok':>11} "
          f"{'disk MB/s':>9} {'limit MB/s':>10} {'of limit':>8} {'payload MB/s':>11} {'of limit':>8}")
    for row in rows:
        if "tok_s" not in row:
            print(f"{row['name']:<34} {row.get('peak_rss', 0) / GIB:12.2f}  FAILED: {row.get('error')}")
            continue
        payload = f"{row['payload'] / 1e6:14.0f}" if "payload" in row else f"{'-':>14}"
        rate = f"{row['payload'] * row['tok_s'] / 1e6:11.0f}" if "payload" in row else f"{'-':>11}"
        pfrac = f"{row['payload_frac']:8.2f}" if "payload" in row else f"{'-':>8}"
        hits = (f"  prefetch reads used {row['prefetch_used']}/{row['prefetched_all']}, guesses right "
                f"{row['guesses_right']}/{row['guesses']}" if row.get("guesses") else "")
        if "ledger_vs_proc" in row:     # /proc/self/io read_bytes over the store's io_bytes, decode phase
            hits += f"  process reads / ledger {row['ledger_vs_proc']:.3f}"
        print(f"{row['name']:<34} {row['peak_rss'] / GIB:12.2f} {row['tok_s']:7.3f} {payload} "
              f"{row['disk_per_token'] / 1e6:11.0f} {fmt_rate(row['disk_Bps']):>9} "
              f"{fmt_rate(row['seq_Bps']):>10} {row['frac']:8.2f} {rate} {pfrac}{hits}")
    ok_llama = [r for r in rows if r["name"].startswith("llama") and "tok_s" in r]
    ours = [r for r in rows if r["name"].startswith("k3kit") and "tok_s" in r]
    for peer in ok_llama:
        for r in ours:
            same = sum(a == b for a, b in zip(r["tokens"], peer["tokens"], strict=False))
            rss = r["peak_rss"] / max(peer["peak_rss"], 1)
            print(f"ratio {r['name']} / {peer['name']}: tok/s {r['tok_s'] / peer['tok_s']:.2f}x, "
                  f"peak RSS {rss:.2f}x, same tokens {same}/{len(peer['tokens'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.delete and not args.file:
        path.unlink()


if __name__ == "__main__":
    main()
