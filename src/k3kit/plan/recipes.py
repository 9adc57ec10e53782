"""The command lines that realize a placement: llama-server (+ rpc-server per worker), k3kit serve, requant.

llama-server gets the placement exactly: `-ngl` = units offloaded (the last layers plus the output
layer), `--tensor-split` = units per device in llama.cpp's device order (RPC devices first),
`--n-cpu-moe N` keeps the experts of the first N layers in RAM and `-ot` puts the expert layers
the plan gives VRAM on their GPU; `-md`/`-devd`/`-ngld` for the drafter. `LLAMA_MMAP_NO_PREFETCH=1`
is the seed's llama.cpp patch (no populate of the 1.4 TB mapping); `--no-repack` keeps llama.cpp
from copying mapped experts into anonymous buffers bigger than RAM.

k3kit serve is what k3kit's own runtime does with the same box: the seed's split where its quantized
trunk fits the GPUs (the file's bytes in VRAM, every routed expert in RAM through the expert cache:
`--cpu-moe`), else everything from the CPU; the plan's RAM budget for experts is its expert cache.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from k3kit.plan.facts import DraftFacts, ModelFacts
from k3kit.plan.hardware import Hardware
from k3kit.plan.placement import Placement
from k3kit.plan.units import fmt_bytes

RPC_PORT = 50052
EXPERT_RE = r"ffn_(up|down|gate)_exps\.weight"


def _q(x: str | Path) -> str:
    return shlex.quote(str(x))


def _alternation(layers: list[int]) -> str:
    return "|".join(str(i) for i in sorted(layers))


def llama_server(facts: ModelFacts, hw: Hardware, pl: Placement, *, ctx: int, draft: DraftFacts | None,
                 draft_path: str | None) -> tuple[str, list[str]]:
    notes: list[str] = []
    cmd = ["LLAMA_MMAP_NO_PREFETCH=1", "llama-server", "-m", _q(facts.paths[0]), "-c", str(ctx), "-fa", "on"]
    gpus = pl.gpus
    if gpus:
        cmd += ["-ngl", str(pl.ngl)]
        counts = [len(g.units) for g in gpus]
        if len(gpus) > 1 and pl.ngl:
            cmd += ["--tensor-split", ",".join(map(str, counts))]
    else:
        cmd += ["-ngl", "0"]
    # experts: the first layers' in RAM (--n-cpu-moe), VRAM expert layers by -ot on their device
    gpu_exp = pl.experts.gpu_layers
    if facts.moe_layers:
        first_gpu = min(gpu_exp) if gpu_exp else facts.n_layer
        cmd += ["--n-cpu-moe", str(first_gpu)]
        by_dev: dict[str, list[int]] = {}
        for il, dev in gpu_exp.items():
            by_dev.setdefault(pl.device(dev).label, []).append(il)
        for label, layers in sorted(by_dev.items()):
            cmd += ["-ot", _q(rf"blk\.({_alternation(layers)})\.{EXPERT_RE}={label}")]
    cmd += ["--no-repack"]
    if hw.cores:
        cmd += ["-t", str(hw.cores)]
    if draft is not None:
        cmd += ["-md", _q(draft_path or "DRAFT.gguf")]
        if pl.draft_device and pl.draft_device != "ram":
            cmd += ["-ngld", "99", "-devd", pl.device(pl.draft_device).label]
        else:
            cmd += ["-ngld", "0", "-devd", "none"]
        cmd += ["--spec-type", "draft-dspark"]
    if hw.nodes > 1:
        cmd += ["--rpc", ",".join(f"NODE{j}:{RPC_PORT}" for j in range(1, hw.nodes))]
        notes.append("llama.cpp lists RPC devices before local ones: --tensor-split gives the workers' GPUs "
                     "their layers first (check with --list-devices and the load log)")
        notes.append("the workers' RAM holds no experts in this plan (RPC buffers are allocated and filled "
                     "over the network, not mapped): experts stream through the head's page cache; the "
                     "per-token network hops are not in the speed estimate")
    notes.append("LLAMA_MMAP_NO_PREFETCH=1 is the seed's llama.cpp patch (no MAP_POPULATE); without it "
                 "llama.cpp faults in the whole mapping and runs out of RAM when RAM < model")
    return " ".join(cmd), notes


def rpc_servers(hw: Hardware) -> list[str]:
    return [f"rpc-server -H 0.0.0.0 -p {RPC_PORT} -c   # on NODE{j}: expose its {len(hw.gpus)} GPU(s); "
            "trusted network only" for j in range(1, hw.nodes)]


def k3kit_serve(facts: ModelFacts, hw: Hardware, pl: Placement, *, ctx: int, draft: DraftFacts | None,
                draft_path: str | None, verify: int, gpu_reserve: int) -> tuple[str, list[str]]:
    """k3kit serve on the head node: the seed's split when the quantized trunk fits the GPUs (the
    trunk as the file's bytes in VRAM, multiplied by the Triton kernels; every routed expert in RAM
    through the expert cache, `--cpu-moe`), else everything on the CPU."""
    notes: list[str] = []
    cmd = ["k3kit", "serve", _q(facts.paths[0]), "--ctx", str(ctx)]
    gpus = [g for g in pl.gpus if g.node == 0]
    need = k3kit_gpu_need(facts, len(gpus), ctx) if gpus else []
    spare = [g.capacity - gpu_reserve - b for g, b in zip(gpus, need, strict=True)]
    cache = max(pl.experts.ram_bytes, 0)
    if gpus and min(spare) > 0:
        cmd += ["--device", ",".join(f"cuda:{i}" for i in range(len(gpus))), "--cpu-moe"]
        cache += min(pl.experts.gpu_bytes, max(pl.ram.free, 0))     # the plan's VRAM experts, in RAM here
        notes.append(f"k3kit holds the trunk as the file's bytes on the GPUs ({fmt_bytes(sum(need))} with "
                     "KV/state, layers split evenly, token_embd on cuda:0) and every routed expert in RAM, "
                     "multiplied on the CPU (--cpu-moe); the drafter runs on cuda:0")
    else:
        cmd += ["--device", "cpu", "--trunk", "quantized"]
        if gpus:
            worst = min(range(len(gpus)), key=lambda i: spare[i])
            notes.append(f"k3kit's even layer split would need {fmt_bytes(need[worst])} on cuda:{worst} of "
                         f"{fmt_bytes(gpus[worst].capacity - gpu_reserve)}, so this plan's GPU placement is "
                         "llama-server's; k3kit serves the trunk quantized from RAM")
    cmd += ["--expert-cache-mib", str(-(-cache // (1 << 20)))]
    if draft is not None:
        cmd += ["--draft", _q(draft_path or "DRAFT.gguf"), "--verify-budget", str(verify)]
    if hw.nodes > 1:
        notes.append("k3kit serve runs on one machine; the multi-node split is llama.cpp's RPC backend")
    return " ".join(cmd), notes


def k3kit_gpu_need(facts: ModelFacts, n_dev: int, ctx: int) -> list[int]:
    """Bytes per GPU of k3kit's quantized trunk (the file's bytes): runtime.loader.layer_devices'
    even split, token_embd on the first device, the output layer on the last, each layer's KV/state
    with it; the routed experts stay in RAM (--cpu-moe)."""
    need = [0] * n_dev
    n = facts.n_layer
    for la in facts.layers:
        need[min(n_dev - 1, la.index * n_dev // max(n, 1))] += la.trunk_bytes + la.kv_state_bytes(ctx)
    need[0] += facts.input_bytes
    need[-1] += facts.output_bytes
    return need


def requant_command(facts: ModelFacts, to: str, include: tuple[str, ...]) -> str:
    src = facts.paths[0]
    out = src.parent.with_name(f"{src.parent.name}-{to}") if src.parent.name else Path(f"out-{to}")
    inc = "".join(f" --include {_q(p)}" for p in include)
    return f"k3kit requant {_q(src)} -o {_q(out)} --to {to}{inc}"


def commands(facts: ModelFacts, hw: Hardware, pl: Placement, *, ctx: int, draft: DraftFacts | None,
             draft_path: str | None, verify: int, gpu_reserve: int) -> dict[str, Any]:
    llama, notes = llama_server(facts, hw, pl, ctx=ctx, draft=draft, draft_path=draft_path)
    k3, k3_notes = k3kit_serve(facts, hw, pl, ctx=ctx, draft=draft, draft_path=draft_path, verify=verify,
                               gpu_reserve=gpu_reserve)
    out: dict[str, Any] = {"k3kit": k3, "llama_server": llama}
    if hw.nodes > 1:
        out["rpc"] = rpc_servers(hw)
    out["notes"] = k3_notes + notes
    return out
