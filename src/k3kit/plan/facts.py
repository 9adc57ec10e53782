"""What a plan needs to know about a model, from its GGUF headers alone.

Bytes come from the same places `k3kit inspect` takes them (inspect_model's role x type
table, trunk_summary), so the two commands print the same numbers; a requantized trunk's bytes
come from the requant planner (`gguf.requant.plan.plan_tensors`), tensor by tensor, so a
suggestion is exactly what `k3kit requant --to T` would write (token_embd/output kept, rows
that are not whole 256-blocks kept, F32 kept). Nothing here reads a tensor's data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
from gguf import GGUFValueType, Keys

from k3kit.errors import K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf.inspect import inspect_model, trunk_summary
from k3kit.gguf.reader import KV
from k3kit.gguf.requant.plan import Options, plan_tensors
from k3kit.gguf.shards import Model

F16_BYTES = 2
F32_BYTES = 4

# The token embedding is a row lookup: llama.cpp keeps it on the CPU whatever -ngl says
# (llama_model: "there is very little benefit to offloading the input layer"); a token reads one row.
INPUT_TENSORS = frozenset({fmt.tensor_name(fmt.TOKEN_EMBD)})


@dataclass(frozen=True)
class LayerFacts:
    """One block: its trunk weights, its routed experts, and what its attention keeps per sequence."""

    index: int
    kind: str                  # "KDA" or "MLA"
    trunk_bytes: int           # every blk.N tensor except routed experts
    expert_bytes: int          # the stacked routed-expert tensors (all experts)
    expert_unit_bytes: int     # one expert: its gate + up + down slices (0 for a dense layer)
    n_experts: int             # 0 for a dense layer
    kv_bytes_per_token: int    # MLA: latent + rope key per token at f16; KDA: 0
    state_bytes: int           # KDA: recurrent state (fp32 heads x d_k x d_v) + conv windows; MLA: 0
    bf16_bytes: int = 0        # the trunk weights dequantized to 16 bits (k3kit's GPU path)

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def kv_state_bytes(self, ctx: int) -> int:
        return self.kv_bytes_per_token * ctx + self.state_bytes


@dataclass(frozen=True)
class ModelFacts:
    path: Path
    paths: tuple[Path, ...]
    arch: str
    name: str | None
    n_embd: int
    experts_used: int
    layers: tuple[LayerFacts, ...]
    input_bytes: int           # token_embd: stays in RAM
    input_row_bytes: int       # what one token reads of it
    output_bytes: int          # output, output_norm, output_res_score...: the "output layer"
    trunk_bytes: int           # all but routed experts (inspect's trunk line)
    trunk_by_type: dict[str, int]
    routed_expert_bytes: int
    total_bytes: int
    trunk_bf16_bytes: int      # the trunk dequantized to 16 bits (what k3kit's GPU path holds)
    input_bf16_bytes: int = 0
    output_bf16_bytes: int = 0
    requant: str | None = None  # set on a copy made by `requantized`
    requant_include: tuple[str, ...] = ()
    tensor_bytes: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def n_experts(self) -> int:
        return max((la.n_experts for la in self.layers), default=0)

    @property
    def moe_layers(self) -> list[LayerFacts]:
        return [la for la in self.layers if la.moe]

    def summary(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "arch": self.arch, "name": self.name, "shards": len(self.paths),
            "layers": self.n_layer,
            "kda_layers": sum(la.kind == "KDA" for la in self.layers),
            "mla_layers": sum(la.kind == "MLA" for la in self.layers),
            "moe_layers": len(self.moe_layers), "experts": self.n_experts, "experts_used": self.experts_used,
            "hidden": self.n_embd,
            "expert_bytes": self.moe_layers[0].expert_unit_bytes if self.moe_layers else 0,
        }


def _kv_value(kvs: Mapping[str, KV], key: str) -> object:
    item = kvs.get(key)
    return None if item is None else item.value


def _int_or_layers(kvs: Mapping[str, KV], key: str, n_layer: int, path: Path,
                   default: int | None = None) -> list[int]:
    """A per-layer integer key (a scalar, or an array of length block_count) as one int per layer."""
    item = kvs.get(key)
    if item is None:
        if default is None:
            raise K3Error(f"{path}: missing key {key}")
        return [default] * n_layer
    if item.vtype == GGUFValueType.ARRAY:
        if item.item_type in (GGUFValueType.STRING, None):
            raise K3Error(f"{path}: {key} is not an integer array")
        values = [int(v) for v in np.asarray(item.value).tolist()]
        if len(values) != n_layer:
            raise K3Error(f"{path}: {key} has {len(values)} entries for {n_layer} layers")
        return values
    if item.vtype in (GGUFValueType.STRING, GGUFValueType.BOOL):
        raise K3Error(f"{path}: {key} has type {item.vtype.name}, expected an integer")
    return [int(cast(int, item.value))] * n_layer


def _int(kvs: Mapping[str, KV], key: str, path: Path, default: int | None = None) -> int:
    item = kvs.get(key)
    if item is None:
        if default is None:
            raise K3Error(f"{path}: missing key {key}")
        return default
    if item.vtype in (GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.BOOL):
        raise K3Error(f"{path}: {key} has type {item.vtype.name}, expected an integer")
    return int(cast(int, item.value))


def open_model(path: str | Path) -> Model:
    """The model's shards, header-only; a directory or a missing file is a one-line error."""
    p = Path(path)
    if p.is_dir():
        raise K3Error(f"{p}: is a directory (give a .gguf file or any shard of one)")
    if not p.exists():
        raise K3Error(f"{p}: no such file")
    return Model.open(p)


