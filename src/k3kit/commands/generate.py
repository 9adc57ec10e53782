"""`k3kit generate`: run a kimi-k3 GGUF with lazily loaded experts and print the continuation."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from k3kit.errors import K3Error

if TYPE_CHECKING:
    from k3kit.plan.expert_io import ExpertIO

NAME = "generate"
HELP = "generate text with a GGUF model: trunk in memory, routed experts streamed from the file"

SHIPPED_REL = Path("assets") / "mini-k3" / "mini-k3.gguf"
EXPERT_IO = ("auto", "page", "direct")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="GGUF file or any shard (default: the shipped mini K3)")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text")
    src.add_argument("--prompt-file", metavar="F", help="read the prompt from a UTF-8 file")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens to generate (128)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K best tokens (0 = off)")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (reproducible)")
    add_model_arguments(parser)
    parser.add_argument("--prefill-chunk", type=int, default=256, metavar="N", help="prompt rows per pass")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as one user turn with the file's chat template "
                        "(the Kimi format when the file has none)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the warm-up run (a model whose experts fit the cache reads them all and "
                        "decodes a few throwaway tokens before the prompt, as llama.cpp warms up)")
    parser.add_argument("--stats", action="store_true", help="print speed, cache and memory figures")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_draft_arguments(parser)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """How a model is placed and run: the flags `generate`, `serve` and `perplexity` share."""
    parser.add_argument("--expert-cache-mib", type=float, default=None, metavar="M",
                        help="LRU budget for routed experts, MiB of what is cached (default: sized from "
                        "the RAM left after the trunk, see --expert-io; 256 on a GPU)")
    parser.add_argument("--expert-io", default="auto", choices=EXPERT_IO,
                        help="how routed experts are read: page (through the page cache, mapped), direct "
                        "(O_DIRECT into k3kit's expert cache; pread + fadvise where the filesystem "
                        "refuses it, so payload = storage traffic), or auto: direct when the experts do "
                        "not fit the RAM left after the trunk and the cache, else page (auto)")
    parser.add_argument("--cold", dest="expert_io", action="store_const", const="direct",
                        help="the same as --expert-io direct")
    parser.add_argument("--expert-kernel", default="auto", choices=("auto", "native", "triton", "torch"),
                        help="native: cache experts as their quantized bytes and multiply them "
                        "directly (CPU); triton: cache them as their bytes on the GPU and multiply them "
                        "with the Triton kernels, a layer's routed rows in one launch per projection; "
                        "torch: dequantize each miss to the compute dtype; auto: native on the CPU when "
                        "built, triton on CUDA when installed (auto)")
    parser.add_argument("--expert-prefetch", default="auto", choices=("auto", "on", "off"),
                        help="each MoE layer guesses the next layer's experts and starts reading them "
                        "early; auto: on when the expert cache cannot hold every expert (auto)")
    parser.add_argument("--device", default="cpu", metavar="D",
                        help="cpu, cuda, cuda:N, or a comma list (cuda:0,cuda:1) to split layers")
    parser.add_argument("--cpu-moe", dest="cpu_moe", action="store_const", const=-1, default=0,
                        help="with a GPU --device: keep every routed expert in RAM, multiplied on the CPU "
                        "by the native kernels through the expert store, and the rest of the model on the "
                        "GPU (llama.cpp's --cpu-moe); without a GPU every expert is there already")
    parser.add_argument("--n-cpu-moe", dest="cpu_moe", type=int, metavar="N",
                        help="as --cpu-moe for the routed experts of the layers numbered below N; the "
                        "other layers' experts go to the GPU (llama.cpp's --n-cpu-moe)")
    parser.add_argument("--dtype", default="f32", choices=("f32", "bf16", "f16"),
                        help="compute dtype (f32): activations, and what quantized weights are "
                        "dequantized to where a product needs them whole (prefill GEMM, CUDA, "
                        "--trunk float, --expert-kernel torch)")
    parser.add_argument("--trunk", default="quantized", choices=("quantized", "float"),
                        help="quantized: keep the trunk matrices as the file's bytes (mapped) and "
                        "multiply them from those (quantized); float: dequantize them to --dtype at load")
    parser.add_argument("--arith", default="auto", choices=("auto", "float", "ggml"),
                        help="products on quantized bytes: ggml (activations rounded to int8 blocks as "
                        "llama.cpp does: its numbers, and faster on the CPU), float (float32 "
                        "activations; exact to float32 rounding), or auto: ggml on the CPU when the "
                        "native extension is built, float on CUDA or without it; --stats/--json "
                        "name the one that ran per type (auto)")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="torch CPU threads (0 = default)")
    parser.add_argument("--pin-experts", metavar="PROFILE.json", default=None,
                        help="keep the experts a routing profile (`k3kit bench --profile-experts`) picks "
                        "most often resident, within --expert-cache-mib")


def add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding: a DFlash/DSpark draft proposes, the model verifies."""
    g = parser.add_argument_group("speculative decoding (DSpark / DFlash draft)")
    g.add_argument("--draft", metavar="DRAFT", help="draft GGUF (dflash architecture, or a legacy "
                   "dflash-draft file as is), or 'default' for the shipped mini drafter "
                   "(`k3kit mini path --draft`)")
    g.add_argument("--block-size", type=int, default=None, metavar="K",
                   help="draft block (proposals per pass); default: the draft's trained block")
    g.add_argument("--verify-budget", default="auto", metavar="auto|N",
                   help="rows verified per pass: 'auto' picks the width with the best expected tokens "
                   "per second of verify cost (experts not cached + compute); N fixes it (default auto)")
    g.add_argument("--confidence-threshold", type=float, default=0.0, metavar="C",
                   help="drop proposals from the first one whose confidence is below C (0 = off)")
    g.add_argument("--feature-ring", default="f16", choices=("f32", "f16", "bf16", "q8"),
                   help="storage of the target features the draft reads (f16)")
    g.add_argument("--draft-device", default=None, metavar="D",
                   help="run the draft on D (cpu, cuda, cuda:N) apart from the target; its features "
                   "cross devices each pass (default: the target's first device)")


