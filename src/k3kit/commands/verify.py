"""`k3kit verify`: check a requantized model against its source, shard by shard."""

from __future__ import annotations

import argparse
import json

from k3kit.gguf.requant import verify_model

NAME = "verify"
HELP = ("verify a requantized model against its source: preserved tensors byte-identical, "
        "requantized ones within the format's error bound and equal to requantizing the source")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", metavar="OUT", help="the requantized model (any shard)")
    parser.add_argument("--against", required=True, metavar="IN",
                        help="the source model (any shard, or its directory)")
    parser.add_argument("--exact", choices=("sample", "all", "none"), default="sample",
                        help="rows requantized again and compared byte for byte: "
                             "every 16th (default), all, none")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    result = verify_model(args.output, args.against, exact=args.exact, progress=not args.json)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.ok else 1
    print(f"{'shard':48s} {'tensors':>7s} {'preserved':>9s} {'requant':>8s} {'max rRMSE':>9s} "
          f"{'exact rows':>10s}  result")
    for s in result.shards:
        name = s["output"].rsplit("/", 1)[-1]
        print(f"{name:48s} {s['tensors']:7d} {s['preserved_ok']:9d} {s['requantized_ok']:8d} "
              f"{s['max_rel_rmse']:9.4f} {s['exact_rows']:10d}  {'OK' if s['ok'] else 'MISMATCH'}")
        for p in s["problems"]:
            print(f"    {p}")
        if s["n_problems"] > len(s["problems"]):
            print(f"    ... {s['n_problems'] - len(s['problems'])} more")
    print("all shards verified" if result.ok else "verification FAILED")
    return 0 if result.ok else 1