def read_facts(model: Model) -> ModelFacts:
    """The facts of a kimi-k3 model: per-layer bytes, expert sizes, KV/state geometry."""
    path = model.paths[0]
    arch = model.arch
    if arch != fmt.ARCH_KIMI_K3:
        raise K3Error(f"{path}: architecture {arch or 'unknown'!r}: plan knows {fmt.ARCH_KIMI_K3!r} "
                      "(KDA + MLA + routed experts)")
    result = inspect_model(model)
    trunk_bytes, trunk_types = trunk_summary(result)
    by_role = cast("dict[str, dict[str, int]]", result["by_role"])
    return _facts(model, path, {t.name: t.nbytes for t in model.tensors.values()}, trunk_bytes,
                  trunk_types, by_role[fmt.ROLE_ROUTED_EXPERTS]["bytes"], cast(int, result["total_bytes"]))


def _facts(model: Model, path: Path, nbytes: dict[str, int], trunk_bytes: int, trunk_types: dict[str, int],
           expert_bytes: int, total_bytes: int) -> ModelFacts:
    kvs = model.kv
    a = model.arch
    L, A = Keys.LLM, Keys.Attention
    n_layer = _int(kvs, L.BLOCK_COUNT.format(arch=a), path)
    n_embd = _int(kvs, L.EMBEDDING_LENGTH.format(arch=a), path)
    head_kv = _int_or_layers(kvs, A.HEAD_COUNT_KV.format(arch=a), n_layer, path, default=0)
    heads = _int_or_layers(kvs, A.HEAD_COUNT.format(arch=a), n_layer, path)
    kv_lora = _int(kvs, A.KV_LORA_RANK.format(arch=a), path)
    rope = _int(kvs, Keys.Rope.DIMENSION_COUNT.format(arch=a), path, default=0)
    key_len = _int(kvs, A.KEY_LENGTH.format(arch=a), path, default=kv_lora + rope)
    kda_hd = _int(kvs, fmt.KEY_KDA_HEAD_DIM.format(arch=a), path)
    conv = _int(kvs, Keys.SSM.CONV_KERNEL.format(arch=a), path)
    used = _int_or_layers(kvs, L.EXPERT_USED_COUNT.format(arch=a), n_layer, path, default=0)

    trunk_per_layer = [0] * n_layer
    experts_per_layer = [0] * n_layer
    unit_per_layer = [0.0] * n_layer
    n_exp_per_layer = [0] * n_layer
    bf16_per_layer = [0] * n_layer
    input_bf16 = output_bf16 = 0
    input_bytes = output_bytes = 0
    input_row = 0
    for t in model.tensors.values():
        nb = nbytes[t.name]
        il = fmt.layer_of(t.name)
        if fmt.is_routed_expert(t.name):
            if il is None or not 0 <= il < n_layer:
                raise K3Error(f"{path}: routed-expert tensor '{t.name}' is outside the {n_layer} layers")
            e = t.shape[-1] if len(t.shape) >= 3 else 1
            experts_per_layer[il] += nb
            unit_per_layer[il] += nb / e
            n_exp_per_layer[il] = max(n_exp_per_layer[il], e)
            continue
        b16 = t.n_elements * (F32_BYTES if fmt.converter_keeps_f32(t.name, len(t.shape)) else F16_BYTES)
        if il is None:
            if t.name in INPUT_TENSORS:
                input_bytes += nb
                input_bf16 += b16
                input_row = nb // max(t.shape[-1], 1) if len(t.shape) >= 2 else nb
            else:
                output_bytes += nb
                output_bf16 += b16
        elif 0 <= il < n_layer:
            trunk_per_layer[il] += nb
            bf16_per_layer[il] += b16
        else:
            raise K3Error(f"{path}: tensor '{t.name}' names layer {il} of a {n_layer}-layer model")

    layers = []
    for i in range(n_layer):
        mla = head_kv[i] != 0
        d_inner = heads[i] * kda_hd
        # KDA: S is d_k x d_v per head in fp32, plus the q/k/v conv windows (kernel - 1 past inputs)
        state = 0 if mla else (heads[i] * kda_hd * kda_hd + 3 * d_inner * max(conv - 1, 0)) * F32_BYTES
        layers.append(LayerFacts(
            index=i, kind="MLA" if mla else "KDA", trunk_bytes=trunk_per_layer[i],
            expert_bytes=experts_per_layer[i], expert_unit_bytes=round(unit_per_layer[i]),
            n_experts=n_exp_per_layer[i] if used[i] else 0,
            kv_bytes_per_token=key_len * F16_BYTES if mla else 0, state_bytes=state,
            bf16_bytes=bf16_per_layer[i]))
    moe_used = [u for u, la in zip(used, layers, strict=True) if la.moe]
    name = _kv_value(kvs, Keys.General.NAME)
    return ModelFacts(
        path=path, paths=tuple(model.paths), arch=model.arch, name=name if isinstance(name, str) else None,
        n_embd=n_embd, experts_used=max(moe_used, default=0), layers=tuple(layers),
        input_bytes=input_bytes, input_row_bytes=input_row, output_bytes=output_bytes,
        trunk_bytes=trunk_bytes, trunk_by_type=trunk_types, routed_expert_bytes=expert_bytes,
        total_bytes=total_bytes, trunk_bf16_bytes=sum(bf16_per_layer) + input_bf16 + output_bf16,
        input_bf16_bytes=input_bf16, output_bf16_bytes=output_bf16, tensor_bytes=nbytes)


