"""The host side of a decode step, per layer: aten ops, host syncs and host microseconds.

    python benchmarks/bench_host.py [--ab TREE] [--tokens 16] [--threads 1] [--no-slice] [--reps 2]

Runs k3kit.bench.host's profile (what `k3kit bench --host-profile` prints) on the shipped mini K3
with its drafter (AR decode step, DSpark draft step, verify pass) and on a K3-geometry slice
(`k3kit synth`: hidden 7168, 2 layers, 16 experts, AR only), each in a child process of its own.
Host time = the step's time minus the time inside matrix products (native kernels, aten
mm/bmm/mv); with one thread, CPU time of the calling thread (k3kit.bench.host says why).

`--ab TREE` runs the same children on another checkout's sources (TREE/src, e.g. the tree before a
change, with its extensions built or copied in), measured by THIS tree's k3kit/bench/host.py
(loaded by path, so TREE needs no profiler of its own), alternating the two trees `--reps` times;
it prints both and the ratio TREE / this per figure (medians of the reps).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOST_PY = HERE.parent / "src/k3kit/bench/host.py"


def child(model: str, draft: str | None, tokens: int, threads: int) -> None:
    """In the child: load host.py by path, profile `model`, print JSON phases."""
    import torch
    spec = importlib.util.spec_from_file_location("k3kit_host_probe", os.environ["K3KIT_HOST_PY"])
    assert spec is not None and spec.loader is not None
    host = importlib.util.module_from_spec(spec)
    sys.modules["k3kit_host_probe"] = host
    spec.loader.exec_module(host)
    from k3kit.adapters.session import open_session
    from k3kit.runtime.loader import LoadOptions
    torch.set_num_threads(threads)
    options = LoadOptions(expert_cache_mib=4096)
    with open_session(Path(model), options, draft=Path(draft) if draft else None) as s:
        vocab = s.model.vocab_size
        text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
        ids = s.codec.encode(text) if s.codec.n_vocab else []
        ids = [t % vocab for t in ids] or [1, 2, 3]
        with torch.no_grad():
            phases, _ = host.host_profile(s, ids, tokens)
    print(json.dumps([p.to_dict() for p in phases]))


def run_child(tree: Path, model: Path, draft: Path | None, tokens: int, threads: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), K3KIT_HOST_PY=str(HOST_PY))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(model), "--tokens", str(tokens),
           "--threads", str(threads)]
    if draft is not None:
        cmd += ["--draft", str(draft)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_rows(runs: list[list[dict]]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for phase in runs[0]:
        name = phase["phase"]
        rows = [next(p for p in r if p["phase"] == name) for r in runs]
        out[name] = {k: statistics.median(float(p[k]) for p in rows)
                     for k in ("ops_per_layer", "syncs", "d2h", "host_us_per_layer", "wall_us", "host_us")}
        out[name]["layers"] = phase["layers"]
    return out


def table(label: str, this: dict[str, dict], other: dict[str, dict] | None) -> None:
    print(f"\n{label}")
    head = "| phase | layers | ops/layer | syncs/call | d2h | host us/layer | wall us/call |"
    if other is not None:
        head += " --ab ops/layer | --ab syncs | --ab host us/layer | ops ratio | host ratio |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, p in this.items():
        line = (f"| {name} | {p['layers']} | {p['ops_per_layer']:.1f} | {p['syncs']:.2f} | {p['d2h']:.2f} | "
                f"{p['host_us_per_layer']:.0f} | {p['wall_us']:.0f} |")
        if other is not None and name in other:
            o = other[name]
            line += (f" {o['ops_per_layer']:.1f} | {o['syncs']:.2f} | {o['host_us_per_layer']:.0f} | "
                     f"{o['ops_per_layer'] / max(p['ops_per_layer'], 1e-9):.2f} | "
                     f"{o['host_us_per_layer'] / max(p['host_us_per_layer'], 1e-9):.2f} |")
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", metavar="TREE", help="also measure TREE's sources, alternated with this tree's")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-slice", action="store_true", help="the mini only")
    ap.add_argument("--dir", default=None, help="where the slice is synthesized (a temp dir)")
    ap.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--draft", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.draft, args.tokens, args.threads)
        return
    this_tree = HERE.parent
    trees = [this_tree] + ([Path(args.ab).resolve()] if args.ab else [])
    sys.path.insert(0, str(this_tree / "src"))
    from k3kit.mini import paths
    models: list[tuple[str, Path, Path | None]] = [
        ("shipped mini K3 + drafter (6 layers)", paths.shipped_gguf(), paths.shipped_draft())]
    print(f"threads {args.threads}; {args.tokens} tokens timed then {args.tokens} counted per phase; "
          f"median of {args.reps} runs per tree, trees alternated")
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if not args.no_slice:
            from dataclasses import replace

            from k3kit.gguf.synth import K3, synthesize
            r = synthesize(Path(tmp) / "slice", replace(K3, n_dense_lead=0, n_head=8), 2, 16, vocab=512,
                           progress=False, name="k3slice")
            models.append(("K3-geometry slice (hidden 7168, 2 layers, 16 experts)", r.paths[0], None))
        for label, model, draft in models:
            runs: dict[Path, list[list[dict]]] = {t: [] for t in trees}
            for rep in range(args.reps):
                for t in (trees if rep % 2 == 0 else trees[::-1]):
                    runs[t].append(run_child(t, model, draft, args.tokens, args.threads))
            other = median_rows(runs[trees[1]]) if len(trees) > 1 else None
            table(label, median_rows(runs[this_tree]), other)


if __name__ == "__main__":
    main()
