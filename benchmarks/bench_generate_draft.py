"""`k3kit generate --draft` against plain decoding on any model and drafter, as a user runs it.

    python benchmarks/bench_generate_draft.py MODEL.gguf --draft DRAFT.gguf|default
        [--prompt TEXT] [--tokens 64] [--threads 2] [--rounds 2] [--ab TREE] [MORE GENERATE ARGS]

Each round runs `k3kit generate MODEL --temperature 0 --json` without the draft and with it
(and, with `--ab TREE`, both again with TREE's k3kit first on PYTHONPATH: another checkout with
its extensions built), in turns, so that a drifting machine slows all alike. Prints per run the
decode tok/s, target passes, draft steps and passes that declined to draft, and per round each
draft run's ratio to the plain run of the same tree; checks that every run emitted the same
tokens (greedy output must not depend on drafting). Separate processes: each pays its own load,
which `decode_tok_s` leaves out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def run(tree: str | None, model: str, prompt: str, tokens: int, threads: int, draft: str | None,
        extra: list[str]) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(Path(tree, "src")) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "k3kit", "generate", model, "--prompt", prompt, "--max-tokens", str(tokens),
           "--threads", str(threads), "--temperature", "0", "--json", *extra]
    if draft is not None:
        cmd += ["--draft", draft]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompt", default="The history of the northern kingdoms begins")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ab", metavar="TREE", default=None, help="also run another checkout's k3kit")
    args, extra = ap.parse_known_args()       # the rest: more `k3kit generate` arguments
    args.extra = [a for a in extra if a != "--"]

    trees: list[tuple[str, str | None]] = [("this", None)] + ([("ab", args.ab)] if args.ab else [])
    tokens: set[tuple[int, ...]] = set()
    ratios: dict[str, list[float]] = {name: [] for name, _ in trees}
    for r in range(1, args.rounds + 1):
        for name, tree in (trees if r % 2 else trees[::-1]):
            plain = draft = 0.0
            for d in (None, args.draft):
                res = run(tree, args.model, args.prompt, args.tokens, args.threads, d, args.extra)
                s = res["stats"]
                tokens.add(tuple(res["token_ids"]))
                spec = (f"{s['target_passes']} passes, {s['draft_steps']} draft steps, "
                        f"{s.get('plain_passes', '-')} declined" if d else "plain")
                label = "draft" if d else "AR"
                print(f"round {r} {name:4s} {label:5s} {s['decode_tok_s']:8.2f} tok/s  {spec}", flush=True)
                if d:
                    draft = s["decode_tok_s"]
                else:
                    plain = s["decode_tok_s"]
            ratios[name].append(draft / plain if plain else 0.0)
    for name, rs in ratios.items():
        print(f"{name}: draft / AR per round " + ", ".join(f"{x:.2f}" for x in rs))
    if len(tokens) != 1:
        print("ERROR: runs emitted different tokens", file=sys.stderr)
        return 1
    print("every run emitted the same tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
