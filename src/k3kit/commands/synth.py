"""`k3kit synth`: write a random kimi-k3 GGUF with real K3 geometry (for tests and benchmarks)."""

from __future__ import annotations

import argparse
import json

from k3kit.gguf.synth import GEOMETRIES, synthesize

NAME = "synth"
HELP = "write a random kimi-k3 GGUF with real K3 (or mini) geometry, sharded like the real model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="k3",
                        help="k3: Kimi-K3 dimensions (hidden 7168); mini: a tiny model for fast tests")
    parser.add_argument("--layers", type=int, required=True, metavar="N",
                        help="number of layers (>= 2; every 4th and the last are MLA, layer 0 is dense)")
    parser.add_argument("--experts", type=int, required=True, metavar="E", help="routed experts per layer")
    parser.add_argument("--shards", type=int, default=1, metavar="S",
                        help="split into S shards of roughly equal bytes (default 1)")
    parser.add_argument("--vocab", type=int, default=None, metavar="V",
                        help="vocabulary size (default: 163840 for k3, 1024 for mini)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    parser.add_argument("--name", default=None, help="file name stem (default: derived from the geometry)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    result = synthesize(args.out, args.geometry, args.layers, args.experts, vocab=args.vocab,
                        shards=args.shards, seed=args.seed, name=args.name, progress=not args.json)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    gb = result.file_bytes / 1e9
    print(f"wrote {len(result.paths)} file(s), {gb:.3f} GB, {result.tensors} tensors "
          f"in {result.seconds:.2f} s ({result.gb_per_s:.2f} GB/s)")
    print(f"geometry {result.geometry}: {result.layers} layers (MLA: {result.mla_layers}), "
          f"{result.experts} experts, vocab {result.vocab}")
    for p in result.paths:
        print(f"  {p}")
    return 0
