"""`k3kit mini`: the mini K3 reference model. Sub-commands: `train` (a new one), `path` (the
shipped one's files). `train-draft` (its DSpark drafter) plugs in here as another sub-parser."""

from __future__ import annotations

import argparse
import json

NAME = "mini"
HELP = "the mini K3 (a tiny, fully featured, trained kimi-k3): train one, or locate the shipped one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="mini_command", metavar="SUBCOMMAND", required=True)

    t = sub.add_parser("train", help="train a mini K3 on the CPython stdlib (CPU, deterministic per seed)")
    t.add_argument("--out", required=True, metavar="DIR", help="run directory: hf/, train_log.jsonl, "
                   "summary.json, checkpoint.pt")
    t.add_argument("--minutes", type=float, default=None, help="wall-clock budget; without --steps the "
                   "schedule is sized from the speed of the first 20 steps")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (fixes the LR schedule)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    t.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    t.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on shared cores "
                   "OpenMP spinning makes 2 threads far slower)")
    t.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    t.add_argument("--corpus-bytes", type=int, default=None, help="cap the corpus (quick runs)")
    t.add_argument("--stop-at", type=int, default=None, metavar="STEP", help="end after this step "
                   "(checkpointed, resumable) without finishing the schedule")
    t.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(_mini=_run_train)

    p = sub.add_parser("path", help="print the absolute path of the shipped mini K3 GGUF")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--hf", action="store_true", help="the Hugging Face checkpoint directory instead")
    g.add_argument("--draft", action="store_true", help="the shipped DSpark drafter GGUF instead")
    p.set_defaults(_mini=_run_path)

    # `train-draft`: the drafter's sub-parser and runner live in k3kit.mini.draft_cli
    from k3kit.mini.draft_cli import add_parser as add_train_draft
    add_train_draft(sub)


def run(args: argparse.Namespace) -> int:
    return args._mini(args)


def _run_path(args: argparse.Namespace) -> int:
    from k3kit.mini import paths

    p = paths.shipped_hf() if args.hf else paths.shipped_draft() if args.draft else paths.shipped_gguf()
    print(p)
    return 0


def _run_train(args: argparse.Namespace) -> int:
    from k3kit.mini.train import TrainSettings, train

    s = TrainSettings(steps=args.steps, minutes=args.minutes, seed=args.seed, batch=args.batch,
                      seq_len=args.seq_len, lr=args.lr, threads=args.threads, eval_every=args.eval_every,
                      corpus_bytes=args.corpus_bytes, stop_at=args.stop_at)
    r = train(args.out, s, resume=args.resume, log=None if not args.json else (lambda m: None))
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
        return 0
    print(f"trained {r.steps} steps ({r.tokens} tokens) in {r.seconds / 60:.1f} min: held-out perplexity "
          f"{r.heldout_ppl:.2f} (unigram {r.unigram_ppl:.1f}); {r.params / 1e6:.2f} M parameters; "
          f"checkpoint in {r.out_dir / 'hf'}")
    return 0