def default_model() -> Path:
    """The shipped mini model (`k3kit mini path`); a clear error until it is built."""
    try:
        from k3kit.mini import paths
        path = Path(paths.shipped_gguf())
    except (ImportError, AttributeError):
        import k3kit.mini as mini
        path = Path(mini.__file__).parent / SHIPPED_REL
    if not path.exists():
        raise K3Error(f"{path}: no MODEL given and the shipped mini model is not built yet; "
                      "pass a GGUF path")
    return path


def pin_profile(model: Path, args: argparse.Namespace):
    """--pin-experts: the profile's per-layer probabilities, checked against MODEL's headers
    (before loading: a profile for another model is a one-line error that costs nothing)."""
    if getattr(args, "pin_experts", None) is None:
        return None
    from k3kit.plan.facts import open_model, read_facts
    from k3kit.plan.profile import load_profile
    with open_model(model) as m:
        return load_profile(args.pin_experts, read_facts(m)).probs


def pin_experts(target, probs, args: argparse.Namespace) -> None:
    """Pin the profile's hottest experts in the loaded target's expert store (frequency placement)."""
    if probs is None:
        return
    from k3kit.runtime.experts.pinning import pin
    store = getattr(target.model, "store", None)
    if store is None:
        raise K3Error(f"{target.path}: --pin-experts: this model has no expert store")
    pin(store, probs, str(args.pin_experts))


def expert_io(path: Path, args: argparse.Namespace, reserved: int = 0) -> ExpertIO:
    """--expert-io and --expert-cache-mib resolved for MODEL on this machine (k3kit.plan.expert_io):
    the read path and the cache budget a load uses, leaving `reserved` bytes to the process's
    other caches (a server's prompt cache). Headers only, before anything loads."""
    from k3kit.plan.expert_io import for_model
    return for_model(path, getattr(args, "expert_io", "auto"), args.expert_cache_mib,
                     device=getattr(args, "device", "cpu"), cpu_moe=getattr(args, "cpu_moe", 0),
                     reserved=reserved)


