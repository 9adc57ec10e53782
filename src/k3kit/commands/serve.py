"""`k3kit serve`: an OpenAI-compatible HTTP server over a kimi-k3 GGUF (k3kit.serve)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from k3kit.errors import K3Error

if TYPE_CHECKING:
    from k3kit.plan.expert_io import ExpertIO

NAME = "serve"
HELP = "serve a GGUF model over an OpenAI-compatible HTTP API (needs the `serve` extra)"

API_KEY_ENV = "K3KIT_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3kit.commands.generate import add_draft_arguments, add_model_arguments

    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="GGUF file or any shard (default: the shipped mini K3)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (8080; 0 = any free port)")
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV}, else none)")
    parser.add_argument("--max-batch", type=int, default=256, metavar="N",
                        help="rows per target pass (256); prompts are prefilled in chunks of N rows. "
                        "With --draft the verify blocks of the speculating sequences share the pass "
                        "with everyone's rows, their widths picked by the cost model")
    parser.add_argument("--max-sequences", type=int, default=64, metavar="N",
                        help="sequences holding state at once (64); more wait in the queue. Each holds "
                        "its own state: on the full K3 about 180 MB of KDA recurrent state plus its MLA "
                        "latents, which grow with its length, and with --draft its feature ring")
    parser.add_argument("--max-queue", type=int, default=64, metavar="N",
                        help="requests that may wait for the model; one more is answered 429 (64)")
    parser.add_argument("--ctx", type=int, default=None, metavar="N",
                        help="context per sequence, prompt + completion (default: the model's)")
    parser.add_argument("--max-body-mib", type=float, default=8.0, metavar="M",
                        help="largest request body, MiB (8); larger is answered 413")
    parser.add_argument("--prompt-cache-mib", type=float, default=None, metavar="M",
                        help="RAM for the prompt cache: saved states of earlier requests, reused by "
                             "longest common prefix (default: a quarter of free RAM, at most 8 GiB; 0 = off)")
    parser.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                        help="also keep prompt-cache entries in DIR: evicted ones and, at shutdown, all; "
                             "found again after a restart")
    parser.add_argument("--prompt-cache-disk-mib", type=float, default=16384.0, metavar="M",
                        help="bytes --prompt-cache-dir may hold, MiB (16384; 0 = no limit)")
    parser.add_argument("--prompt-cache-interval", type=int, default=None, metavar="N",
                        help="tokens between saved recurrent states inside a prompt (default: from "
                             "the state size; the ends of prompts and of requests are always saved)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                        help="on SIGTERM/SIGINT, seconds the running requests get to finish (30) while "
                        "new ones are answered 503; then streams end with an error event and [DONE], "
                        "the rest with a 503, and the server exits (0). A second signal: no wait")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the warm-up pass at start (a few rows of one token, before /health "
                             "says ready) that keeps a fresh process's one-time costs off the first request")
    add_model_arguments(parser)
    add_draft_arguments(parser)


def check_args(args: argparse.Namespace) -> None:
    for flag, value, low in (("--port", args.port, 0), ("--max-batch", args.max_batch, 1),
                             ("--max-sequences", args.max_sequences, 1),
                             ("--max-queue", args.max_queue, 0), ("--threads", args.threads, 0)):
        if value < low:
            raise K3Error(f"{flag} {value}: must be >= {low}")
    if args.port > 65535:
        raise K3Error(f"--port {args.port}: must be <= 65535")
    if args.ctx is not None and args.ctx < 1:
        raise K3Error(f"--ctx {args.ctx}: must be >= 1")
    if not args.max_body_mib > 0:
        raise K3Error(f"--max-body-mib {args.max_body_mib}: must be > 0")
    if args.prompt_cache_mib is not None and not args.prompt_cache_mib >= 0:
        raise K3Error(f"--prompt-cache-mib {args.prompt_cache_mib}: must be >= 0")
    if not args.prompt_cache_disk_mib >= 0:
        raise K3Error(f"--prompt-cache-disk-mib {args.prompt_cache_disk_mib}: must be >= 0")
    if args.prompt_cache_interval is not None and args.prompt_cache_interval < 1:
        raise K3Error(f"--prompt-cache-interval {args.prompt_cache_interval}: must be >= 1")
    if args.prompt_cache_dir is not None:
        d = Path(args.prompt_cache_dir)
        if d.exists() and not d.is_dir():
            raise K3Error(f"--prompt-cache-dir {d}: not a directory")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise K3Error(f"--shutdown-timeout {args.shutdown_timeout}: must be >= 0 seconds")
    if args.expert_cache_mib is not None and not args.expert_cache_mib >= 0:
        raise K3Error(f"--expert-cache-mib {args.expert_cache_mib}: must be >= 0")


def prompt_cache_mib(args: argparse.Namespace) -> float:
    """--prompt-cache-mib, or the default: a quarter of the RAM free now, at most 8 GiB."""
    if args.prompt_cache_mib is not None:
        return float(args.prompt_cache_mib)
    from k3kit.plan.expert_io import ram_available
    from k3kit.serve.prompt_cache import default_budget
    return default_budget(ram_available()) / (1 << 20)


def memory_budgets(path: Path, args: argparse.Namespace) -> tuple[float, ExpertIO]:
    """(the prompt cache's MiB, the expert I/O and cache) for serving MODEL: the prompt cache's
    RAM is set aside before the expert cache is sized from what is left. Both fill over the
    server's life; sized from the same free RAM, together they would outgrow it (in a container,
    past its limit, where the OOM killer ends the server)."""
    from k3kit.commands.generate import expert_io
    prompt_mib = prompt_cache_mib(args)
    return prompt_mib, expert_io(path, args, reserved=int(prompt_mib * (1 << 20)))


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise K3Error(f"k3kit serve needs the serve extra (pip install 'k3kit[serve]'): "
                      f"{e.name} is missing") from None
    from k3kit.kernels.qmatmul import keep_freed_heap

    keep_freed_heap()        # every pass's transient tensors reuse heap pages (see engine.generate)
    from k3kit.adapters.session import open_session
    from k3kit.commands.generate import (
        apply_threads,
        check_draft_args,
        decode_step,
        default_model,
        draft_path,
        pin_experts,
        pin_profile,
    )
    from k3kit.runtime.loader import DTYPES, LoadOptions
    from k3kit.serve.server import ServeConfig, serve

    check_args(args)
    check_draft_args(args)
    path = Path(args.model) if args.model else default_model()
    draft = draft_path(args)
    prompt_mib, io = memory_budgets(path, args)
    logging.getLogger("k3kit.serve").log(logging.WARNING if io.announce else logging.INFO, io.line())
    options = LoadOptions(device=args.device, dtype=DTYPES[args.dtype],
                          expert_cache_mib=io.cache_mib, cold=io.cold, expert_kernel=args.expert_kernel,
                          trunk=args.trunk, expert_prefetch=args.expert_prefetch,
                          arith=args.arith, cpu_moe=args.cpu_moe)
    apply_threads(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    pins = pin_profile(path, args)

    def load():
        session = open_session(path, options, draft=draft, block_size=args.block_size,
                               draft_device=args.draft_device)
        try:
            pin_experts(session.target, pins, args)
            return session, decode_step(args, session.draft_model, session.codec.stop_ids())
        except BaseException:
            session.close()
            raise

    config = ServeConfig(host=args.host, port=args.port, api_key=api_key, max_batch=args.max_batch,
                         max_sequences=args.max_sequences, max_queue=args.max_queue, ctx=args.ctx,
                         max_body_bytes=int(args.max_body_mib * (1 << 20)),
                         prompt_cache_mib=prompt_mib, prompt_cache_dir=args.prompt_cache_dir,
                         prompt_cache_disk_mib=args.prompt_cache_disk_mib,
                         prompt_cache_interval=args.prompt_cache_interval,
                         shutdown_timeout=args.shutdown_timeout, warmup=not args.no_warmup)
    return serve(path, load, config)
