"""`k3kit synth`: write a random kimi-k3 GGUF with real K3 geometry (for tests and benchmarks)."""

from __future__ import annotations

import argparse
import json

from k3kit.gguf.synth import EXPERT_TYPES, GEOMETRIES, TRUNK_TYPES, synthesize

NAME = "synth"
HELP = "write a random kimi-k3 GGUF with real K3 (or mini) geometry, sharded like the real model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="k3",
                        help="k3: Kimi-K3 dimensions (hidden 7168); mini: a tiny model for fast tests; "
                             "mini256: mini with 256-wide expert rows (for K-quant / i-quant experts)")
    parser.add_argument("--layers", type=int, required=True, metavar="N",
                        help="number of layers (>= 2; every 4th and the last are MLA, layer 0 is dense)")
    parser.add_argument("--experts", type=int, required=True, metavar="E", help="routed experts per layer")
    parser.add_argument("--shards", type=int, default=1, metavar="S",
                        help="split into S shards of roughly equal bytes (default 1)")
    parser.add_argument("--vocab", type=int, default=None, metavar="V",
                        help="vocabulary size (default: 163840 for k3, 1024 for mini)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    parser.add_argument("--name", default=None, help="file name stem (default: derived from the geometry)")
    expert_names = [t.name for t in EXPERT_TYPES]
    parser.add_argument("--expert-type", choices=expert_names, default=None, metavar="T",
                        help="ggml type of the routed gate/up experts (default MXFP4): "
                             + ", ".join(expert_names))
    parser.add_argument("--expert-type-down", choices=expert_names, default=None, metavar="T",
                        help="ggml type of the routed down experts (default: --expert-type)")
    trunk_names = [t.name for t in TRUNK_TYPES]
    parser.add_argument("--trunk-type", choices=trunk_names, default=None, metavar="T",
                        help=f"ggml type of the trunk matrices (default Q8_0): {', '.join(trunk_names)}; "
                             "token_embd, output and matrices whose rows do not fit the block stay Q8_0, "
                             "as `k3kit requant` leaves them")
    parser.add_argument("--metadata-shard", action="store_true",
                        help="like published files: shard 1 holds only metadata, tensors start at shard 2 "
                             "(--shards counts it)")
    parser.add_argument("--sparse", action="store_true",
                        help="exact headers, data region left as a hole: full file size, no disk blocks "
                             "(to inspect or plan the full K3 geometry on any machine)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    result = synthesize(args.out, args.geometry, args.layers, args.experts, vocab=args.vocab,
                        shards=args.shards, seed=args.seed, name=args.name, progress=not args.json,
                        expert_type=args.expert_type, expert_type_down=args.expert_type_down,
                        trunk_type=args.trunk_type, metadata_shard=args.metadata_shard, sparse=args.sparse)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    gb = result.file_bytes / 1e9
    print(f"wrote {len(result.paths)} file(s), {gb:.3f} GB, {result.tensors} tensors "
          f"in {result.seconds:.2f} s ({result.gb_per_s:.2f} GB/s)")
    print(f"geometry {result.geometry}: {result.layers} layers (MLA: {result.mla_layers}), "
          f"{result.experts} experts, vocab {result.vocab}")
    kept = f" ({result.trunk_kept_q8_0} trunk matrices kept Q8_0)" if result.trunk_kept_q8_0 else ""
    print(f"types: experts {result.expert_type} gate/up, {result.expert_type_down} down; "
          f"trunk {result.trunk_type}{kept}; general.file_type {result.file_type}"
          + ("; shard 1 is metadata only" if result.metadata_shard else ""))
    if result.sparse:
        print(f"sparse: {result.disk_bytes / 1e6:.1f} MB on disk for {gb:.3f} GB of files")
    for p in result.paths:
        print(f"  {p}")
    return 0
