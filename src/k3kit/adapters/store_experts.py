"""`StoreExperts`: the ExpertProvider (k3kit.layers.moe) an engine hands its MoE layers, over an
ExpertStore.

Each layer's experts are multiplied where the store holds them (`device`): the layer's own
device, or the CPU for a layer the store keeps there while the layer itself runs on a GPU
(llama.cpp's --cpu-moe and --n-cpu-moe: the trunk in VRAM, the routed experts in RAM through the
native kernels). The MoE then moves its routed rows there and the result back, once per layer.
Model-neutral glue between the runtime's store and the layers' provider protocol: it knows the
store and torch devices, nothing of an architecture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from k3kit.kernels.gpu import TritonMatrix
from k3kit.layers.moe import ExpertWeights, MatmulWeight
from k3kit.runtime.experts import ExpertStore


class StoreExperts:
    """ExpertProvider backed by an ExpertStore; counts the distinct experts each forward asks for."""

    def __init__(self, store: ExpertStore, layer_dev: Sequence[torch.device]):
        self.store = store
        self.layer_dev = list(layer_dev)
        self.requests = 0

    def device(self, layer: int) -> torch.device:
        """Where `layer`'s experts are multiplied: the CPU where the store holds them there, else
        the layer's device (dequantized weights are moved to it)."""
        held = self.store.device_of(layer)
        return held if held.type == "cpu" else self.layer_dev[layer]

    def plan(self, layer: int, experts: list[int]) -> None:
        self.store.plan(layer, experts)      # the store reads each planned miss one expert ahead

    def prefetch(self, layer: int, experts: list[int]) -> None:
        self.store.prefetch(layer, experts)  # a guess: read in the background, cached only if asked

    def resident(self, layer: int, experts: Sequence[int]) -> bool:
        """Whether every one of `experts` is in the store's cache (fetching them reads and evicts
        nothing, so the weights of all of them can be held at once)."""
        return self.store.missing_bytes(layer, experts) == 0

    def get(self, layer: int, expert: int) -> ExpertWeights:
        weights = self.store.get(layer, [expert])[expert]   # the store drops a miss's pages
        self.requests += 1
        return self._on_device(layer, weights)

    def get_all(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        """`get` of each of `experts` (distinct, ascending: a routing's groups) in one store call."""
        got = self.store.get(layer, experts)
        self.requests += len(experts)
        return [self._on_device(layer, got[e]) for e in experts]

    def take_resident(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights] | None:
        """`plan` and `get_all` in one step where every one of `experts` (distinct, ascending) is
        cached for the CPU and the store reads nothing (ExpertStore.get_resident); else None."""
        if self.device(layer).type != "cpu":
            return None
        got = self.store.get_resident(layer, experts)
        if got is None:
            return None
        self.requests += len(experts)
        return [ExpertWeights(*w) for w in got]

    def _on_device(self, layer: int, weights: Sequence[Tensor | MatmulWeight]) -> ExpertWeights:
        dev = self.device(layer)
        if not any(isinstance(w, Tensor | TritonMatrix) and _device(w) != dev for w in weights):
            return ExpertWeights(*weights)
        # a layer split over devices: move the device's weights there (CPU-quantized ones stay)
        gate, up, down = (w.to(dev) if isinstance(w, Tensor | TritonMatrix) and _device(w) != dev else w
                          for w in weights)
        return ExpertWeights(gate, up, down)


def _device(w: Tensor | TritonMatrix) -> torch.device:
    return w.device if isinstance(w, Tensor) else w.raw.device
