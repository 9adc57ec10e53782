"""`k3kit draft`: DFlash/DSpark drafts for llama.cpp. Sub-commands: `convert`, `fix`."""

from __future__ import annotations

import argparse
import json

NAME = "draft"
HELP = "DFlash/DSpark drafts: convert a safetensors draft to a dflash GGUF, or fix a legacy one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="draft_command", metavar="ACTION", required=True)
    c = sub.add_parser("convert", help="a Hugging Face DFlash/DSpark draft (safetensors) -> dflash GGUF")
    c.add_argument("src", metavar="SAFETENSORS_DIR", help="draft directory: config.json + model.safetensors "
                   "(or an index and shards)")
    c.add_argument("--target", required=True, metavar="TARGET.gguf",
                   help="the target GGUF (any shard): its tokenizer is copied into the draft")
    c.add_argument("-o", "--out", required=True, metavar="DRAFT.gguf", help="output GGUF file")
    c.add_argument("--type", default="Q8_0", type=str.upper, choices=["Q8_0", "BF16", "F32"],
                   help="type of the 2-D weights (default Q8_0); norms and 1-D tensors stay F32")
    c.add_argument("--mapping", default=None, metavar="FILE|FAMILY",
                   help="name mapping: dflash, dspark, k3_dspark or a TOML file (default: detected)")
    c.add_argument("--report", default=None, metavar="REPORT.json", help="also write the report as JSON")
    c.add_argument("--sample-rows", type=int, default=64, metavar="N",
                   help="rows per tensor dequantized to measure the relative RMSE (default 64)")
    c.add_argument("--name", default=None, help="general.name (default: the draft directory's name)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(_draft=_run_convert)

    f = sub.add_parser("fix", help="a legacy dflash-draft GGUF -> a dflash GGUF llama.cpp loads")
    f.add_argument("src", metavar="OLD.gguf", help="the legacy draft")
    f.add_argument("--target", required=True, metavar="TARGET.gguf",
                   help="the target GGUF: its tokenizer is copied into the draft")
    f.add_argument("-o", "--out", required=True, metavar="NEW.gguf", help="output GGUF file")
    f.add_argument("--json", action="store_true", help="print what changed as JSON")
    f.set_defaults(_draft=_run_fix)


def run(args: argparse.Namespace) -> int:
    return args._draft(args)


def _run_convert(args: argparse.Namespace) -> int:
    from k3kit.convert.draft import convert_draft, write_report

    r = convert_draft(args.src, args.target, args.out, out_type=args.type, mapping=args.mapping,
                      sample_rows=args.sample_rows, progress=not args.json, name=args.name)
    if args.report:
        write_report(r, args.report)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
    else:
        print(r.table())
    return 0


def _run_fix(args: argparse.Namespace) -> int:
    from k3kit.convert.draft_fix import fix_draft

    r = fix_draft(args.src, args.target, args.out)
    print(json.dumps(r.to_dict(), indent=2) if args.json else r.summary())
    return 0
