"""`k3kit rewrite IN -o OUT`: change a GGUF's metadata and tensor names; tensor bytes are copied as-is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

NAME = "rewrite"
HELP = "rename arch/tensors, set/delete/copy KVs; tensor bytes are copied unchanged"


def add_arguments(p) -> None:
    p.add_argument("model", help="input .gguf (any shard of a split model)")
    p.add_argument("-o", "--output", help="output .gguf (shards get -0000K-of-0000N.gguf names)")
    p.add_argument("--arch", help="new architecture: moves every OLD.* key to NEW.*")
    p.add_argument("--rename-tensor", action="append", default=[], metavar="REGEX=REPL",
                   help="rename tensors with re.sub (repeatable, applied in order)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=TYPE:VALUE",
                   help="set a KV; TYPE u8..i64,f32,f64,bool,str or arr[T] with comma-separated values")
    p.add_argument("--delete", action="append", default=[], metavar="KEY",
                   help="delete a KV (glob allowed; repeatable)")
    p.add_argument("--copy-kv-from", action="append", default=[], metavar="OTHER.gguf",
                   help="copy KVs from another GGUF; pair each with --keys")
    p.add_argument("--keys", action="append", default=[], metavar="GLOB[,GLOB...]",
                   help="keys to copy from the matching --copy-kv-from")
    p.add_argument("--rules", help="a rules TOML (arch, delete, [set], [[rename_tensor]], [[copy_kv]])")
    p.add_argument("--split-max-size", metavar="SIZE",
                   help="re-shard with at most SIZE of tensor data per shard (e.g. 2G); "
                        "default keeps the input's layout")
    p.add_argument("--in-place", action="store_true", help="allow replacing the input (atomic rename)")
    p.add_argument("--json", action="store_true", help="print what changed as one JSON object")


def build_rules(args):
    """Rules from --rules first, then the flags, so flags can refine a shared rules file."""
    from k3kit.errors import K3Error
    from k3kit.gguf.rewrite import Rules, load_rules, parse_rename, parse_set

    rules = load_rules(args.rules) if args.rules else Rules()
    flags = Rules(arch=args.arch,
                  rename_tensors=[parse_rename(s) for s in args.rename_tensor],
                  set=[parse_set(s) for s in args.set],
                  delete=list(args.delete))
    if len(args.keys) != len(args.copy_kv_from):
        raise K3Error(f"--copy-kv-from given {len(args.copy_kv_from)} times but --keys "
                      f"{len(args.keys)} times: give one --keys per --copy-kv-from")
    flags.copy_kv = [(Path(f), [g for g in k.split(",") if g]) for f, k in zip(args.copy_kv_from, args.keys,
                                                                                strict=True)]
    rules.extend(flags)
    return rules


def render(result: dict, out=None) -> None:
    from rich.console import Console

    from k3kit.commands.inspect import fmt_bytes

    out = out or sys.stdout
    c = Console(file=out, highlight=False, width=None if out.isatty() else 200)
    outs = result["output"]
    c.print(f"wrote [bold]{outs[0]}[/bold]" + (f" (+{len(outs) - 1} shards)" if len(outs) > 1 else ""))
    if result["arch"]:
        c.print(f"arch: {result['arch']['from']} -> [bold]{result['arch']['to']}[/bold] "
                f"({len(result['kv_moved'])} keys moved)")
    for label, key in (("added", "kv_added"), ("changed", "kv_changed"), ("removed", "kv_removed")):
        if result[key]:
            c.print(f"KV {label}: {', '.join(result[key])}")
    if result["tensors_renamed"]:
        pairs = result["tensors_renamed"]
        shown = ", ".join(f"{a} -> {b}" for a, b in pairs[:5])
        c.print(f"tensors renamed: {len(pairs)} ({shown}{', ...' if len(pairs) > 5 else ''})")
    if result["stale_shards_removed"]:
        c.print(f"removed old shards: {', '.join(result['stale_shards_removed'])}")
    secs = result["seconds"]
    rate = result["bytes_copied"] / secs / 1e9 if secs > 0 else 0.0
    c.print(f"{result['n_tensors']} tensors, {fmt_bytes(result['bytes_copied'])} copied unchanged "
            f"in {secs:.2f} s ({rate:.2f} GB/s)")


def run(args) -> int:
    from k3kit.gguf.rewrite import parse_size, rewrite
    from k3kit.gguf.shards import Model
    from k3kit.progress import byte_progress

    rules = build_rules(args)
    max_shard = parse_size(args.split_max_size) if args.split_max_size else None
    with Model.open(args.model) as m:
        total = sum(t.nbytes for t in m.tensors.values())
    with byte_progress("rewrite", total, enabled=not args.json) as progress:
        result = rewrite(args.model, args.output, rules, max_shard_bytes=max_shard,
                         in_place=args.in_place, progress=progress)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        render(result)
    return 0
