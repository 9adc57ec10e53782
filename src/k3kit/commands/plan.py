"""`k3kit plan MODEL --gpu 24GiB ... --ram 128GiB`: what fits where, how fast it can decode (headers only)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

NAME = "plan"
HELP = ("plan a model on a machine from its headers alone: trunk layers on GPUs, KV/state, the drafter, "
        "experts in VRAM / page cache / storage, requant fixes, bandwidth-bound decode tok/s (AR and "
        "speculative) and the llama-server / k3kit serve command lines; exit 0 fits, 1 does not")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a .gguf file or any shard NAME-0000K-of-0000N.gguf")
    hw = parser.add_argument_group("machine (flags override a --hardware preset field by field)")
    hw.add_argument("--hardware", metavar="NAME|local|FILE.toml",
                    help="a preset: 8x5060ti, 2x3090 (the seed's boxes; CPU side assumed and printed), "
                         "local (measured: RAM, cores, memory and storage bandwidth, nvidia-smi GPUs), "
                         "or a TOML file")
    hw.add_argument("--gpu", action="append", metavar="SIZE",
                    help="one GPU's memory, e.g. 24GiB; repeat per GPU (replaces the preset's GPUs)")
    hw.add_argument("--ram", metavar="SIZE", help="CPU RAM, e.g. 128GiB (required without a preset)")
    hw.add_argument("--gpu-bw", metavar="BW", help="GPU memory bandwidth, every GPU (default 900GB/s)")
    hw.add_argument("--ram-bw", metavar="BW", help="RAM bandwidth (default 80GB/s)")
    hw.add_argument("--disk-bw", metavar="BW", help="storage sequential read bandwidth (default 7GB/s)")
    hw.add_argument("--pcie-bw", metavar="BW", help="host <-> GPU link bandwidth (default 25GB/s)")
    hw.add_argument("--nodes", type=int, default=None, metavar="N",
                    help="N identical machines joined by llama.cpp's RPC backend (rpc-server on each worker)")
    hw.add_argument("--gpu-reserve", default="1GiB", metavar="SIZE",
                    help="kept free on each GPU for the CUDA context and compute buffers (1GiB)")
    hw.add_argument("--ram-reserve", default="4GiB", metavar="SIZE",
                    help="kept free in RAM for the OS and the server process (4GiB)")
    run = parser.add_argument_group("workload")
    run.add_argument("--ctx", type=int, default=None, metavar="N",
                     help="context per sequence: sizes the MLA latent cache "
                          "(32768, or the model's if smaller)")
    d = run.add_mutually_exclusive_group()
    d.add_argument("--draft", metavar="D", help="the DSpark/DFlash draft GGUF (its bytes and KV are read)")
    d.add_argument("--draft-bytes", metavar="SIZE",
                   help="a drafter of this size instead of a file (e.g. 2.39GB, the K3 DSpark Q8_0)")
    run.add_argument("--tau", type=float, default=4.0, metavar="T",
                     help="tokens committed per verify pass (4; DSpark on K3 GSM8K: 5.42)")
    run.add_argument("--verify", type=int, default=8, metavar="N",
                     help="rows per verify pass (8: DSpark block 7 + the current token)")
    run.add_argument("--profile", metavar="P.json",
                     help="an expert routing profile of this model (hit rates and distinct experts from it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _hardware(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from k3kit.errors import K3Error
    from k3kit.gguf.shards import shard_paths
    from k3kit.plan.hardware import Hardware, preset, with_flags

    base = Hardware(name="flags")
    if args.hardware:
        try:
            paths = shard_paths(args.model)
        except K3Error:  # a bad shard name is reported when the model is opened
            paths = [Path(args.model)]
        base = preset(args.hardware, paths)
    return with_flags(base, gpus=args.gpu, gpu_bw=args.gpu_bw, ram=args.ram, ram_bw=args.ram_bw,
                      disk_bw=args.disk_bw, pcie_bw=args.pcie_bw, nodes=args.nodes)


def run(args: argparse.Namespace) -> int:
    from k3kit.plan import PlanOptions, make_plan
    from k3kit.plan.units import parse_size

    hw = _hardware(args)
    opts = PlanOptions(
        ctx=args.ctx, tau=args.tau, verify=args.verify, draft=args.draft,
        draft_bytes=parse_size(args.draft_bytes, "--draft-bytes") if args.draft_bytes is not None else None,
        profile=args.profile, gpu_reserve=_reserve(args.gpu_reserve, "--gpu-reserve"),
        ram_reserve=_reserve(args.ram_reserve, "--ram-reserve"))
    result = make_plan(args.model, hw, opts)
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=_json_default)
        sys.stdout.write("\n")
    else:
        render(result)
    return 0 if result["fits"] else 1


def _reserve(text: str, flag: str) -> int:
    from k3kit.plan.units import parse_size

    return 0 if text.strip() in ("0", "0B") else parse_size(text, flag)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"cannot serialise {type(o).__name__}")


def _ranges(rs: list[list[int]], n_layer: int) -> str:
    parts = []
    for a, b in rs:
        names = ["output" if x == n_layer else str(x) for x in (a, b)]
        parts.append(names[0] if a == b else f"{names[0]}-{names[1]}")
    return ",".join(parts) or "-"


def render(r: dict[str, Any], out: Any = None) -> None:
    from k3kit.plan.units import fmt_bw, fmt_bytes, fmt_gib, fmt_seconds

    out = out or sys.stdout

    def p(line: str = "") -> None:
        out.write(line + "\n")

    m, hw = r["model"], r["hardware"]
    more = f" (+{m['shards'] - 1} shards)" if m["shards"] > 1 else ""
    p(f"{m['path']}{more}")
    p(f"  {m['arch']}: {m['layers']} layers ({m['kda_layers']} KDA, {m['mla_layers']} MLA), "
      f"{m['experts']} experts top-{m['experts_used']} in {m['moe_layers']} MoE layers, hidden {m['hidden']}")
    gpus = hw["gpus"]
    gdesc = (f"{len(gpus)}x {gpus[0]['name']} {fmt_gib(gpus[0]['memory_bytes'])} @ "
             f"{fmt_bw(gpus[0]['bandwidth_bytes_s'])}") if gpus and all(g == gpus[0] for g in gpus) else (
        ", ".join(f"{g['name']} {fmt_gib(g['memory_bytes'])}" for g in gpus) or "no GPU")
    nodes = f"{hw['nodes']} nodes x " if hw["nodes"] > 1 else ""
    p(f"hardware {hw['name']}: {nodes}{gdesc}; RAM {fmt_gib(hw['ram_bytes'])} @ "
      f"{fmt_bw(hw['ram_bw_bytes_s'])}; storage {fmt_bw(hw['disk_bw_bytes_s'])}; "
      f"PCIe {fmt_bw(hw['pcie_bw_bytes_s'])}; {hw['cores'] or '?'} cores")
    for note in hw["notes"]:
        p(f"  {note}")
    types = ", ".join(f"{t} {fmt_bytes(b)}" for t, b in r["trunk_by_type"].items())
    p(f"trunk (all but routed experts, as inspect): {fmt_bytes(r['trunk_bytes'])} ({types}); routed experts "
      f"{fmt_bytes(r['routed_expert_bytes'])} ({fmt_bytes(m['expert_bytes'])} per expert)")
    kv = r["kv_state"]
    p(f"KV/state at ctx {kv['ctx']}: MLA latents {fmt_bytes(kv['mla_bytes'])} "
      f"({fmt_bytes(kv['mla_bytes_per_token'])} per token, grows with ctx), KDA state "
      f"{fmt_bytes(kv['kda_state_bytes'])} (fixed)")
    if r["draft"]:
        dr = r["draft"]
        kvd = (f" + KV {fmt_bytes(dr['kv_bytes'])}" if dr["kv_bytes_per_token"]
               else " (KV not counted: no file)")
        p(f"drafter: {dr['path'] or 'by size'} {fmt_bytes(dr['bytes'])}{kvd} on {dr['device']}")

    pl = r["placement"]
    p()
    p(f"placement: -ngl {pl['ngl']} of {pl['units']} units ({pl['layers_on_gpu']} layers on GPUs, "
      f"output layer on {pl['output_layer']}, token_embd in RAM)")
    n_layer = m["layers"]
    for d in r["devices"]:
        what = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d["contents"].items())
        layers = _ranges(d["layers"], n_layer)
        exp = f" experts of {_ranges(d['expert_layers'], n_layer)}" if d["expert_layers"] else ""
        p(f"  {d['name']:>12s} {d['model'][:14]:14s} {fmt_gib(d['capacity_bytes']):>11s}  used "
          f"{fmt_bytes(d['used_bytes']):>10s}  free {fmt_bytes(d['free_bytes']):>10s}  "
          f"layers {layers}{exp}: {what}")
    e = pl["experts"]
    p(f"  experts: {len(e['gpu_layers'])} layers in VRAM ({fmt_bytes(e['gpu_bytes'])}), page cache "
      f"{fmt_bytes(e['ram_bytes'])} ({100 * e['resident_fraction']:.1f}% of the RAM-backed), storage "
      f"{fmt_bytes(e['storage_bytes'])}")
    io = r.get("expert_io")
    if io:
        how = "O_DIRECT into k3kit's expert cache" if io["mode"] == "direct" else "the page cache (mapped)"
        tok_s = io["decode_tok_s"]
        p(f"  expert I/O (k3kit --expert-io auto): {io['mode']}, {how}: routed experts "
          f"{fmt_bytes(io['routed_expert_bytes'])} vs {fmt_bytes(io['ram_left_bytes'])} of RAM left for "
          "them; "
          f"expert cache {fmt_bytes(io['cache_bytes'])}; predicted decode "
          f"{f'{tok_s:.3g}' if tok_s else '?'} tok/s (AR, bandwidth bound)")
    p()
    p("FITS" if r["fits"] else "DOES NOT FIT")
    for prob in r["problems"]:
        p(f"  - {prob}")
    if r["requant"]:
        p("requant suggestions (routed experts stay MXFP4, byte for byte):")
        for s in r["requant"]:
            inc = " + token_embd/output" if s["include"] else ""
            after = s["decode_tok_s_after"]
            spec = f", spec {after['speculative']:.3g}" if after["speculative"] is not None else ""
            p(f"  -> {s['to']}{inc}: trunk {fmt_bytes(s['trunk_bytes_after'])} (saves "
              f"{fmt_bytes(s['saved_bytes'])}): {'fits' if s['fits_after'] else 'does not fit'}; "
              f"AR {after['ar']:.3g} tok/s{spec}")
    p()
    p("decode, bandwidth bound:")
    for line in r["speed"]["formula"]:
        p(f"  {line}")
    for key, label in (("ar", "AR (1 row, 1 token per pass)"), ("speculative", "speculative")):
        est = r["speed"][key]
        if est is None:
            continue
        if key == "speculative":
            label = f"speculative ({est['rows']} rows, tau {est['tokens_per_pass']:g} per pass)"
        p(f"  {label}: {est['tok_s']:.3g} tok/s, {fmt_seconds(est['seconds_per_pass'])} per pass, bound by "
          f"{est['bound_by']} (ceiling {est['ceiling_tok_s']:.3g} tok/s if all overlapped); storage "
          f"{fmt_bytes(est['storage_bytes_per_token'])} per token")
        for t in est["terms"]:
            bw = fmt_bw(t["bandwidth_bytes_s"]) if t["bandwidth_bytes_s"] else "-"
            secs = fmt_seconds(t["seconds"])
            p(f"    {t['name']:38s} {fmt_bytes(t['bytes']):>11s} / {bw:>12s} = {secs:>9s}")
    p()
    c = r["commands"]
    p("commands:")
    for cmd in c.get("rpc", []):
        p(f"  {cmd}")
    p(f"  {c['llama_server']}")
    p(f"  {c['k3kit']}")
    for note in c["notes"]:
        p(f"  # {note}")
