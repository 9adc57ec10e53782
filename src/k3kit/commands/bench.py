"""`k3kit bench`: measure a model on this machine in llama-bench's terms (k3kit.bench)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3kit.errors import K3Error
from k3kit.plan.expert_io import ExpertIO

NAME = "bench"
HELP = "measure prompt/decode tok/s, expert payload and acceptance (llama-bench's pp/tg rows)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3kit.commands.generate import add_draft_arguments, add_model_arguments

    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="GGUF file or any shard (default: the shipped mini K3)")
    parser.add_argument("-p", "--n-prompt", type=int, default=512, metavar="N",
                        help="prompt tokens of each pp test (512); 0: no pp row, prompts at their own length")
    parser.add_argument("-n", "--n-gen", type=int, default=128, metavar="N",
                        help="tokens decoded after the prompt in each tg test (128; 0: no tg row)")
    parser.add_argument("-r", "--repetitions", type=int, default=5, metavar="N",
                        help="repetitions of each test, one workload prompt each (5)")
    parser.add_argument("--workload", default="stdlib", metavar="NAME|FILE",
                        help="stdlib (held-out code, default), humaneval, gsm8k, chat, "
                        "or a JSONL file of {\"prompt\": ...} lines")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="run each value (repeat for a cartesian product); keys: block_size, "
                        "verify_budget, confidence_threshold, expert_cache_mib, expert_kernel, threads")
    parser.add_argument("--concurrency", metavar="N1,N2", default=None,
                        help="also start `k3kit serve` and drive N concurrent API clients "
                        "(aggregate tok/s, TTFT)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="add llama.cpp's AR rows on the same GGUF and prompts (llama-cpp-python)")
    parser.add_argument("--profile-experts", metavar="OUT.json", default=None,
                        help="record how often each layer routes to each expert (a `plan --profile` / "
                        "`--pin-experts` file)")
    parser.add_argument("-o", "--output", default="md", choices=("md", "json", "jsonl", "csv"),
                        help="what to print (md)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="write results.json, report.md and PNG plots here")
    parser.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                        help="prompt rows per pass (llama-bench's n_batch; 512)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--host-profile", action="store_true",
                        help="instead of the pp/tg rows: per phase (AR decode step; with --draft also the "
                        "DSpark draft step and the verify pass) the aten ops and host microseconds per "
                        "layer and the host syncs per call. Host time = the step's wall time minus the "
                        "time inside matrix products (the native kernels' calls and aten mm/bmm/mv...): "
                        "Python, the dispatcher and the small elementwise ops. Syncs = .item()/bool()/"
                        "int() of a tensor (aten._local_scalar_dense) and .tolist() calls (free on the "
                        "CPU, each a stall on a GPU); d2h = device->host copies. -n tokens are timed, "
                        "then as many counted (under a TorchDispatchMode); the prompt is the first "
                        "workload prompt cut to -p tokens")
    add_model_arguments(parser)
    add_draft_arguments(parser)


def stdlib_docs() -> list[str]:
    """The held-out stdlib files the mini model never trained on (k3kit.mini.corpus)."""
    from k3kit.mini.corpus import build_corpus
    return build_corpus().heldout_docs


def serve_args(args: argparse.Namespace) -> list[str]:
    """The model and draft flags for the `k3kit serve` child of --concurrency."""
    out = ["--expert-kernel", args.expert_kernel,
           "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    if args.expert_cache_mib is not None:
        out = ["--expert-cache-mib", str(args.expert_cache_mib), *out]
    out += ["--expert-io", getattr(args, "expert_io", "auto")]
    if getattr(args, "trunk", None):
        out += ["--trunk", args.trunk]
    out += ["--expert-prefetch", getattr(args, "expert_prefetch", "auto"), "--arith", args.arith]
    if getattr(args, "cpu_moe", 0):
        out += ["--n-cpu-moe", str(args.cpu_moe)]
    if getattr(args, "pin_experts", None):
        out += ["--pin-experts", args.pin_experts]
    if args.draft is not None:
        out += ["--draft", args.draft, "--verify-budget", args.verify_budget,
                "--confidence-threshold", str(args.confidence_threshold), "--feature-ring", args.feature_ring]
        if getattr(args, "draft_device", None):
            out += ["--draft-device", args.draft_device]
        if args.block_size is not None:
            out += ["--block-size", str(args.block_size)]
    return out


def run(args: argparse.Namespace) -> int:
    from k3kit.bench.config import Config, parse_concurrency
    from k3kit.bench.report import render, write_outputs
    from k3kit.bench.run import BenchOptions, run_bench
    from k3kit.commands.generate import apply_threads, check_draft_args, default_model, draft_path, expert_io

    check_draft_args(args)
    if args.expert_cache_mib is not None and not args.expert_cache_mib >= 0:
        raise K3Error(f"--expert-cache-mib {args.expert_cache_mib}: must be >= 0")
    if args.threads < 0:
        raise K3Error(f"--threads {args.threads}: must be >= 0")
    apply_threads(args)          # what a run with no --threads takes as its default count
    model = Path(args.model) if args.model else default_model()
    draft = draft_path(args)
    from k3kit.runtime.speculative import parse_budget
    parse_budget(args.verify_budget)
    io = expert_io(model, args)
    if io.announce:
        print(f"k3kit: {io.line()}", file=sys.stderr)
    base = Config(expert_cache_mib=io.cache_mib, expert_kernel=args.expert_kernel,
                  threads=args.threads, block_size=args.block_size, verify_budget=args.verify_budget,
                  confidence_threshold=args.confidence_threshold)
    if args.host_profile:
        return run_host_profile(args, model, draft, io)
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise K3Error(f"{out_dir}: --out must be a directory")
    opts = BenchOptions(
        model=model, base=base, draft=draft, n_prompt=args.n_prompt, n_gen=args.n_gen, reps=args.repetitions,
        workload=args.workload, sweeps=args.sweep, concurrency=parse_concurrency(args.concurrency),
        llama_cpp=args.llama_cpp, profile_out=Path(args.profile_experts) if args.profile_experts else None,
        pin_profile=Path(args.pin_experts) if getattr(args, "pin_experts", None) else None,
        device=args.device, dtype_name=args.dtype, trunk=getattr(args, "trunk", None),
        expert_prefetch=getattr(args, "expert_prefetch", "auto"), arith=args.arith, cold=io.cold,
        cpu_moe=args.cpu_moe,
        prefill_chunk=args.prefill_chunk, feature_ring=args.feature_ring,
        draft_device=getattr(args, "draft_device", None), serve_args=serve_args(args),
        stdlib_docs=stdlib_docs, show_progress=not args.no_progress)
    result = run_bench(opts, command=["k3kit", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else [])
    if out_dir is not None:
        written = write_outputs(result, out_dir)
        print(f"k3kit: wrote {', '.join(p.name for p in written)} to {out_dir}", file=sys.stderr)
    sys.stdout.write(render(result, args.output))
    return 0


def run_host_profile(args: argparse.Namespace, model: Path, draft: Path | None, io: ExpertIO) -> int:
    """`--host-profile`: k3kit.bench.host's phases for this model (and draft), printed."""
    import torch

    from k3kit.adapters.session import open_session
    from k3kit.bench import workloads
    from k3kit.bench.host import host_profile, render
    from k3kit.runtime.loader import DTYPES, LoadOptions

    if args.n_gen < 1:
        raise K3Error(f"-n {args.n_gen}: --host-profile needs at least one decoded token")
    options = LoadOptions(device=args.device, dtype=DTYPES[args.dtype],
                          expert_cache_mib=io.cache_mib, cold=io.cold, expert_kernel=args.expert_kernel,
                          trunk=args.trunk, expert_prefetch=args.expert_prefetch, arith=args.arith,
                          cpu_moe=args.cpu_moe)
    with open_session(model, options, draft=draft, block_size=args.block_size,
                      draft_device=getattr(args, "draft_device", None)) as session:
        w = workloads.resolve(args.workload, stdlib_docs)
        ids = workloads.fit(session.codec, w, args.n_prompt, 1, max_tokens=512)[0]
        with torch.no_grad():
            phases, _ = host_profile(session, ids, args.n_gen)
    out = "json" if args.output in ("json", "jsonl") else "md"
    sys.stdout.write(render(phases, out if args.output != "jsonl" else "jsonl"))
    return 0
