"""`k3kit perplexity`: llama-perplexity's measurement on a GGUF, and KL-divergence from a base run.

The computation is model-neutral (k3kit.runtime.perplexity: chunking, scoring, the two base
formats); this module reads the text, loads the model, and prints one result.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from k3kit.errors import K3Error

NAME = "perplexity"
HELP = "perplexity of a GGUF model over a text, its logits, and KL-divergence from a base model's"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3kit.commands.generate import add_model_arguments

    parser.add_argument("model", metavar="MODEL", help="GGUF file or any shard")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("-f", "--file", metavar="FILE", help="the text, a UTF-8 file")
    src.add_argument("--text", metavar="T", help="the text itself")
    parser.add_argument("--ctx", type=int, default=None, metavar="N",
                        help="tokens per chunk; each chunk runs from a fresh context and its second half "
                        "is scored, as llama-perplexity -c (default 512, or the whole text if shorter)")
    parser.add_argument("--chunks", type=int, default=None, metavar="N", help="evaluate at most N chunks")
    parser.add_argument("--save-logits", metavar="OUT.npy",
                        help="write the logits of every evaluated position, float32 [n_tokens, n_vocab] "
                        "(row i = after the first i+1 tokens of its chunk)")
    parser.add_argument("--kl-base", metavar="BASE",
                        help="a base run's logits: a --save-logits .npy (same text, --ctx, --chunks), or "
                        "llama-perplexity's --kl-divergence-base file (its tokens and n_ctx are used; "
                        "the text may then be omitted)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batch", type=int, default=256, metavar="N", help="rows per forward pass (256)")
    add_model_arguments(parser)
    parser.add_argument("--ggml-parity", action="store_true",
                        help="round matmul inputs as ggml-cpu does (closest numbers to llama.cpp's)")


def read_text(args: argparse.Namespace) -> str | None:
    if args.text is not None:
        return str(args.text)
    if args.file is None:
        return None
    path = Path(args.file)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise K3Error(f"{path}: text file is not UTF-8") from None


def check_args(args: argparse.Namespace) -> None:
    bounds = (("--ctx", args.ctx, 2), ("--chunks", args.chunks, 1), ("--batch", args.batch, 1))
    for flag, value, low in bounds:
        if value is not None and value < low:
            raise K3Error(f"{flag} {value}: must be >= {low}")
    if args.threads < 0:
        raise K3Error(f"--threads {args.threads}: must be >= 0")
    if args.expert_cache_mib is not None and not args.expert_cache_mib >= 0:
        raise K3Error(f"--expert-cache-mib {args.expert_cache_mib}: must be >= 0")


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run(args: argparse.Namespace) -> int:
    import torch

    from k3kit.adapters import load_model
    from k3kit.commands.generate import apply_threads, expert_io, pin_experts, pin_profile
    from k3kit.runtime.loader import DTYPES, LoadOptions
    from k3kit.runtime.perplexity import LlamaBase, evaluate, open_base, plan_chunks
    from k3kit.runtime.protocols import CausalModel

    check_args(args)
    text = read_text(args)
    base = open_base(args.kl_base) if args.kl_base else None
    if text is None and not isinstance(base, LlamaBase):
        raise K3Error("give the text with -f FILE or --text T (only a llama.cpp --kl-divergence-base file "
                      "carries its own tokens)")
    if args.save_logits and args.kl_base and Path(args.save_logits).resolve() == Path(args.kl_base).resolve():
        raise K3Error(f"{args.save_logits}: --save-logits would overwrite --kl-base")
    path = Path(args.model)
    io = expert_io(path, args)
    if io.announce:
        print(f"k3kit: {io.line()}", file=sys.stderr)
    options = LoadOptions(device=args.device, dtype=DTYPES[args.dtype],
                          expert_cache_mib=io.cache_mib, cold=io.cold, expert_kernel=args.expert_kernel,
                          trunk=args.trunk, ggml_parity=bool(args.ggml_parity),
                          expert_prefetch=args.expert_prefetch, arith=args.arith, cpu_moe=args.cpu_moe)
    apply_threads(args)
    pins = pin_profile(path, args)
    loaded = load_model(path, options)
    try:
        pin_experts(loaded, pins, args)
        model, codec = loaded.model, loaded.codec
        if not isinstance(model, CausalModel):
            raise K3Error(f"{path}: architecture {loaded.architecture!r} is not a causal language model")
        bos = codec.special.get("bos") if codec.add_bos else None
        where = args.file or "--text"
        if isinstance(base, LlamaBase):
            tokens = [int(t) for t in base.tokens]
            if text is not None:
                mine = codec.encode(text, add_bos=True)
                i = _first_difference(mine, tokens)
                if i < len(tokens):
                    raise K3Error(f"{base.path}: its tokens differ from the text's at position {i} "
                                  "(another text, or another tokenizer)")
            plan = base.plan(ctx=args.ctx, chunks=args.chunks, bos=bos)
        else:
            assert text is not None
            tokens = codec.encode(text, add_bos=True)
            plan = plan_chunks(len(tokens), ctx=args.ctx, chunks=args.chunks,
                               context_length=model.context_length, bos=bos, where=where)
        if plan.ctx > model.context_length:
            raise K3Error(f"--ctx {plan.ctx}: the model holds at most {model.context_length} positions")
        with torch.no_grad():
            result = evaluate(model, tokens, plan, base=base, save_logits=args.save_logits, batch=args.batch,
                              progress=not args.json, where=str(path))
        loaded.check()
        vocab = model.vocab_size
    finally:
        loaded.close()

    if args.json:
        print(json.dumps({"model": str(path)} | result.to_dict()))
        return 0
    r = result
    print(f"perplexity {r.perplexity:.4f} +/- {r.perplexity_err:.5f} over {r.scored} tokens "
          f"({r.chunks} chunk{'s' if r.chunks != 1 else ''} of {r.ctx}, second half scored; "
          f"{r.tokens} tokens in the text, {r.tok_s:.1f} tok/s)")
    if r.logits_file:
        print(f"logits: {r.logits_file} (float32 [{r.rows}, {vocab}])")
    if r.base is not None:
        if not r.compared or r.top1_agreement is None:
            print(f"kl-divergence from {r.base}: no rows compared")
            return 0
        bp = "" if r.base_perplexity is None or not math.isfinite(r.base_perplexity) else \
            f"; base perplexity {r.base_perplexity:.4f}"
        print(f"kl-divergence from {r.base} ({r.base_format}, {r.compared} positions): mean {r.kl_mean:.6f}, "
              f"median {r.kl_median:.6f}, max {r.kl_max:.6f}; top-1 agreement {100 * r.top1_agreement:.2f}%; "
              f"mean |dp| of the base's top token {r.mean_abs_dp_top:.5f}{bp}")
    return 0
