"""Bandwidth-bound decode speed: the bytes a token (or a verify pass) touches, over where they live.

A decode step reads every trunk weight once, its KV cache and KDA state, and the routed experts
the token picks; with nothing to reuse between steps (one sequence), time is bytes over
bandwidth. Terms, each bytes / bandwidth of the resource holding them:

    t_pass(n) = trunk_gpu / gpu_bw + kv_state / gpu_bw          (weights and state, GPU layers)
              + trunk_ram / ram_bw                              (layers left in RAM, token_embd row)
              + experts_gpu(n) / gpu_bw                          (expert layers in VRAM)
              + experts_hit(n) / ram_bw + experts_miss(n) / disk_bw   (page cache vs storage)
              + activations(n) / pcie_bw                          (hidden states crossing devices)
              [+ drafter / its device's bw]                      (speculative: one draft forward per pass)

experts(n) per MoE layer = sum_e (1 - (1 - p_e)^n) x expert bytes: the expected distinct experts
n rows touch; uniform p_e = k/E gives E (1 - (1 - k/E)^n), k experts for one token. AR is n = 1
and commits 1 token per pass; speculative verifies n rows and commits tau: tok/s = tau / t_pass(n).

The terms are added (a layer-by-layer decode uses one resource after another); `ceiling`
is the limit if they overlapped perfectly (tokens / the largest resource time). `bound_by` is
the resource with the largest time. Compute, latency and network hops are not modelled: this is
an upper bound on what bandwidth allows, to compare with `bench`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from k3kit.plan.facts import DraftFacts, ModelFacts
from k3kit.plan.hardware import Hardware
from k3kit.plan.placement import Placement, expert_probs
from k3kit.plan.profile import Profile
from k3kit.plan.units import fmt_bytes

ACT_BYTES = 4  # f32 hidden state per row crossing a device boundary
RESOURCES = ("gpu", "ram", "storage", "pcie")


@dataclass
class Term:
    name: str
    resource: str
    bytes: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        bw = self.bytes / self.seconds if self.seconds else None
        return {"name": self.name, "resource": self.resource, "bytes": round(self.bytes),
                "bandwidth_bytes_s": bw, "seconds": self.seconds}


def distinct(p: np.ndarray, n: int) -> np.ndarray:
    """Per expert: the probability that at least one of n rows routes to it."""
    return 1.0 - (1.0 - p) ** n


def pass_terms(facts: ModelFacts, hw: Hardware, pl: Placement, n: int, draft: DraftFacts | None,
               profile: Profile | None) -> tuple[list[Term], dict[str, float]]:
    """The terms of one target pass over n rows (+ the drafter when given); and expert figures."""
    ctx = pl.ctx
    nl = facts.n_layer
    acc: dict[str, list[float]] = {}

    def add(name: str, resource: str, nbytes: float, bw: float) -> None:
        b = acc.setdefault(f"{resource}\0{name}", [0.0, 0.0])
        b[0] += nbytes
        b[1] += nbytes / bw if nbytes else 0.0

    for u in range(nl + 1):
        where = pl.unit_device[u] if u in pl.unit_device else "ram"
        on_gpu = where != "ram"
        bw = pl.device(where).bandwidth if on_gpu else hw.ram_bw
        res = "gpu" if on_gpu else "ram"
        if u == nl:
            add(f"trunk weights ({'GPU' if on_gpu else 'RAM'})", res, facts.output_bytes, bw)
            continue
        la = facts.layers[u]
        add(f"trunk weights ({'GPU' if on_gpu else 'RAM'})", res, la.trunk_bytes, bw)
        # decode reads the whole MLA cache; a KDA state is read and written once per pass
        add(f"KV cache + KDA state ({'GPU' if on_gpu else 'RAM'})", res,
            la.kv_bytes_per_token * ctx + 2 * la.state_bytes, bw)
    add("token_embd rows (RAM)", "ram", n * facts.input_row_bytes, hw.ram_bw)
    # RAM short: what does not stay resident of the RAM layers is paged in from storage every pass
    ram_trunk = acc.get("ram\0trunk weights (RAM)", [0.0, 0.0])[0]
    moved = min(max(-pl.ram.free, 0), ram_trunk)
    if moved:
        add("trunk weights (RAM)", "ram", -moved, hw.ram_bw)
        add("trunk paged in (storage, RAM short)", "storage", moved, hw.disk_bw)

    tiers = pl.experts
    hit_b = miss_b = gpu_b = 0.0
    d_sum = 0.0
    for la in facts.moe_layers:
        p = expert_probs(facts, la, profile)
        d = distinct(p, n)
        d_sum += float(d.sum())
        unit = la.expert_unit_bytes
        if la.index in tiers.gpu_layers:
            b = float(d.sum()) * unit
            gpu_b += b
            add("routed experts (VRAM)", "gpu", b, pl.device(tiers.gpu_layers[la.index]).bandwidth)
            continue
        r = tiers.resident[la.index]
        hit = float(d[r].sum()) if isinstance(r, np.ndarray) else float(d.sum()) * r
        hit_b += hit * unit
        miss_b += (float(d.sum()) - hit) * unit
    add("routed experts hit (page cache)", "ram", hit_b, hw.ram_bw)
    add("routed experts miss (storage)", "storage", miss_b, hw.disk_bw)

    # hidden states crossing devices: each change of device along the layers, and each MoE layer
    # whose experts are not on its trunk's device (to the CPU and back)
    crossings = 0
    prev = "ram"  # the input layer
    for u in range(nl + 1):
        here = pl.unit_device.get(u, "ram")
        crossings += here != prev
        prev = here
        if u < nl and facts.layers[u].moe:
            exp_dev = tiers.gpu_layers.get(u, "ram")
            crossings += 2 * (exp_dev != here)
    add("activations across devices (PCIe)", "pcie", crossings * n * facts.n_embd * ACT_BYTES, hw.pcie_bw)

    if draft is not None:
        dev = pl.draft_device or "ram"
        bw = pl.device(dev).bandwidth if dev != "ram" else hw.ram_bw
        add(f"drafter weights + KV ({'GPU' if dev != 'ram' else 'RAM'})", "gpu" if dev != "ram" else "ram",
            draft.bytes + draft.kv_bytes_per_token * ctx, bw)

    terms = [Term(k.split("\0", 1)[1], k.split("\0", 1)[0], b, s) for k, (b, s) in acc.items() if b > 0]
    figures = {"distinct_experts_per_layer": d_sum / max(len(facts.moe_layers), 1),
               "expert_bytes": hit_b + miss_b + gpu_b, "storage_bytes": miss_b + moved,
               "ram_expert_bytes": hit_b, "gpu_expert_bytes": gpu_b}
    return terms, figures


def estimate(facts: ModelFacts, hw: Hardware, pl: Placement, *, rows: int, tokens: float,
             draft: DraftFacts | None, profile: Profile | None) -> dict[str, Any]:
    """tok/s of passes over `rows` rows committing `tokens` tokens each, with every term."""
    terms, fig = pass_terms(facts, hw, pl, rows, draft, profile)
    by_res = {r: sum(t.seconds for t in terms if t.resource == r) for r in RESOURCES}
    total = sum(by_res.values())
    bound = max(by_res, key=lambda r: by_res[r])
    return {
        "rows": rows, "tokens_per_pass": tokens, "seconds_per_pass": total,
        "tok_s": tokens / total if total else None,
        "ceiling_tok_s": tokens / by_res[bound] if by_res[bound] else None,
        "bound_by": bound, "seconds_by_resource": by_res,
        "distinct_experts_per_layer": fig["distinct_experts_per_layer"],
        "expert_bytes_per_pass": fig["expert_bytes"],
        "storage_bytes_per_token": fig["storage_bytes"] / tokens,
        "bytes_per_pass": sum(t.bytes for t in terms),
        "terms": [t.to_dict() for t in terms], "_terms": terms,
    }


def formulas(facts: ModelFacts, pl: Placement, *, rows: int, tau: float, draft: bool,
             profile: Profile | None) -> list[str]:
    """The formula lines printed above the terms, with the model's numbers put in."""
    moe = facts.moe_layers
    if not moe:
        return ["t_token = sum of bytes / bandwidth over the terms below; tok/s = 1 / t_token"]
    k, E, unit = facts.experts_used, moe[0].n_experts, moe[0].expert_unit_bytes
    d_uni = E * (1 - (1 - k / E) ** rows)
    hit = pl.experts.resident_fraction
    lines = [
        "t_pass = sum over terms of bytes / bandwidth (resources used one after another); "
        "AR: tok/s = 1 / t_pass(1); speculative: tok/s = tau / t_pass(n)",
        f"experts per token = {len(moe)} MoE layers x k={k} x {fmt_bytes(unit)} = "
        f"{fmt_bytes(len(moe) * k * unit)}",
        f"distinct experts per layer for n={rows} verify rows: E(1-(1-k/E)^n) = "
        f"{E} x (1 - (1 - {k}/{E})^{rows}) = {d_uni:.1f} ({d_uni / k:.2f}x one token)"
        + (" under uniform routing; the profile's p_e give the figures below" if profile else ""),
        f"experts in VRAM: {len(pl.experts.gpu_layers)} layers; page cache holds "
        f"{fmt_bytes(pl.experts.ram_bytes)} = {100 * hit:.1f}% of the RAM-backed expert bytes "
        + ("(the hottest experts of the profile)" if profile
           else "(hit rate = resident fraction, uniform routing)"),
    ]
    if draft:
        lines.append(f"speculative: n={rows} rows per pass, tau={tau:g} tokens committed per pass, "
                     "one drafter forward per pass")
    return lines
