"""The GPU figures in one run: the mini and a K3-geometry slice on CUDA, against the same box's CPU.

    python benchmarks/gpu_check.py [--out DIR] [--quick] [--device cuda] [--sections a,b,...]

Run by `benchmarks/gpu_check.sh` (which sets the environment up from the repository alone) on a
machine with an NVIDIA GPU; every section is bounded in time and a failing section is reported as
such while the others still run. Sections (`--sections`, all by default):

  mini      the shipped mini K3: greedy decode tok/s on the GPU, AR and `--draft default`, tokens
            compared with the CPU's (`--arith float`, the GPU's arithmetic) and DSpark with AR;
            and with `--cpu-moe` (routed experts on the CPU, the rest and the drafter on the GPU);
  profile   `torch.profiler` over 16 decoded mini tokens: the share of the wall time in GPU
            kernels, kernel launches and device-to-host copies per token;
  host      `k3kit bench --host-profile` rows (ops, syncs, host µs per layer per token), when the
            installed k3kit has it;
  slice     a K3-geometry slice (`k3kit synth --geometry k3`, hidden 7168, Q4_K trunk, MXFP4
            experts): decode tok/s with the trunk quantized (the GPU kernels), `--trunk float
            --dtype bf16` and `--cpu-moe`, and the CPU's figure on the same box;
  serve     `k3kit bench --concurrency 1,16` on the mini on the GPU, AR and `--draft default`;
  kernels   `benchmarks/bench_gpu_qmatmul.py` (Triton products vs torch), when present.

Without CUDA every section runs on `--device` (cpu), so the script itself is tested anywhere.
Prints a markdown table at the end and writes `gpu_check.json` and `gpu_check.md` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main():"]


def k3kit(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """`python -m k3kit ARGS` with the environment as it is; raises on a non-zero exit."""
    cmd = [sys.executable, "-m", "k3kit", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(args[:3])}... exit {proc.returncode}: {' | '.join(tail)}")
    return proc


def machine(device: str) -> dict[str, Any]:
    import torch

    from k3kit.bench.run import cpu_info
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "cpu": cpu_info()}
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                 "sms": p.multi_processor_count}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_model(path: Path, device: str, runs: list[tuple[str, bool]], tokens: int, prompt: str,
              draft: Path | None = None, **options: Any) -> dict[str, dict[str, Any]]:
    """One load of `path` on `device`, then each (name, with_draft) run: a warm-up of 8 tokens (CUDA
    context, Triton's compilation) and the measured greedy run. Returns name -> result dict."""
    import torch

    from k3kit.adapters.session import open_session
    from k3kit.commands.generate import decode_step
    from k3kit.runtime.engine import generate as engine_generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling

    session = open_session(path, LoadOptions(device=device, **options), draft=draft)
    out: dict[str, dict[str, Any]] = {}
    try:
        codec = session.codec
        ids = codec.encode(prompt)
        greedy = make_sampling(0.0, 1.0, 0, None)
        flags = argparse.Namespace(verify_budget="auto", confidence_threshold=0.0, feature_ring="f16")
        for name, with_draft in runs:
            step = decode_step(flags, session.draft_model, codec.stop_ids()) if with_draft else None
            with torch.no_grad():
                engine_generate(session.model, ids, max_tokens=8, sampling=greedy, step=step)
                r = engine_generate(session.model, ids, max_tokens=tokens, sampling=greedy,
                                    stop_ids=codec.stop_ids(), step=step)
            out[name] = r.to_dict()
            if torch.cuda.is_available() and device.startswith("cuda"):
                out[name]["vram_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                torch.cuda.reset_peak_memory_stats()
        out["_memory"] = {"trunk": session.target.memory().trunk,
                          "trunk_bytes": session.target.memory().trunk_bytes}
    finally:
        session.close()
    return out


def section_mini(args: argparse.Namespace) -> list[dict[str, Any]]:
    from k3kit.mini import paths
    model, draft = Path(paths.shipped_gguf()), Path(paths.shipped_draft())
    rows = []
    for prompt in PROMPTS[:args.prompts]:
        gpu = run_model(model, args.device, [("ar", False), ("draft", True)], args.tokens, prompt,
                        draft=draft)
        cpu = run_model(model, "cpu", [("ar", False)], args.tokens, prompt, arith="float")
        split = (run_model(model, args.device, [("ar", False), ("draft", True)], args.tokens, prompt,
                           draft=draft, cpu_moe=-1) if args.device.startswith("cuda") else None)
        ar, sd, c = gpu["ar"], gpu["draft"], cpu["ar"]
        rows.append({
            "prompt": prompt.splitlines()[0],
            "ar_tok_s": round(ar["stats"]["decode_tok_s"], 1),
            "draft_tok_s": round(sd["stats"]["decode_tok_s"], 1),
            "draft_over_ar": round(sd["stats"]["decode_tok_s"] / max(ar["stats"]["decode_tok_s"], 1e-9), 2),
            "committed_per_pass": sd["stats"].get("committed_per_pass"),
            "cpu_float_tok_s": round(c["stats"]["decode_tok_s"], 1),
            "draft_equals_ar": sd["token_ids"] == ar["token_ids"],
            "gpu_equals_cpu": ar["token_ids"] == c["token_ids"],
            "first_gpu_cpu_difference": first_difference(ar["token_ids"], c["token_ids"]),
            "tokens": len(ar["token_ids"]),
        })
        if split is not None:          # --cpu-moe: the experts on this box's CPU, the rest on the GPU
            rows[-1] |= {"cpu_moe_ar_tok_s": round(split["ar"]["stats"]["decode_tok_s"], 1),
                         "cpu_moe_draft_tok_s": round(split["draft"]["stats"]["decode_tok_s"], 1),
                         "cpu_moe_draft_equals_ar": split["draft"]["token_ids"] == split["ar"]["token_ids"],
                         "first_cpu_moe_gpu_difference": first_difference(split["ar"]["token_ids"],
                                                                          ar["token_ids"])}
    return rows


def section_profile(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from k3kit.adapters.session import open_session
    from k3kit.mini import paths
    from k3kit.runtime.engine import generate as engine_generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling

    session = open_session(Path(paths.shipped_gguf()), LoadOptions(device=args.device))
    try:
        ids = session.codec.encode(PROMPTS[0])
        greedy = make_sampling(0.0, 1.0, 0, None)
        with torch.no_grad():
            engine_generate(session.model, ids, max_tokens=8, sampling=greedy)       # warm-up
            n = 16
            acts = [ProfilerActivity.CPU]
            if args.device.startswith("cuda"):
                acts.append(ProfilerActivity.CUDA)
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                res = engine_generate(session.model, ids, max_tokens=n, sampling=greedy)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
    finally:
        session.close()
    events = prof.key_averages()
    dev_us = sum(getattr(e, "self_device_time_total", 0.0) or 0.0 for e in events)
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    d2h = sum(e.count for e in events if e.key in ("aten::_local_scalar_dense",))
    copies = sum(e.count for e in events if "Memcpy DtoH" in e.key or "Memcpy D2H" in e.key)
    toks = max(len(res.token_ids), 1)
    return {"tokens": toks, "wall_ms": round(wall * 1e3, 1),
            "kernel_share": round(dev_us / 1e6 / wall, 3) if wall else None,
            "launches_per_token": round(launches / toks, 1), "item_syncs_per_token": round(d2h / toks, 1),
            "dtoh_copies_per_token": round(copies / toks, 1)}


def section_host(args: argparse.Namespace) -> Any:
    help_text = k3kit("bench", "--help").stdout
    if "--host-profile" not in help_text:
        return "k3kit bench has no --host-profile in this tree"
    out = k3kit("bench", "--host-profile", "--device", args.device, "-p", "32", "-n", "16", "-r", "1",
                "-o", "json", "--no-progress", timeout=300)
    return json.loads(out.stdout)


def make_slice(work: Path) -> Path:
    k3kit("synth", "-o", str(work), "--geometry", "k3", "--layers", "4", "--experts", "8",
          "--trunk-type", "Q4_K", "--expert-type", "MXFP4", "--name", "slice", timeout=300)
    files = sorted(work.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"synth wrote no GGUF into {work}")
    return files[0]


def section_slice(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="k3slice-", dir=args.scratch))
    path = make_slice(work)
    size = path.stat().st_size
    rows: list[dict[str, Any]] = [{"run": f"file {size / 1e9:.2f} GB"}]
    runs: list[tuple[str, str, dict[str, Any], dict[str, str]]] = [
        ("quantized trunk", args.device, {}, {}),
        ("quantized trunk, torch dequant", args.device, {}, {"K3KIT_GPU_KERNELS": "torch"}),
        ("float trunk bf16", args.device, {"trunk": "float", "dtype": _bf16()}, {}),
        ("--cpu-moe (experts on the CPU)", args.device, {"cpu_moe": -1}, {}),
        ("CPU, same box", "cpu", {}, {}),
    ]
    base: list[int] | None = None
    try:
        for name, device, options, env in runs:
            if device == "cpu" and not args.slice_cpu:
                continue
            os.environ.update(env)
            try:
                t0 = time.perf_counter()
                r = run_model(path, device, [("ar", False)], args.slice_tokens, "The quick brown fox",
                              expert_cache_mib=8192.0, **options)
                took = time.perf_counter() - t0
            except Exception as e:       # one configuration failing is a figure; the others still run
                rows.append({"run": name, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            finally:
                for k in env:
                    os.environ.pop(k, None)
            s = r["ar"]["stats"]
            base = base if base is not None else r["ar"]["token_ids"]
            rows.append({"run": name, "decode_tok_s": round(s["decode_tok_s"], 2),
                         "prefill_tok_s": round(s["prefill_tok_s"], 1),
                         "process_peak_rss_gib": round(s["peak_rss_bytes"] / 2**30, 2),
                         "vram_peak_gib": r["ar"].get("vram_peak_gib"),
                         "trunk": r["_memory"]["trunk"],
                         "same_tokens_as_first": r["ar"]["token_ids"] == base, "seconds": round(took, 1)})
    finally:
        for f in work.glob("*"):
            f.unlink()
        work.rmdir()
    return rows


def _bf16() -> Any:
    import torch
    return torch.bfloat16


def section_serve(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for label, extra in (("AR", []), ("DSpark", ["--draft", "default"])):
        out = k3kit("bench", "--device", args.device, "--concurrency", "1,16", "-p", "64", "-n", "32",
                    "-r", "1", "-o", "json", "--no-progress", *extra, timeout=400)
        rows.append({"mode": label, "rows": json.loads(out.stdout)})
    return rows


def section_kernels(args: argparse.Namespace) -> Any:
    script = ROOT / "benchmarks" / "bench_gpu_qmatmul.py"
    if not script.exists():
        return "benchmarks/bench_gpu_qmatmul.py is not in this tree"
    proc = subprocess.run([sys.executable, str(script), *args.kernel_args.split()], capture_output=True,
                          text=True, timeout=240, check=False)
    return {"exit": proc.returncode, "output": proc.stdout[-6000:] + proc.stderr[-2000:]}


SECTIONS: dict[str, Callable[[argparse.Namespace], Any]] = {   # in order of what matters most
    "mini": section_mini, "profile": section_profile, "slice": section_slice, "kernels": section_kernels,
    "host": section_host, "serve": section_serve,
}


def to_markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpu_check: {report['machine'].get('gpu', 'no GPU')} ({report['date']})", "",
             "```", json.dumps(report["machine"]), "```", ""]
    for name, value in report["sections"].items():
        lines.append(f"## {name} ({report['seconds'].get(name, 0):.0f} s)")
        rows = value if isinstance(value, list) else [value]
        dict_rows = [r for r in rows if isinstance(r, dict)]
        if dict_rows and all("rows" not in r and "output" not in r for r in dict_rows):
            keys = list(dict.fromkeys(k for r in dict_rows for k in r))
            lines.append("| " + " | ".join(keys) + " |")
            lines.append("|" + "---|" * len(keys))
            for r in dict_rows:
                lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
        else:
            lines += ["```", json.dumps(value, indent=1)[:8000], "```"]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "out/gpu_check")
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--tokens", type=int, default=64, help="mini tokens per run (64)")
    ap.add_argument("--slice-tokens", type=int, default=16, help="slice tokens per run (16)")
    ap.add_argument("--scratch", default=None, help="where the slice is written (a temp dir)")
    ap.add_argument("--kernel-args", default="", help="arguments for bench_gpu_qmatmul.py")
    ap.add_argument("--prompts", type=int, default=1, help="mini prompts (1)")
    ap.add_argument("--slice-cpu", action="store_true", help="also decode the slice on the CPU")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip the sections that would start after this many seconds (420)")
    args = ap.parse_args()
    from k3kit.cli import openmp_waits_passively
    openmp_waits_passively()           # as `k3kit` does, before torch loads libgomp
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "device": args.device,
                              "machine": machine(args.device), "sections": {}, "seconds": {}}
    print(json.dumps(report["machine"]), flush=True)
    start = time.perf_counter()
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        if t0 - start > args.budget_s:
            report["sections"][name] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
            continue
        try:
            value = SECTIONS[name](args)
        except Exception as e:          # a failing section is a figure too; the others still run
            value = {"error": f"{type(e).__name__}: {e}"[:2000]}
        report["sections"][name] = value
        report["seconds"][name] = time.perf_counter() - t0
        print(f"== {name} ({report['seconds'][name]:.0f} s)\n{json.dumps(value)[:4000]}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    md = to_markdown(report)
    (out / "gpu_check.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
