"""`k3kit requant`: the trunk to a new quant type, routed experts byte-for-byte, shard by shard."""

from __future__ import annotations

import argparse
import json
import os

from k3kit.gguf.requant import TARGETS, Options, RequantResult, requantize

NAME = "requant"
HELP = ("requantize a model's trunk (e.g. Q8_0 -> Q4_K) keeping the MXFP4 routed experts byte-for-byte; "
        "verified, resumable, shard by shard")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="IN", help="the model (any shard of a sharded model)")
    parser.add_argument("-o", "--out", required=True, metavar="OUT_DIR",
                        help="output directory; shards keep the input's file names")
    parser.add_argument("--to", default="Q4_K", metavar="TYPE",
                        help=f"target type for the selected tensors: {', '.join(t.name for t in TARGETS)} "
                             "(default Q4_K)")
    parser.add_argument("--include", action="append", default=[], metavar="REGEX",
                        help="also requantize tensors whose name matches (e.g. '^output\\.weight$'); "
                             "repeatable")
    parser.add_argument("--exclude", action="append", default=[], metavar="REGEX",
                        help="never requantize tensors whose name matches; repeatable")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), metavar="N",
                        help="shards processed in parallel, one process each (default: min(4, cores))")
    parser.add_argument("--delete-source", action="store_true",
                        help="delete each source shard once its output is verified and journaled")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run in OUT_DIR")
    parser.add_argument("--allow-expert-requant", action="store_true",
                        help="allow --include to requantize MXFP4 routed experts "
                             "(destroys their QAT calibration)")
    parser.add_argument("--exact", choices=("sample", "all", "none"), default="sample",
                        help="rows requantized again during verification and compared byte for byte: "
                             "every 16th (default), all (doubles the quantization time) or none")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and the disk needs, write nothing")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def print_result(r: RequantResult) -> None:
    print(f"{'plan' if r.dry_run else 'requant'}: -> {r.target} in {r.output_dir}  "
          f"(general.file_type {r.file_type if r.file_type is not None else 'unchanged'})")
    print(f"{'role':18s} {'from':>6s} {'to':>6s} {'tensors':>8s} {'before':>11s} {'after':>11s}")
    for g in r.by_role:
        print(f"{g['role']:18s} {g['from']:>6s} {g['to']:>6s} {g['tensors']:8d} "
              f"{_size(g['bytes_before']):>11s} {_size(g['bytes_after']):>11s}")
    print(f"{r.requantized} tensors requantized, {r.copied} copied byte for byte; "
          f"model {_size(r.bytes_in)} -> {_size(r.bytes_out)}")
    if r.kept:
        print(f"kept ({len(r.kept)}, shape does not fit {r.target}):")
        for k in r.kept[:12]:
            print(f"  {k['name']} {k['shape']} {k['type']}: {k['reason']}")
        if len(r.kept) > 12:
            print(f"  ... and {len(r.kept) - 12} more")
    d = r.disk
    if d.get("free") is not None:
        fits = "does not fit: " + d["problem"] if d.get("fits") is False else "fits"
        need = d.get("needed", d["needed_all_at_once"])
        print(f"disk: {_size(need)} needed, {_size(d['free'])} free ({fits})")
    if r.dry_run:
        return
    for s in r.shards:
        c = s["check"] or {}
        extra = (f"  preserved {c['preserved_ok']}, requantized {c['requantized_ok']} "
                 f"(max rel RMSE {c['max_rel_rmse']:.4f}, {c['exact_rows']} rows re-checked)") if c else ""
        print(f"  {s['name']}: {s['status']}{extra}")
    if r.resumed_skipped:
        print(f"resumed: {len(r.resumed_skipped)} shard(s) were already verified")
    if r.deleted_sources:
        print(f"deleted {len(r.deleted_sources)} source shard(s)")
    print(f"done in {r.seconds:.2f} s ({r.gb_per_s:.3f} GB/s of input)")


def run(args: argparse.Namespace) -> int:
    opts = Options(to=args.to, include=tuple(args.include), exclude=tuple(args.exclude),
                   allow_expert_requant=args.allow_expert_requant)
    opts.target  # noqa: B018 - validates --to before any work
    result = requantize(args.input, args.out, opts, jobs=args.jobs, delete_source=args.delete_source,
                        resume=args.resume, dry_run=args.dry_run, exact=args.exact, progress=not args.json)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print_result(result)
    return 0
