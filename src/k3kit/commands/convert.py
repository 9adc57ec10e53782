"""`k3kit convert`: checkpoints in, GGUF out. Sub-commands: `target` (a Hugging Face Kimi-K3)."""

from __future__ import annotations

import argparse
import json

NAME = "convert"
HELP = "convert a checkpoint to GGUF (target: a Hugging Face Kimi-K3 directory)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="convert_command", metavar="KIND", required=True)
    t = sub.add_parser("target", help="a Hugging Face Kimi-K3 checkpoint -> kimi-k3 GGUF, as llama.cpp "
                       "converts it (MXFP4 experts repacked losslessly)")
    t.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json, model.safetensors "
                   "(or an index and shards) and tokenizer.json")
    t.add_argument("-o", "--out", required=True, metavar="OUT.gguf", help="output GGUF file")
    t.add_argument("--trunk-type", default="Q8_0", type=str.upper, choices=["Q8_0", "BF16", "F32"],
                   help="type of the trunk matrices (default Q8_0); norms, router and convs stay F32")
    t.add_argument("--name", default=None, help="general.name (default: HF_DIR's directory name)")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(_convert=_run_target)


def run(args: argparse.Namespace) -> int:
    return args._convert(args)


def _run_target(args: argparse.Namespace) -> int:
    from k3kit.convert.target import convert_target

    r = convert_target(args.hf_dir, args.out, args.trunk_type, progress=not args.json, name=args.name)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
        return 0
    types = ", ".join(f"{n} {t}" for t, n in r.type_counts.items())
    print(f"wrote {r.output}: {r.file_bytes / 1e6:.1f} MB, {r.tensors} tensors ({types}), {r.kvs} KVs, "
          f"in {r.seconds:.2f} s")
    print(f"routed experts: {r.expert_tensors} tensors, {r.expert_bytes / 1e6:.1f} MB, repacked as is; "
          f"trunk {r.trunk_type}")
    return 0
