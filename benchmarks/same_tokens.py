"""Greedy tokens of this tree against another tree's, for the same models and prompts.

    python benchmarks/same_tokens.py --ab OTHER_TREE [--model GGUF ...] [--tokens 64] [--no-draft]

Each run is `k3kit generate ... --json` in its own process, with PYTHONPATH pointing at one tree's
`src` (build the other tree's extensions in place first: `python setup.py build_ext --inplace`).
The shipped mini runs AR and with `--draft default`; each `--model` (e.g. a K3-geometry slice from
`k3kit synth --geometry k3`) runs AR. Prints one line per run and exits 1 if any tokens differ:
the check that a refactoring left behaviour bit for bit where it was.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):"]


def tokens(tree: Path, args: list[str]) -> list[int]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    proc = subprocess.run([sys.executable, "-m", "k3kit", "generate", *args, "--json"], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"same_tokens: {tree}: generate failed: {proc.stderr.strip()[-400:]}")
    ids: list[int] = json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"]
    return ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ab", required=True, type=Path, help="the other tree (extensions built)")
    ap.add_argument("--model", action="append", default=[], help="more GGUFs to run AR (repeatable)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-draft", action="store_true", help="skip the mini's --draft default runs")
    a = ap.parse_args()
    runs: list[tuple[str, list[str]]] = []
    for p in PROMPTS:
        runs.append((f"mini AR {p.splitlines()[0]!r}", ["--prompt", p, "--max-tokens", str(a.tokens)]))
        if not a.no_draft:
            runs.append((f"mini draft {p.splitlines()[0]!r}",
                         ["--prompt", p, "--max-tokens", str(a.tokens), "--draft", "default"]))
    for m in a.model:
        runs.append((f"{Path(m).name} AR", [m, "--prompt", PROMPTS[0], "--max-tokens", str(min(a.tokens, 16)),
                                            "--expert-cache-mib", "4096"]))
    differ = 0
    for name, args in runs:
        here, there = tokens(ROOT, args), tokens(a.ab, args)
        same = here == there
        differ += not same
        print(f"{'same' if same else 'DIFFERENT'}  {name}: {len(here)} tokens", flush=True)
    print(f"{len(runs) - differ} of {len(runs)} runs give the same tokens")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
