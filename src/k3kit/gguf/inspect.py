"""What a GGUF model holds, from its headers alone: bytes by ggml type and by tensor role.

The question people ask of a K3 GGUF is "what is 4-bit and what is not": the routed experts
are MXFP4 from quantization-aware training, the trunk is Q8_0 (or a requantized Q4_K), and
the split decides what fits on a GPU. So the report is a role x type matrix in bytes, plus
the architecture facts (which layers are KDA, which MLA) read from the KVs. Roles come
from `k3kit.gguf.format.role_of`, the one table requant also uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict, cast

import numpy as np
from gguf import GGUFValueType

from k3kit.gguf.format import ROLES, layer_of, role_of
from k3kit.gguf.reader import KV, TensorInfo, kv_array
from k3kit.gguf.shards import Model


class _LayerRow(TypedDict):
    """One layer's bytes in `inspect_model(..., layers=True)["layers"]` (before "layer"/"attention")."""

    tensors: int
    bytes: int
    by_role: dict[str, int]
    types: dict[str, int]


def _bucket() -> dict[str, int]:
    return {"tensors": 0, "bytes": 0}


def _add(table: dict[str, dict[str, int]], key: str, t: TensorInfo) -> None:
    b = table.setdefault(key, _bucket())
    b["tensors"] += 1
    b["bytes"] += t.nbytes


def _sorted_by_bytes(table: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["bytes"]))


def kv_summary(kvs: Iterable[KV]) -> dict[str, object]:
    """Scalar KVs as they are; arrays as {"type": element type, "length": n}."""
    out: dict[str, object] = {}
    for k in kvs:
        if k.vtype == GGUFValueType.ARRAY:
            out[k.key] = {"type": k.item_type.name if k.item_type else "?", "length": len(kv_array(k))}
        elif isinstance(k.value, float) and not np.isfinite(k.value):
            out[k.key] = str(k.value)
        else:
            out[k.key] = k.value
    return out


def _scalar(kvs: dict[str, KV], key: str) -> int | float | str | None:
    k = kvs.get(key)
    if k is None or k.vtype == GGUFValueType.ARRAY:
        return None
    return cast("int | float | str", k.value)  # what the reader gives a scalar KV (bool is an int)


def architecture(model: Model) -> dict[str, object]:
    """Facts a person checks first: arch, depth, KDA/MLA layer split, experts, vocab, context."""
    arch = model.arch
    kvs = model.kv
    layers = _scalar(kvs, f"{arch}.block_count")
    facts: dict[str, object] = {
        "arch": arch or None,
        "name": _scalar(kvs, "general.name"),
        "layers": layers,
        "kda_layers": None,
        "mla_layers": None,
        "experts": _scalar(kvs, f"{arch}.expert_count"),
        "experts_used": _scalar(kvs, f"{arch}.expert_used_count"),
        "shared_experts": _scalar(kvs, f"{arch}.expert_shared_count"),
        "vocab": None,
        "context": _scalar(kvs, f"{arch}.context_length"),
        "embedding": _scalar(kvs, f"{arch}.embedding_length"),
    }
    hkv = kvs.get(f"{arch}.attention.head_count_kv")
    if hkv is not None and hkv.vtype == GGUFValueType.ARRAY and hkv.item_type != GGUFValueType.STRING:
        per_layer = [int(v) for v in np.asarray(hkv.value).tolist()]
        facts["kda_layers"] = [i for i, v in enumerate(per_layer) if v == 0]
        facts["mla_layers"] = [i for i, v in enumerate(per_layer) if v != 0]
    tokens = kvs.get("tokenizer.ggml.tokens")
    if tokens is not None and tokens.vtype == GGUFValueType.ARRAY:
        facts["vocab"] = len(kv_array(tokens))
    else:
        facts["vocab"] = _scalar(kvs, f"{arch}.vocab_size")
    return facts


def inspect_model(model: Model, *, layers: bool = False) -> dict[str, object]:
    """The inspect result: one dict that both the human table and --json are printed from."""
    by_type: dict[str, dict[str, int]] = {}
    by_role: dict[str, dict[str, int]] = {r: _bucket() for r in ROLES}
    by_role_type: dict[str, dict[str, dict[str, int]]] = {r: {} for r in ROLES}
    files = []
    for i, f in enumerate(model.files):
        ft: dict[str, dict[str, int]] = {}
        for t in f.tensors:
            _add(ft, t.ggml_type.name, t)
        files.append({"path": str(model.paths[i]), "size": f.size, "version": f.version,
                      "alignment": f.alignment, "n_tensors": len(f.tensors),
                      "tensor_bytes": sum(t.nbytes for t in f.tensors), "by_type": _sorted_by_bytes(ft)})
    per_layer: dict[int, _LayerRow] = {}
    for t in model.tensors.values():
        tname = t.ggml_type.name
        role = role_of(t.name, len(t.shape))
        _add(by_type, tname, t)
        _add(by_role, role, t)
        _add(by_role_type[role], tname, t)
        if layers:
            n = layer_of(t.name)
            if n is not None:
                row = per_layer.setdefault(n, {"tensors": 0, "bytes": 0, "by_role": {}, "types": {}})
                row["tensors"] += 1
                row["bytes"] += t.nbytes
                row["by_role"][role] = row["by_role"].get(role, 0) + t.nbytes
                row["types"][tname] = row["types"].get(tname, 0) + t.nbytes

    arch = architecture(model)
    result: dict[str, object] = {
        "files": files,
        "architecture": arch,
        "n_tensors": len(model.tensors),
        "total_bytes": sum(t.nbytes for t in model.tensors.values()),
        "by_type": _sorted_by_bytes(by_type),
        "by_role": by_role,
        "by_role_type": {r: _sorted_by_bytes(v) for r, v in by_role_type.items()},
        "kv": kv_summary(model.kv.values()),
    }
    if layers:
        # architecture() sets both to a list of layer numbers or None
        kda = set(cast("list[int] | None", arch["kda_layers"]) or [])
        mla = set(cast("list[int] | None", arch["mla_layers"]) or [])
        rows = []
        for n in sorted(per_layer):
            row = per_layer[n]
            kind = "KDA" if n in kda else "MLA" if n in mla else None
            rows.append({"layer": n, "attention": kind, **row})
        result["layers"] = rows
    return result


def trunk_summary(result: dict[str, object]) -> tuple[int, dict[str, int]]:
    """Bytes of everything except routed experts, by type: what must fit on the GPU."""
    total = 0
    types: dict[str, int] = {}
    # role -> ggml type -> bucket, as inspect_model builds it
    by_role_type = cast("dict[str, dict[str, dict[str, int]]]", result["by_role_type"])
    for role, per_type in by_role_type.items():
        if role == "routed_experts":
            continue
        for tname, b in per_type.items():
            types[tname] = types.get(tname, 0) + b["bytes"]
            total += b["bytes"]
    return total, dict(sorted(types.items(), key=lambda kv: -kv[1]))
