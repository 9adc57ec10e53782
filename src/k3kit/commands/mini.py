"""`k3kit mini`: the mini K3 reference model. Sub-commands: `train` (a new one), `path` (the
shipped one's files), `chat-tune` (K3's chat format on top of a trained one), `ship` (a train
run's assets), `train-draft` (its DSpark drafter) and
`ship-draft` (the drafter's assets).

No torch at import time: the CLI builds every parser on each start."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

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
    d.add_argument("--init", default=None, metavar="DRAFT_HF_DIR",
                   help="start from this drafter's weights (the shipped one's hf/, say), not random ones")
    d.add_argument("--chat-conversations", type=int, default=3000,
                   help="generated Kimi-K3 chats mixed into the prompts (default 3000; 0: code only)")
    d.add_argument("--schema-every", type=int, default=0, metavar="N",
                   help="every Nth round: chat requests under random JSON schemas, answered by the target "
                        "under their grammars (default 0: none)")
    d.add_argument("--schema-len", type=int, default=96, help="most tokens of a constrained answer")
    d.add_argument("--card-tokens", type=int, default=64,
                   help="new tokens per prompt in the card's measurement")
    d.add_argument("--corpus-bytes", type=int, default=None, help="cap the corpus (quick runs)")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.set_defaults(_mini=_run_train_draft)

    s = sub.add_parser("ship-draft", help="convert a train-draft run against the target GGUF, measure the "
                       "converted file and write the asset directory (maintainers)")
    s.add_argument("run_dir", metavar="RUN_DIR", help="a `train-draft --out` directory")
    s.add_argument("--target-hf", required=True, metavar="HF_DIR", help="the target's HF checkpoint")
    s.add_argument("--target-gguf", required=True, metavar="T.gguf", help="the target GGUF")
    s.add_argument("--dest", required=True, metavar="DIR", help="asset directory to (re)place")
    s.add_argument("--type", default="Q8_0", choices=["Q8_0", "BF16", "F32"])
    s.set_defaults(_mini=_run_ship_draft)

    c = sub.add_parser("chat-tune", help="teach a mini K3 Kimi-K3's chat format, tools and thinking by "
                       "training on generated conversations (CPU, deterministic per seed)")
    c.add_argument("--from", dest="base", default=None, metavar="DIR",
                   help="a shipped mini directory (default: the installed one)")
    c.add_argument("--out", required=True, metavar="DIR", help="run directory for `k3kit mini ship`")
    c.add_argument("--minutes", type=float, default=30.0, help="training budget (default 30)")
    c.add_argument("--steps", type=int, default=None, help="steps (fixes the schedule; --minutes is ignored)")
    c.add_argument("--conversations", type=int, default=20000, help="training conversations (default 20000)")
    c.add_argument("--lr", type=float, default=1e-3)
    c.add_argument("--prompt-weight", type=float, default=0.1,
                   help="loss weight of chat tokens outside assistant messages (default 0.1)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    c.set_defaults(_mini=_run_chat_tune)

    m = sub.add_parser("ship", help="assemble a train run's shipped assets (HF checkpoint, GGUF, model card) "
                       "in DEST (maintainers)")
    m.add_argument("run_dir", metavar="RUN_DIR", help="a `train --out` directory")
    m.add_argument("dest", metavar="DEST", help="asset directory to (re)place")
    m.add_argument("--no-gguf", action="store_true", help="skip converting the GGUF")
    m.set_defaults(_mini=_run_ship)


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


def _run_chat_tune(args: argparse.Namespace) -> int:
    from k3kit.mini import paths
    from k3kit.mini.chat_tune import ChatTuneSettings, chat_tune

    base = Path(args.base) if args.base else paths.shipped_hf().parent
    s = ChatTuneSettings(minutes=args.minutes, steps=args.steps, conversations=args.conversations, lr=args.lr,
                         seed=args.seed, threads=args.threads, prompt_weight=args.prompt_weight)
    summary = chat_tune(base, args.out, s, log=(lambda m: None) if args.json else None)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    chat = summary["chat"]
    print(f"chat stage: {chat['steps']} steps in {chat['seconds'] / 60:.1f} min; held-out chat perplexity "
          f"{math.exp(chat['chat_nll_before']):.2f} -> {math.exp(chat['chat_nll']):.3f}, code "
          f"{summary['base']['heldout_ppl']:.2f} -> {summary['heldout_ppl']:.2f}; checkpoint in "
          f"{Path(args.out) / 'hf'}")
    return 0


def _taps(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("no layer ids")
    return out


def _run_train_draft(args: argparse.Namespace) -> int:
    from k3kit.mini import paths
    from k3kit.mini.draft.train import DraftTrainSettings, train_mini_draft

    target = Path(args.target) if args.target else paths.shipped_hf()
    s = DraftTrainSettings(steps=args.steps, minutes=args.minutes, seed=args.seed, layers=args.layers,
                           markov_rank=args.markov_rank, taps=args.taps, lr=args.lr, seqs=args.seqs,
                           gen_len=args.gen_len, anchors=args.anchors, reuse=args.reuse, threads=args.threads,
                           corpus_bytes=args.corpus_bytes, init=args.init,
                           chat_conversations=args.chat_conversations, schema_every=args.schema_every,
                           schema_len=args.schema_len)
    summary = train_mini_draft(target, args.out, s, card_tokens=args.card_tokens,
                               log=(lambda m: None) if args.json else None)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    per = ", ".join(f"{k} {v['tau']:.2f}" for k, v in summary["workloads"].items())
    print(f"trained {summary['steps']} steps in {summary['train_seconds'] / 60:.1f} min; tau (tokens per "
          f"target pass): {per}; checkpoint in {Path(args.out) / 'hf'}")
    return 0


def _run_ship_draft(args: argparse.Namespace) -> int:
    import torch

    from k3kit.mini.draft.ship import ship

    torch.set_num_threads(1)
    ship(args.run_dir, args.target_hf, args.target_gguf, args.dest, out_type=args.type)
    return 0


def _run_ship(args: argparse.Namespace) -> int:
    import torch

    from k3kit.mini.card import ship

    torch.set_num_threads(1)
    ship(args.run_dir, args.dest, gguf=not args.no_gguf)
    return 0
