"""`k3kit rewrite` of a multi-GB sharded model vs `cp` of the same bytes.

A rewrite changes only headers, so it should cost what copying the bytes costs. Both sides
run as subprocesses on the same input (8 shards, 3 GB by default), alternating, best of
--reps. rewrite fsyncs every output file (it is atomic and durable), so the fair peer is
`cp` followed by `sync` of the copies; plain `cp` (page cache only) is shown too. Ratio =
k3kit time / peer time (1.0 = as fast as cp).

    python benchmarks/bench_rewrite.py [--dir DIR] [--gb 3] [--shards 8] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from k3kit.gguf.reader import tensor_nbytes
from k3kit.gguf.writer import TensorSpec, kv, write_model

TENSOR_SHAPE = (4096, 4096, 4)  # 36 MB of MXFP4: a slice of a stacked expert tensor


def make_model(out: Path, gb: float, shards: int) -> list[Path]:
    pool = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    n = tensor_nbytes(TENSOR_SHAPE, Q.MXFP4)
    count = max(shards, int(gb * 1e9 // n))

    def chunk(i: int):
        start = (i * 1_000_003) % (len(pool) - n)
        return lambda: pool[start:start + n]

    specs = [TensorSpec(f"blk.{i}.ffn_up_exps.weight", TENSOR_SHAPE, Q.MXFP4, n, chunk(i))
             for i in range(count)]
    kvs = [kv("general.architecture", V.STRING, "kimi-k3"), kv("kimi-k3.block_count", V.UINT32, count)]
    per = -(-count // shards)
    layout = [[s.name for s in specs[i:i + per]] for i in range(0, count, per)]
    return write_model(out, kvs, specs, layout=layout)


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="work directory (default: a temp dir, removed after)")
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="k3kit-bench-rewrite-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        (work / "in").mkdir(exist_ok=True)
        src = make_model(work / "in" / "model.gguf", args.gb, args.shards)
        size = sum(p.stat().st_size for p in src)
        print(f"input: {len(src)} shards, {size / 1e9:.2f} GB; best of {args.reps}, rotating order")
        out_dir = work / "out"
        best = {"rewrite": float("inf"), "cp": float("inf"), "cp+sync": float("inf")}
        result = None
        sides = list(best)
        for rep in range(args.reps):
            for side in sides[rep % 3:] + sides[:rep % 3]:  # rotate: no side always runs first
                shutil.rmtree(out_dir, ignore_errors=True)
                out_dir.mkdir()
                subprocess.run(["sync"], check=True)
                if side == "rewrite":
                    t0 = time.perf_counter()
                    r = subprocess.run([sys.executable, "-m", "k3kit.cli", "rewrite", str(src[0]), "-o",
                                        str(out_dir / "model.gguf"), "--arch", "kimi-k3x", "--json"],
                                       check=True, capture_output=True, text=True)
                    dt = time.perf_counter() - t0
                    result = json.loads(r.stdout)
                elif side == "cp":
                    dt = timed(["cp", *map(str, src), str(out_dir)])
                else:
                    t0 = time.perf_counter()
                    subprocess.run(["cp", *map(str, src), str(out_dir)], check=True)
                    subprocess.run(["sync", *map(str, out_dir.iterdir())], check=True)
                    dt = time.perf_counter() - t0
                best[side] = min(best[side], dt)
        assert result is not None and len(result["output"]) == len(src)
        startup = min(timed([sys.executable, "-m", "k3kit.cli", "--version"]) for _ in range(3))
        print(f"{'':10s} {'seconds':>8s} {'GB/s':>6s}")
        for side, dt in best.items():
            print(f"{side:10s} {dt:8.2f} {size / dt / 1e9:6.2f}")
        print(f"ratio rewrite / (cp+sync): {best['rewrite'] / best['cp+sync']:.2f}; "
              f"rewrite / cp: {best['rewrite'] / best['cp']:.2f}  (1.0 = as fast as the peer)")
        print(f"(rewrite includes {startup:.2f} s of `python -m k3kit.cli` startup; "
              f"in-process rewrite / (cp+sync): {(best['rewrite'] - startup) / best['cp+sync']:.2f})")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
