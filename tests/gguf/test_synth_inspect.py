"""`inspect` on a 32-shard synthetic K3 agrees to the byte with an independent count.

The independent count opens every shard with gguf-py's GGUFReader and sums its tensors'
n_bytes, per file, per ggml type and per role (roles from k3kit.gguf.format, so the two
role classifiers are also checked to agree). The CLI's --json is checked against the same
numbers.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from gguf import GGUFReader

from k3kit.cli import main
from k3kit.gguf import format as fmt
from k3kit.gguf import synth
from k3kit.gguf.inspect import inspect_model
from k3kit.gguf.shards import Model


@pytest.fixture(scope="module")
def shards32(tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("synth32")
    result = synth.synthesize(out, "mini", 6, 16, shards=32, seed=11, vocab=2048, progress=False)
    assert len(result.paths) == 32
    return [Path(p) for p in result.paths]


def _independent(paths: list[Path]) -> dict:
    per_file, by_type, by_role = [], defaultdict(int), defaultdict(int)
    n = 0
    for p in paths:
        reader = GGUFReader(p)
        per_file.append(sum(int(t.n_bytes) for t in reader.tensors))
        for t in reader.tensors:
            by_type[t.tensor_type.name] += int(t.n_bytes)
            by_role[fmt.role_of(t.name, len(t.shape))] += int(t.n_bytes)
            n += 1
    return {"per_file": per_file, "total": sum(per_file), "by_type": dict(by_type),
            "by_role": dict(by_role), "n_tensors": n}


def test_inspect_agrees_with_gguf_py_to_the_byte(shards32):
    want = _independent(shards32)
    with Model.open(shards32[17]) as model:
        got = inspect_model(model)
    assert got["n_tensors"] == want["n_tensors"]
    assert got["total_bytes"] == want["total"]
    assert [f["tensor_bytes"] for f in got["files"]] == want["per_file"]
    assert [f["size"] for f in got["files"]] == [p.stat().st_size for p in shards32]
    assert {k: v["bytes"] for k, v in got["by_type"].items()} == want["by_type"]
    assert {k: v["bytes"] for k, v in got["by_role"].items() if v["bytes"]} == want["by_role"]
    assert set(want["by_role"]) == {"routed_experts", "shared_experts", "attention", "dense_ffn",
                                    "router", "embeddings_output", "norms_biases"}


def test_inspect_cli_json_agrees(shards32, capsys):
    want = _independent(shards32)
    assert main(["inspect", str(shards32[0]), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["total_bytes"] == want["total"]
    assert [f["tensor_bytes"] for f in got["files"]] == want["per_file"]
    assert got["architecture"]["mla_layers"] == [3, 5]
    assert got["architecture"]["experts"] == 16