def apply_threads(args: argparse.Namespace) -> int:
    """torch's CPU threads for a command: `--threads N`; where it is 0 (the default) and
    OMP_NUM_THREADS is unset, torch's default (one per core) but no more than the control group's
    CPU quota allows (a container's `--cpus`, k3kit.plan.cgroup.cpu_cores): past it, every parallel
    region waits at its barrier for threads the quota has stopped. Returns the count set, 0 when
    torch's default was kept."""
    import os

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
        return int(args.threads)
    if os.environ.get("OMP_NUM_THREADS"):
        return 0
    from k3kit.plan.cgroup import cpu_cores
    cores = cpu_cores()
    if cores is None or torch.get_num_threads() <= cores:
        return 0
    torch.set_num_threads(cores)
    return cores


def check_cache_mib(args: argparse.Namespace) -> None:
    if args.expert_cache_mib is not None and not args.expert_cache_mib >= 0:
        raise K3Error(f"--expert-cache-mib {args.expert_cache_mib}: must be >= 0")


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.prompt_file)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise K3Error(f"{path}: prompt file is not UTF-8") from None


def check_args(args: argparse.Namespace) -> None:
    if args.max_tokens < 0:
        raise K3Error(f"--max-tokens {args.max_tokens}: must be >= 0")
    check_cache_mib(args)
    if args.threads < 0:
        raise K3Error(f"--threads {args.threads}: must be >= 0")
    if args.prefill_chunk < 1:
        raise K3Error(f"--prefill-chunk {args.prefill_chunk}: must be >= 1")


def check_draft_args(args: argparse.Namespace) -> None:
    if args.draft is None:
        for flag, value, default in (("--block-size", args.block_size, None),
                                     ("--verify-budget", args.verify_budget, "auto"),
                                     ("--confidence-threshold", args.confidence_threshold, 0.0),
                                     ("--draft-device", args.draft_device, None)):
            if value != default:
                raise K3Error(f"{flag} needs --draft")
        return
    if args.block_size is not None and args.block_size < 1:
        raise K3Error(f"--block-size {args.block_size}: must be >= 1")
    if not 0.0 <= args.confidence_threshold <= 1.0:
        raise K3Error(f"--confidence-threshold {args.confidence_threshold}: must be in [0, 1]")


def draft_path(args: argparse.Namespace) -> Path | None:
    """The --draft GGUF: a path, 'default' for the shipped mini drafter, or None."""
    if args.draft is None:
        return None
    if args.draft == "default":
        from k3kit.mini import paths
        return paths.shipped_draft()
    return Path(args.draft)


def decode_step(args: argparse.Namespace, draft, stop_ids):
    """The decode strategy: None = plain autoregressive; with a draft, a SpeculativeDecoder."""
    if draft is None:
        return None
    from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder, parse_budget

    # draft_cost None: the decoder adds the draft step's measured seconds (the target's cost() is seconds)
    schedule = ScheduleConfig(budget=parse_budget(args.verify_budget), threshold=args.confidence_threshold,
                              draft_cost=None)

    def build(model, sampler):
        return SpeculativeDecoder(model, draft, sampler.sampling, sampler.generator, schedule=schedule,
                                  ring_storage=args.feature_ring, stop_ids=stop_ids, history=sampler.history,
                                  constraint=sampler.constraint)
    return build


