"""`k3kit mini train-draft`: the sub-parser and its runner (plugged into k3kit.commands.mini).

No torch at import time: the CLI builds every parser on each start."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _taps(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no layer ids")
    return out


def add_parser(sub) -> argparse.ArgumentParser:
    d = sub.add_parser("train-draft", help="train a DSpark drafter (block 7) for a mini K3 by distillation "
                       "on its features; writes hf/ (safetensors + config.json), MODEL_CARD.md, logs")
    d.add_argument("--out", required=True, metavar="DIR", help="run directory")
    d.add_argument("--target", default=None, metavar="HF_DIR",
                   help="the target's HF checkpoint (default: the shipped mini K3, `mini path --hf`)")
    d.add_argument("--minutes", type=float, default=None, help="training budget (then evaluation and save)")
    d.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the LR schedule)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--layers", type=int, default=2, help="draft layers (default 2)")
    d.add_argument("--markov-rank", type=int, default=32, help="Markov head rank (default 32; 0: DFlash)")
    d.add_argument("--taps", type=_taps, default=None, metavar="I,J,..",
                   help="HF target_layer_ids (output of layer i); default: K3's depths scaled")
    d.add_argument("--lr", type=float, default=2e-3)
    d.add_argument("--seqs", type=int, default=16, help="sequences the target generates per round")
    d.add_argument("--gen-len", type=int, default=96, help="greedy tokens per generated sequence")
    d.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    d.add_argument("--reuse", type=int, default=6, help="steps per generated round")
    d.add_argument("--threads", type=int, default=1)
    d.add_argument("--card-tokens", type=int, default=64,
                   help="new tokens per prompt in the card's measurement")
    d.add_argument("--corpus-bytes", type=int, default=None, help="cap the corpus (quick runs)")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.set_defaults(_mini=run)
    return d


def run(args: argparse.Namespace) -> int:
    from k3kit.mini import paths
    from k3kit.mini.train_draft import DraftTrainSettings, train_mini_draft

    target = Path(args.target) if args.target else paths.shipped_hf()
    s = DraftTrainSettings(steps=args.steps, minutes=args.minutes, seed=args.seed, layers=args.layers,
                           markov_rank=args.markov_rank, taps=args.taps, lr=args.lr, seqs=args.seqs,
                           gen_len=args.gen_len, anchors=args.anchors, reuse=args.reuse, threads=args.threads,
                           corpus_bytes=args.corpus_bytes)
    summary = train_mini_draft(target, args.out, s, card_tokens=args.card_tokens,
                               log=(lambda m: None) if args.json else None)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    per = ", ".join(f"{k} {v['tau']:.2f}" for k, v in summary["workloads"].items())
    print(f"trained {summary['steps']} steps in {summary['train_seconds'] / 60:.1f} min; tau (tokens per "
          f"target pass): {per}; checkpoint in {Path(args.out) / 'hf'}")
    return 0
