"""inspect: roles, byte accounting against an independent count, architecture facts, CLI output."""

from __future__ import annotations

import json

import gguf
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_factories import k3_like_specs

from k3kit.cli import main
from k3kit.gguf.inspect import ROLES, inspect_model, role_of
from k3kit.gguf.shards import Model


@pytest.mark.parametrize("name,shape,role", [
    ("blk.1.ffn_gate_exps.weight", (7168, 3072, 896), "routed_experts"),
    ("blk.1.ffn_down_exps.weight", (3072, 3584, 896), "routed_experts"),
    ("blk.1.ffn_up_shexp.weight", (7168, 3072), "shared_experts"),
    ("blk.1.ffn_gate_inp.weight", (7168, 896), "router"),
    ("blk.1.exp_probs_b.bias", (896,), "router"),
    ("blk.1.ffn_gate_inp_shexp.weight", (7168,), "router"),
    ("blk.0.attn_q.weight", (7168, 4096), "attention"),
    ("blk.3.attn_kv_a_mqa.weight", (7168, 576), "attention"),
    ("blk.3.attn_k_b.weight", (128, 512, 64), "attention"),
    ("blk.0.ssm_conv1d_q.weight", (4, 1, 4096), "attention"),
    ("blk.0.ssm_f_a.weight", (7168, 128), "attention"),
    ("blk.0.ssm_a", (64,), "norms_biases"),
    ("blk.0.ssm_dt.bias", (4096,), "norms_biases"),
    ("blk.0.attn_norm.weight", (7168,), "norms_biases"),
    ("blk.0.ffn_gate.weight", (7168, 18432), "dense_ffn"),
    ("blk.0.ffn_down.weight", (18432, 7168), "dense_ffn"),
    ("blk.2.ffn_routed_down.weight", (7168, 3584), "dense_ffn"),
    ("token_embd.weight", (7168, 163840), "embeddings_output"),
    ("output.weight", (7168, 163840), "embeddings_output"),
    ("output_norm.weight", (7168,), "norms_biases"),
    ("fc.weight", (35840, 7168), "other"),
])
def test_role_of(name, shape, role):
    assert role_of(name, len(shape)) == role


def test_inspect_counts_match_an_independent_tally(k3_sharded):
    m = Model.open(k3_sharded[1])
    res = inspect_model(m, layers=True)
    # independent tally straight from gguf-py's reader over every shard
    by_type: dict[str, list[int]] = {}
    n = 0
    for p in k3_sharded:
        for t in gguf.GGUFReader(p).tensors:
            e = by_type.setdefault(Q(t.tensor_type).name, [0, 0])
            e[0] += 1
            e[1] += int(t.n_bytes)
            n += 1
    assert res["n_tensors"] == n
    assert {k: [v["tensors"], v["bytes"]] for k, v in res["by_type"].items()} == by_type
    assert res["total_bytes"] == sum(b for _, b in by_type.values())
    assert sum(r["bytes"] for r in res["by_role"].values()) == res["total_bytes"]
    assert list(res["by_role"]) == list(ROLES)
    assert [f["n_tensors"] for f in res["files"]] == [len(gguf.GGUFReader(p).tensors) for p in k3_sharded]
    _, specs = k3_like_specs()
    exps = [s for s in specs if "_exps" in s.name]
    assert res["by_role"]["routed_experts"] == {"tensors": len(exps), "bytes": sum(s.nbytes for s in exps)}
    assert set(res["by_role_type"]["routed_experts"]) == {"MXFP4"}
    assert res["by_role_type"]["dense_ffn"]["Q8_0"]["tensors"] == 3
    layers = res["layers"]
    assert [r["attention"] for r in layers] == ["KDA", "KDA", "KDA", "MLA"]
    assert sum(r["bytes"] for r in layers) == res["total_bytes"] - sum(
        s.nbytes for s in specs if not s.name.startswith("blk."))


def test_architecture_facts(k3_model):
    a = inspect_model(Model.open(k3_model))["architecture"]
    assert a["arch"] == "kimi-k3" and a["layers"] == 4
    assert a["kda_layers"] == [0, 1, 2] and a["mla_layers"] == [3]
    assert (a["experts"], a["experts_used"], a["vocab"], a["context"]) == (4, 2, 96, 4096)


def test_json_cli(k3_model, capsys):
    assert main(["inspect", str(k3_model), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"files", "architecture", "n_tensors", "total_bytes", "by_type", "by_role", "kv"} <= set(out)
    assert out["kv"]["tokenizer.ggml.tokens"] == {"type": "STRING", "length": 96}
    assert out["kv"]["kimi-k3.attention.head_count_kv"] == {"type": "UINT32", "length": 4}
    assert out["kv"]["kimi-k3.block_count"] == 4
    assert "layers" not in out
    assert main(["inspect", str(k3_model), "--json", "--layers"]) == 0
    assert len(json.loads(capsys.readouterr().out)["layers"]) == 4


def test_human_output_shows_the_matrix(k3_sharded, capsys):
    assert main(["inspect", str(k3_sharded[0]), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "routed_experts" in out and "MXFP4" in out and "Q8_0" in out
    assert "trunk (all but routed experts)" in out and "routed experts:" in out and "MXFP4 100%" in out
    assert "KDA layers: 3 (0, 1, 2)" in out and "MLA layers: 1 (3)" in out
    assert k3_sharded[-1].name in out  # the shard table
