"""`--profile-experts`: count, over the measured runs, how often each layer routes to each expert.

Every routed-expert module of the target (a `k3kit.layers.moe.RoutedMoE`, found by its
`count_routes`/`route_counts` interface, so bench never imports the layers) counts the rows
routed to each expert while recording; the sums become a profile in `k3kit.plan.profile`'s
format, which `k3kit plan --profile` and `generate/serve --pin-experts` read. `tokens` is the
number of rows routed per layer (prompt rows, decoded rows and verify rows alike): each row
picks experts_used experts, so every layer's counts sum to tokens x experts_used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from k3kit._io import write_json
from k3kit.errors import K3Error
from k3kit.gguf.shards import Model
from k3kit.plan.facts import read_facts
from k3kit.plan.profile import make_profile


def routed_modules(root: Any) -> list[Any]:
    """The modules under `root` (an nn.Module, or an adapter holding one as `.model`) that count routes."""
    module = root if hasattr(root, "modules") else getattr(root, "model", None)
    if module is None or not hasattr(module, "modules"):
        return []
    return [m for m in module.modules() if callable(getattr(m, "count_routes", None)) and hasattr(m, "layer")]


class RouteRecorder:
    """Sums route counts across runs (and model reloads) per MoE layer."""

    def __init__(self) -> None:
        self.counts: dict[int, np.ndarray] = {}
        self._live: list[Any] = []

    def start(self, session: Any) -> None:
        mods = routed_modules(session.target.model)
        if not mods:
            raise K3Error(f"{session.target.path}: --profile-experts: the model has no routed-expert layers "
                          "that count routes")
        for m in mods:
            m.count_routes(True)
        self._live = mods

    def stop(self) -> None:
        for m in self._live:
            c = m.route_counts
            if c is not None:
                arr = c.detach().cpu().numpy().astype(np.int64)
                prev = self.counts.get(int(m.layer))
                self.counts[int(m.layer)] = arr if prev is None else prev + arr
            m.count_routes(False)
        self._live = []

    def write(self, model_path: Path, out: Path) -> dict[str, Any]:
        """The profile of everything recorded, written atomically to `out`; returns it."""
        with Model.open(model_path) as model:
            facts = read_facts(model)
        k = facts.experts_used
        moe = {la.index: la.n_experts for la in facts.moe_layers}
        if not self.counts:
            raise K3Error(f"{out}: no routes were recorded (no tokens ran through the experts)")
        tokens = set()
        for layer, c in self.counts.items():
            if layer not in moe or len(c) != moe[layer]:
                raise K3Error(f"{model_path}: routed layer {layer} does not match the file's headers")
            tokens.add(int(c.sum()) // max(k, 1))
        if len(tokens) != 1:
            raise K3Error(f"{model_path}: layers routed different row counts {sorted(tokens)}")
        profile = make_profile(facts, tokens.pop(), {la: c.tolist() for la, c in sorted(self.counts.items())})
        write_json(out, profile)
        return profile