def run(args: argparse.Namespace) -> int:
    import torch

    from k3kit.adapters.session import open_session
    from k3kit.runtime.engine import WARMUP_ROWS, WARMUP_TOKENS, generate, warm_up
    from k3kit.runtime.loader import DTYPES, LoadOptions
    from k3kit.runtime.sampling import make_sampling

    check_args(args)
    check_draft_args(args)
    sampling = make_sampling(args.temperature, args.top_p, args.top_k, args.seed)
    text = read_prompt(args)
    path = Path(args.model) if args.model else default_model()
    io = expert_io(path, args)
    if args.stats or io.announce:
        print(f"k3kit: {io.line()}", file=sys.stderr)
    options = LoadOptions(device=args.device, dtype=DTYPES[args.dtype],
                          expert_cache_mib=io.cache_mib, cold=io.cold,
                          expert_kernel=args.expert_kernel, trunk=args.trunk,
                          expert_prefetch=args.expert_prefetch, arith=args.arith, cpu_moe=args.cpu_moe)
    apply_threads(args)
    pins = pin_profile(path, args)
    session = open_session(path, options, draft=draft_path(args), block_size=args.block_size,
                           draft_device=args.draft_device)
    try:
        pin_experts(session.target, pins, args)
        codec = session.codec
        if args.chat:
            text = codec.chat_prompt(text)
        ids = codec.encode(text)
        if not ids:
            raise K3Error(f"{path}: the prompt encodes to no tokens")
        stream = codec.streamer()

        def on_token(t: int) -> None:
            if not args.json:
                sys.stdout.write(stream.push(t))
                sys.stdout.flush()

        stop_ids = codec.stop_ids()
        with torch.no_grad():     # not set_grad_enabled(False): `main` may run inside another program
            t0 = time.perf_counter()
            step = decode_step(args, session.draft_model, stop_ids)
            warmed = args.warmup and warm_up(session.model, step=step, token=ids[0])
            warm_s = time.perf_counter() - t0
            result = generate(session.model, ids, max_tokens=args.max_tokens, sampling=sampling,
                              stop_ids=stop_ids, prefill_chunk=args.prefill_chunk, on_token=on_token,
                              step=step,
                              detokenize=lambda t: codec.decode_bytes(t).decode("utf-8", errors="replace"))
        session.target.check()
        memory, kernel = session.target.memory(), session.target.expert_kernel
        kernels = session.target.kernels
        store = getattr(session.target.model, "store", None)
        direct = bool(store is not None and store.direct_io)
    finally:
        session.close()

    if args.json:
        d = result.to_dict()
        keep = ("prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "expert_cache_hit_rate",
                "payload_bytes", "payload_bytes_per_token", "peak_rss_bytes")
        d["stats"] = {k: d["stats"][k] for k in keep} | {
            k: v for k, v in d["stats"].items() if k not in keep} | {
            "expert_kernel": kernel, "trunk": memory.trunk, "trunk_bytes": memory.trunk_bytes,
            "kernels": kernels, "expert_io": io.mode, "direct_io": direct,
            "expert_cache_budget_bytes": io.cache_bytes, "warmup_seconds": warm_s if warmed else None}
        print(json.dumps(d))
        return 0
    sys.stdout.write(stream.flush() + "\n")
    if args.stats:
        s = result.stats
        mib = 1 << 20
        print(f"prompt {s.prompt_tokens} tokens, prefill {s.prefill_tok_s:.2f} tok/s; "
              f"generated {s.generated_tokens} tokens, decode {s.decode_tok_s:.2f} tok/s ({s.stop_reason})",
              file=sys.stderr)
        print(f"experts ({kernel}): cache hit rate {100 * s.expert_cache_hit_rate:.1f}% "
              f"({s.expert_hits} hits, {s.expert_misses} misses); "
              f"payload {s.payload_bytes / mib:.2f} MiB total, "
              f"{s.payload_bytes_per_token / mib:.3f} MiB per decoded token", file=sys.stderr)
        if warmed:
            print(f"warm-up: every expert read into the cache, {WARMUP_ROWS} + {WARMUP_TOKENS} throwaway "
                  f"tokens decoded ({1e3 * warm_s:.0f} ms, before the prompt; --no-warmup skips it)",
                  file=sys.stderr)
        for part, by_type in kernels.items():
            print(f"kernels ({part}): " + "; ".join(f"{t} {k}" for t, k in by_type.items()), file=sys.stderr)
        print(f"memory: peak RSS {s.peak_rss_bytes / mib:.1f} MiB (trunk {memory.trunk_bytes / mib:.1f} MiB "
              f"{memory.trunk}, "
              f"expert cache {memory.expert_cache_bytes / mib:.1f} of {io.cache_mib:g} MiB, {io.mode})",
              file=sys.stderr)
        if s.speculative is not None:
            d = s.speculative
            plain = (f"{d['plain_passes']} passes without a draft (drafting did not pay), "
                     if d['plain_passes'] else "")
            print(f"speculative: {d['target_passes']} target passes, {d['draft_steps']} draft steps, {plain}"
                  f"{d['committed_per_pass']:.2f} tokens committed per pass, "
                  f"{d['verify_rows']} rows verified; "
                  f"accepted proposals per pass {d['acceptance_histogram']}; replay: "
                  f"{d['replay_fast_commits']} fast commits, {d['replay_full_replays']} full replays, "
                  f"{d['replay_failed_fallbacks']} failed fallbacks", file=sys.stderr)
    return 0
