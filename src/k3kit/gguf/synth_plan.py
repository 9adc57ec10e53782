"""The plan of a synthetic kimi-k3 model: its KVs, tensor specs (lazy sources) and shard layout,
checked and computed before any byte is generated.

Separate from writing (k3kit.gguf.synth_write) because a plan is useful by itself: tests compare
it with what was written, and a benchmark names the file a geometry gives without writing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from gguf import GGMLQuantizationType

from k3kit.errors import K3Error
from k3kit.gguf.reader import KV, align_up, tensor_nbytes
from k3kit.gguf.synth_geometry import (
    GEOMETRIES,
    MAX_EXPERTS,
    MAX_LAYERS,
    Geometry,
    build_kv,
    mla_layers,
    tensor_shapes,
)
from k3kit.gguf.synth_pools import Pools, _source
from k3kit.gguf.synth_types import Types, apply_types
from k3kit.gguf.synth_vocab import make_vocab
from k3kit.gguf.writer import TensorSpec

ALIGNMENT = 32


@dataclass
class SynthPlan:
    """Everything that will be written: KVs, tensor specs (lazy sources), the shard layout."""

    geometry: Geometry
    n_layers: int
    n_experts: int
    mla_layers: list[int]
    kv: list[KV]
    tensors: list[TensorSpec]
    layout: list[list[str]]  # with a metadata shard, layout[0] is empty
    types: Types = field(default_factory=Types)
    trunk_kept_q8_0: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _geometry_for(geometry: Geometry | str, vocab: int | None) -> Geometry:
    if isinstance(geometry, str):
        if geometry not in GEOMETRIES:
            raise K3Error(f"--geometry {geometry}: expected one of {', '.join(GEOMETRIES)}")
        geometry = GEOMETRIES[geometry]
    if vocab is not None:
        geometry = replace(geometry, vocab=vocab)
    return geometry


def _check_counts(n_layers: int, n_experts: int, shards: int, seed: int) -> None:
    if not 2 <= n_layers <= MAX_LAYERS:
        raise K3Error(f"--layers {n_layers}: need 2..{MAX_LAYERS} (at least one KDA and one MLA layer)")
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise K3Error(f"--experts {n_experts}: need 1..{MAX_EXPERTS}")
    if not 1 <= shards <= 0xFFFF:
        raise K3Error(f"--shards {shards}: need 1..65535")
    if not 0 <= seed < 2**63:
        raise K3Error(f"--seed {seed}: need 0 <= seed < 2**63")


def balanced_layout(names: list[str], sizes: list[int], shards: int) -> list[list[str]]:
    """Split tensors (in order) into `shards` non-empty groups of roughly equal bytes.

    Each tensor goes to the shard its byte midpoint falls in, then the assignment is clamped
    so it never skips a shard and leaves enough tensors for the shards after it.
    """
    n = len(names)
    if shards > n:
        raise K3Error(f"--shards {shards}: the model has only {n} tensors")
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    cum, prev = 0, 0
    for j, (name, size) in enumerate(zip(names, sizes, strict=True)):
        mid = cum + size / 2
        s = min(int(mid * shards / total) if total else 0, shards - 1)
        s = min(max(s, prev), prev + 1 if j else 0)
        s = max(s, shards - (n - j))
        groups[s].append(name)
        cum += size
        prev = s
    return groups


def plan(geometry: Geometry | str, n_layers: int, n_experts: int, *, vocab: int | None = None,
         shards: int = 1, seed: int = 0, name: str | None = None, types: Types | None = None,
         metadata_shard: bool = False) -> SynthPlan:
    """The KVs, tensor specs and shard layout of a synthetic kimi-k3 model (nothing is generated yet).

    With metadata_shard, `shards` counts the first file, which holds the KVs and no tensors
    (as split.count does), and the tensors are balanced over the other shards - 1.
    """
    _check_counts(n_layers, n_experts, shards, seed)
    if metadata_shard and shards < 2:
        raise K3Error(f"--metadata-shard needs --shards >= 2 (the first shard holds no tensors), "
                      f"got {shards}")
    types = types or Types()
    g = _geometry_for(geometry, vocab)
    name = name or default_name(g, n_layers, n_experts, types)
    voc = make_vocab(g.vocab)
    kvs = build_kv(g, n_layers, n_experts, name, voc, file_type=types.file_type)
    shapes, kept = apply_types(tensor_shapes(g, n_layers, n_experts), types, g.name)
    largest: dict[GGMLQuantizationType, int] = {}
    for _, shape, qtype in shapes:
        largest[qtype] = max(largest.get(qtype, 0), tensor_nbytes(shape, qtype))
    pools = Pools(seed, largest)
    specs = []
    for tname, shape, qtype in shapes:
        nbytes = tensor_nbytes(shape, qtype)
        n_elem = int(np.prod(shape))
        source = _source(pools, tname, qtype, nbytes, n_elem, seed)
        specs.append(TensorSpec(tname, shape, qtype, nbytes, source))
    sizes = [align_up(t.nbytes, ALIGNMENT) for t in specs]
    if metadata_shard:
        layout = [[], *balanced_layout([t.name for t in specs], sizes, shards - 1)]
    else:
        layout = balanced_layout([t.name for t in specs], sizes, shards)
    return SynthPlan(g, n_layers, n_experts, mla_layers(n_layers, g.mla_every), kvs, specs, layout,
                     types, kept)


def default_name(g: Geometry, n_layers: int, n_experts: int, types: Types | None = None) -> str:
    return f"kimi-k3-synth-{g.name}-{n_layers}L-{n_experts}E{(types or Types()).suffix()}"