def requantized(model: Model, facts: ModelFacts, to: str, include: tuple[str, ...] = ()) -> ModelFacts:
    """The facts of the model `k3kit requant --to TO [--include ...]` would write (bytes only).

    Per tensor from the requant planner itself, shard by shard, so the kept tensors and the
    output sizes are its rules, not a re-derivation here.
    """
    opts = Options(to=to, include=include)
    nbytes = dict(facts.tensor_bytes)
    types: dict[str, int] = {}
    for f in model.files:
        for p in plan_tensors(f.path, f.tensors, opts):
            nbytes[p.name] = p.nbytes_out
            if not fmt.is_routed_expert(p.name):
                types[p.dst_type.name] = types.get(p.dst_type.name, 0) + p.nbytes_out
    trunk = sum(types.values())
    new = _facts(model, facts.path, nbytes, trunk, dict(sorted(types.items(), key=lambda kv: -kv[1])),
                 facts.routed_expert_bytes, trunk + facts.routed_expert_bytes)
    return replace(new, requant=opts.target.name, requant_include=include)



@dataclass(frozen=True)
class DraftFacts:
    """A DFlash/DSpark drafter: its weights, and the K/V it keeps per context token."""

    path: Path | None
    bytes: int
    kv_bytes_per_token: int    # 0 when unknown (--draft-bytes)
    layers: int | None = None

    def to_dict(self, ctx: int) -> dict[str, Any]:
        return {"path": str(self.path) if self.path else None, "bytes": self.bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_bytes": self.kv_bytes_per_token * ctx,
                "layers": self.layers}


def read_draft(path: str | Path) -> DraftFacts:
    """A draft GGUF's bytes and per-token K/V (layers x kv heads x (key + value length) at f16)."""
    with open_model(path) as m:
        if m.arch != fmt.ARCH_DFLASH:
            raise K3Error(f"{m.paths[0]}: architecture {m.arch or 'unknown'!r} is not a {fmt.ARCH_DFLASH!r} "
                          "draft")
        p, a, kvs = m.paths[0], m.arch, m.kv
        A = Keys.Attention
        n = _int(kvs, Keys.LLM.BLOCK_COUNT.format(arch=a), p)
        embd = _int(kvs, Keys.LLM.EMBEDDING_LENGTH.format(arch=a), p)
        heads = _int_or_layers(kvs, A.HEAD_COUNT.format(arch=a), n, p)
        kv_heads = _int_or_layers(kvs, A.HEAD_COUNT_KV.format(arch=a), n, p, default=heads[0])
        head_dim = embd // max(heads[0], 1)
        k_len = _int(kvs, A.KEY_LENGTH.format(arch=a), p, default=head_dim)
        v_len = _int(kvs, A.VALUE_LENGTH.format(arch=a), p, default=k_len)
        kv = sum(h * (k_len + v_len) * F16_BYTES for h in kv_heads)
        return DraftFacts(p, sum(t.nbytes for t in m.tensors.values()), kv, n)
