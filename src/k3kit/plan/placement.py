"""Where everything goes: trunk layers on GPUs, the drafter's device, experts in GPU / RAM / storage.

The placement is llama.cpp's, so its command line can realize it exactly:

* Units are the model's layers plus the output layer (unit n_layer), each with its weights
  and its KV/state for the context (an MLA layer's latent cache grows with ctx, a KDA layer's
  recurrent state does not). `-ngl G` puts the LAST G units on GPUs (llama.cpp offloads from
  the end); they fill the GPUs in order, each GPU taking units until the next does not fit
  (that is what `--tensor-split` with per-device unit counts does). The token embedding stays
  in RAM (llama.cpp never offloads the input layer; a token reads one row).
* The drafter goes on a GPU that still holds it once the trunk is placed (the last GPU first);
  if no GPU can take it without pushing trunk layers off, it runs from RAM.
* Whole layers of routed experts go into the VRAM left over, last layer first (`-ot` per
  device; llama.cpp places tensors, not single experts). Everything else is routed-expert
  bytes on storage, mapped: RAM not committed to anything else is the page cache holding the
  experts that were read last (LRU; with uniform routing the hit rate is the resident
  fraction, with a profile the hottest experts are the resident ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3kit.plan.facts import DraftFacts, LayerFacts, ModelFacts
from k3kit.plan.hardware import Hardware
from k3kit.plan.profile import Profile
from k3kit.plan.units import fmt_bytes

GiB = 1 << 30


@dataclass
class Device:
    name: str                  # gpu0, node1.gpu0, ram
    kind: str                  # "gpu" or "ram"
    label: str                 # llama.cpp's device name (CUDA0; RPC devices are named by llama.cpp)
    model: str
    node: int
    capacity: int
    reserve: int
    bandwidth: float
    contents: dict[str, int] = field(default_factory=dict)
    units: list[int] = field(default_factory=list)      # layers (n_layer = the output layer)
    expert_layers: list[int] = field(default_factory=list)

    @property
    def used(self) -> int:
        return sum(self.contents.values())

    @property
    def free(self) -> int:
        return self.capacity - self.reserve - self.used

    def add(self, what: str, nbytes: int) -> None:
        if nbytes:
            self.contents[what] = self.contents.get(what, 0) + nbytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "device": self.label, "model": self.model,
                "node": self.node, "capacity_bytes": self.capacity, "reserve_bytes": self.reserve,
                "used_bytes": self.used, "free_bytes": self.free, "bandwidth_bytes_s": self.bandwidth,
                "layers": _ranges(self.units), "expert_layers": _ranges(self.expert_layers),
                "contents": dict(self.contents)}


@dataclass
class ExpertTiers:
    """Per MoE layer: where its experts are and, for RAM-backed layers, which are resident."""

    gpu_layers: dict[int, str]                   # layer -> device name
    resident_fraction: float                     # of the RAM-backed expert bytes
    resident: dict[int, np.ndarray | float]      # layer -> boolean mask (profile) or fraction (uniform)
    ram_bytes: int                               # expert bytes resident in the page cache
    gpu_bytes: int
    storage_bytes: int                           # expert bytes not resident anywhere


@dataclass
class Placement:
    devices: list[Device]      # GPUs in llama.cpp's order (RPC devices first), then RAM last
    ram: Device
    ngl: int                   # units offloaded (llama.cpp -ngl)
    unit_device: dict[int, str]
    draft_device: str | None
    experts: ExpertTiers
    fits: bool
    problems: list[str]
    ctx: int

    @property
    def gpus(self) -> list[Device]:
        return [d for d in self.devices if d.kind == "gpu"]

    def device(self, name: str) -> Device:
        return next(d for d in self.devices if d.name == name)


def _ranges(xs: list[int]) -> list[list[int]]:
    """[1, 2, 3, 7] -> [[1, 3], [7, 7]]."""
    out: list[list[int]] = []
    for x in sorted(xs):
        if out and out[-1][1] == x - 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return out


def make_gpus(hw: Hardware, reserve: int) -> list[Device]:
    """Every GPU of every node, in llama.cpp's device order: RPC (worker) devices first, the head's last."""
    out = []
    for node in [*range(1, hw.nodes), 0]:
        for i, g in enumerate(hw.gpus):
            name = f"gpu{i}" if hw.nodes == 1 else f"node{node}.gpu{i}"
            label = f"CUDA{i}" if node == 0 else f"RPC(node{node}) CUDA{i}"
            out.append(Device(name, "gpu", label, g.name, node, g.memory, reserve, g.bandwidth))
    return out


def _fill(costs: list[int], first: int, free: list[int]) -> list[int] | None:
    """Units first..end into the devices in order (each takes units until the next does not fit)."""
    used = [0] * len(free)
    where = []
    d = 0
    for u in range(first, len(costs)):
        while d < len(free) and used[d] + costs[u] > free[d]:
            d += 1
        if d == len(free):
            return None
        used[d] += costs[u]
        where.append(d)
    return where


def _best_fill(costs: list[int], free: list[int]) -> tuple[int, list[int]]:
    """The most trailing units that fill the devices in order (binary search: a suffix of a fit fits)."""
    lo, hi = 0, len(costs)
    best: list[int] = []
    if not free:
        return 0, []
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = _fill(costs, len(costs) - mid, free)
        if got is not None:
            lo, best = mid, got
        else:
            hi = mid - 1
    return lo, best


def unit_costs(facts: ModelFacts, ctx: int) -> list[int]:
    return [la.trunk_bytes + la.kv_state_bytes(ctx) for la in facts.layers] + [facts.output_bytes]


def place(facts: ModelFacts, hw: Hardware, *, ctx: int, draft: DraftFacts | None, gpu_reserve: int,
          ram_reserve: int, profile: Profile | None) -> Placement:
    n = facts.n_layer
    gpus = make_gpus(hw, gpu_reserve)
    costs = unit_costs(facts, ctx)
    free = [max(g.capacity - g.reserve, 0) for g in gpus]
    draft_cost = draft.bytes + draft.kv_bytes_per_token * ctx if draft else 0

    ngl, where = _best_fill(costs, free)
    draft_gpu: int | None = None
    if draft and gpus:
        # the drafter on the head's GPUs (-devd names a local device), last first, where it costs no layer
        head_ids = [i for i, g in enumerate(gpus) if g.node == 0]
        for i in reversed(head_ids):
            if free[i] < draft_cost:
                continue
            f2 = list(free)
            f2[i] -= draft_cost
            ngl2, where2 = _best_fill(costs, f2)
            if ngl2 == ngl:
                draft_gpu, where = i, where2
                break

    unit_device: dict[int, str] = {}
    first = len(costs) - ngl
    for k, d in enumerate(where):
        u = first + k
        g = gpus[d]
        g.units.append(u)
        unit_device[u] = g.name
        if u == n:
            g.add("output layer", facts.output_bytes)
        else:
            la = facts.layers[u]
            g.add("trunk layers", la.trunk_bytes)
            g.add("KV cache (MLA)" if la.kind == "MLA" else "recurrent state (KDA)", la.kv_state_bytes(ctx))
    if draft_gpu is not None and draft is not None:
        gpus[draft_gpu].add("drafter", draft.bytes)
        gpus[draft_gpu].add("drafter KV", draft.kv_bytes_per_token * ctx)

    ram = Device("ram", "ram", "CPU", "RAM", 0, hw.ram or 0, ram_reserve, hw.ram_bw)
    ram.add("token_embd (input layer)", facts.input_bytes)
    for u in range(first):
        ram.units.append(u)
        unit_device[u] = "ram"
        if u == n:
            ram.add("output layer", facts.output_bytes)
        else:
            la = facts.layers[u]
            ram.add("trunk layers", la.trunk_bytes)
            ram.add("KV cache (MLA)" if la.kind == "MLA" else "recurrent state (KDA)", la.kv_state_bytes(ctx))
    draft_device: str | None = None
    if draft is not None:
        if draft_gpu is not None:
            draft_device = gpus[draft_gpu].name
        else:
            draft_device = "ram"
            ram.add("drafter", draft.bytes)
            ram.add("drafter KV", draft.kv_bytes_per_token * ctx)

    problems: list[str] = []
    if gpus and ngl < len(costs):
        need = sum(costs) + draft_cost
        have = sum(free)
        problems.append(f"the trunk does not fit the GPUs: {len(costs) - ngl} of {len(costs)} layers "
                        f"(with the output layer) stay in RAM; "
                        f"trunk + KV/state{' + drafter' if draft else ''} "
                        f"need {fmt_bytes(need)}, the GPUs have {fmt_bytes(have)} after "
                        f"{fmt_bytes(gpu_reserve)} reserved each")
    if gpus and draft is not None and draft_gpu is None:
        problems.append(f"the drafter ({fmt_bytes(draft_cost)} with its KV) fits on no GPU next to the "
                        "trunk: it runs from RAM")
    if ram.free < 0:
        problems.append(f"RAM is short by {fmt_bytes(-ram.free)}: {fmt_bytes(ram.used)} committed + "
                        f"{fmt_bytes(ram_reserve)} reserve > {fmt_bytes(ram.capacity)}")

    # whole layers of experts into the VRAM left over (only once the trunk is fully on the GPUs)
    gpu_layers: dict[int, str] = {}
    if gpus and ngl == len(costs) and (draft is None or draft_gpu is not None):
        head = [g for g in gpus if g.node == 0]
        for la in reversed(facts.moe_layers):
            room = max(head, key=lambda g: g.free)
            if room.free < la.expert_bytes:
                break
            room.add("routed experts", la.expert_bytes)
            room.expert_layers.append(la.index)
            gpu_layers[la.index] = room.name

    budget = max(ram.free, 0)
    tiers = _expert_tiers(facts, gpu_layers, budget, profile)
    ram.add("routed experts (page cache)", tiers.ram_bytes)
    return Placement(devices=[*gpus, ram], ram=ram, ngl=ngl, unit_device=unit_device,
                     draft_device=draft_device, experts=tiers, fits=not problems, problems=problems, ctx=ctx)


def _expert_tiers(facts: ModelFacts, gpu_layers: dict[int, str], budget: int,
                  profile: Profile | None) -> ExpertTiers:
    cpu_layers = [la for la in facts.moe_layers if la.index not in gpu_layers]
    gpu_bytes = sum(la.expert_bytes for la in facts.moe_layers if la.index in gpu_layers)
    cpu_bytes = sum(la.expert_bytes for la in cpu_layers)
    resident: dict[int, np.ndarray | float] = {}
    if not cpu_layers:
        return ExpertTiers(gpu_layers, 1.0, resident, 0, gpu_bytes, 0)
    if profile is None:
        ram_bytes = min(budget, cpu_bytes)
        f = ram_bytes / cpu_bytes if cpu_bytes else 1.0
        for la in cpu_layers:
            resident[la.index] = f
        return ExpertTiers(gpu_layers, f, resident, ram_bytes, gpu_bytes, cpu_bytes - ram_bytes)
    # the page cache keeps what is read most: the experts with the highest probability per byte
    probs = [expert_probs(facts, la, profile) for la in cpu_layers]
    units = np.concatenate([np.full(la.n_experts, la.expert_unit_bytes, dtype=np.float64)
                            for la in cpu_layers])
    p = np.concatenate(probs)
    order = np.argsort(-(p / np.maximum(units, 1)), kind="stable")
    taken = np.zeros(len(p), dtype=bool)
    cum = np.cumsum(units[order])
    taken[order[cum <= budget]] = True
    pos = 0
    for la in cpu_layers:
        resident[la.index] = taken[pos:pos + la.n_experts]
        pos += la.n_experts
    ram_bytes = int(units[taken].sum())
    fraction = ram_bytes / cpu_bytes if cpu_bytes else 1.0
    return ExpertTiers(gpu_layers, fraction, resident, ram_bytes, gpu_bytes, cpu_bytes - ram_bytes)


def expert_probs(facts: ModelFacts, la: LayerFacts, profile: Profile | None) -> np.ndarray:
    """p_e: the probability that one token routes to expert e of this layer (uniform: k/E)."""
    if profile is not None and la.index in profile.probs:
        return profile.probs[la.index]
    return np.full(la.n_experts, min(1.0, facts.experts_used / la.n_experts), dtype=np.float64)
