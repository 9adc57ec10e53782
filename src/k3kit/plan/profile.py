"""Expert routing profiles: how often each MoE layer routes a token to each expert.

Uniform routing is the planner's default: a page cache holding a fraction f of a layer's
experts then hits with probability f. Real routing is skewed, so a recorded profile
(`k3kit bench --profile-experts OUT.json`, or anything writing this format) gives each expert
its own probability p_e = count_e / tokens of being chosen by one token; the planner then
keeps the hottest experts resident and counts the expected distinct experts of n verify rows
as sum_e 1 - (1 - p_e)^n (which is E * (1 - (1 - k/E)^n) when p_e = k/E).

Format (JSON, one object):

    {"format": "k3kit-expert-profile", "version": 1,
     "model": {"arch": "kimi-k3", "layers": 93, "experts": 896, "experts_used": 16,
               "name": "Kimi-K3"},             # name: optional, general.name of the recorded file
     "tokens": 4096,                        # tokens routed (each picks experts_used per layer)
     "layers": {"1": [c_0, ..., c_895], "2": [...], ...}}   # per MoE layer: times each expert was picked

Layers missing from "layers" are taken as uniform. A profile whose model block disagrees with
the model (architecture, layer or expert count, general.name when both have one, a layer that is
not an MoE layer) is refused: it was recorded on another model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3kit._io import read_json
from k3kit.errors import K3Error
from k3kit.plan.facts import ModelFacts

FORMAT = "k3kit-expert-profile"
VERSION = 1
MAX_PROFILE_BYTES = 256 << 20


@dataclass(frozen=True)
class Profile:
    path: Path
    tokens: int
    probs: dict[int, np.ndarray]   # MoE layer -> p_e per expert (sum = experts_used)

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "tokens": self.tokens, "layers": len(self.probs)}


def make_profile(facts: ModelFacts, tokens: int, counts: dict[int, list[int]]) -> dict[str, Any]:
    """The JSON object for `counts` (what a recorder writes; used by tests and bench)."""
    return {"format": FORMAT, "version": VERSION,
            "model": {"arch": facts.arch, "layers": facts.n_layer, "experts": facts.n_experts,
                      "experts_used": facts.experts_used} | ({"name": facts.name} if facts.name else {}),
            "tokens": tokens, "layers": {str(k): list(map(int, v)) for k, v in counts.items()}}


def load_profile(path: str | Path, facts: ModelFacts) -> Profile:
    p = Path(path)
    data = read_json(p, "expert profile", max_bytes=MAX_PROFILE_BYTES)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise K3Error(f"{p}: not a k3kit expert profile (expected \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise K3Error(f"{p}: profile version {data.get('version')!r}, this k3kit reads {VERSION}")
    m = data.get("model")
    if not isinstance(m, dict):
        raise K3Error(f"{p}: missing the \"model\" object")
    want = {"arch": facts.arch, "layers": facts.n_layer, "experts": facts.n_experts,
            "experts_used": facts.experts_used}
    for key, value in want.items():
        if m.get(key) != value:
            raise K3Error(f"{p}: profile is for another model ({key} {m.get(key)!r}, "
                          f"{facts.path.name} has {value!r})")
    name = m.get("name")
    if name is not None and facts.name is not None and name != facts.name:
        raise K3Error(f"{p}: profile is for another model (name {name!r}, {facts.path.name} is "
                      f"{facts.name!r})")
    tokens = data.get("tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise K3Error(f"{p}: \"tokens\" must be a whole number >= 1")
    layers = data.get("layers")
    if not isinstance(layers, dict):
        raise K3Error(f"{p}: \"layers\" must be an object of layer -> counts")
    moe = {la.index: la.n_experts for la in facts.moe_layers}
    probs: dict[int, np.ndarray] = {}
    for key, counts in layers.items():
        if not (isinstance(key, str) and key.isdigit()) or int(key) not in moe:
            raise K3Error(f"{p}: layer {key!r} is not an MoE layer of {facts.path.name} "
                          "(profile is for another model)")
        il = int(key)
        if (not isinstance(counts, list) or len(counts) != moe[il]
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)):
            raise K3Error(f"{p}: layer {il}: expected {moe[il]} counts >= 0")
        arr = np.asarray(counts, dtype=np.float64) / tokens
        if arr.max(initial=0.0) > 1.0 + 1e-9:
            raise K3Error(f"{p}: layer {il}: an expert was picked more often than there were tokens "
                          f"({tokens})")
        probs[il] = np.minimum(arr, 1.0)
    return Profile(p, tokens, probs)
