"""`k3kit synth`: the plan matches llama.cpp's kimi-k3 contract and the files read back exactly."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, TokenType

from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf import synth
from k3kit.gguf.shards import Model
from k3kit.gguf.writer import source_bytes


def _synth(out: Path, seed: int = 7, **kw):
    args = dict(geometry="mini", n_layers=4, n_experts=8, shards=3, seed=seed, progress=False)
    args.update(kw)
    return synth.synthesize(out, **args)


@pytest.fixture(scope="module")
def mini3(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    result = _synth(out)
    plan = synth.plan("mini", 4, 8, shards=3, seed=7)
    return result, plan


def _plan_bytes(spec) -> bytes:
    return source_bytes(spec).tobytes()


def test_files_are_sharded_like_the_plan(mini3):
    result, plan = mini3
    paths = [Path(p) for p in result.paths]
    assert [p.name for p in paths] == [f"kimi-k3-synth-mini-4L-8E-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert result.tensors == len(plan.tensors) and result.tensor_bytes == plan.nbytes
    with Model.open(paths[1]) as model:
        assert [len(f.tensors) for f in model.files] == [len(g) for g in plan.layout]
        assert [[t.name for t in f.tensors] for f in model.files] == plan.layout
        sizes = [sum(t.nbytes for t in f.tensors) for f in model.files]
    assert max(sizes) < 2 * min(sizes), sizes  # split by bytes, roughly equal


def test_readback_with_k3kit_reader_matches_plan(mini3):
    result, plan = mini3
    with Model.open(result.paths[0]) as model:
        assert list(model.tensors) == [t.name for t in plan.tensors]
        for spec in plan.tensors:
            info = model.tensors[spec.name]
            assert (info.shape, info.ggml_type, info.nbytes) == (spec.shape, spec.ggml_type, spec.nbytes)
        for name in ("token_embd.weight", "blk.1.ffn_up_exps.weight", "blk.0.ssm_a", "output.weight"):
            spec = next(t for t in plan.tensors if t.name == name)
            assert model.view(name).tobytes() == _plan_bytes(spec)
        plan_kv = {k.key: k for k in plan.kv}
        assert set(model.kv) == set(plan_kv)
        for key, item in plan_kv.items():
            got = model.kv[key]
            assert (got.vtype, got.item_type) == (item.vtype, item.item_type), key
            if isinstance(item.value, np.ndarray):
                assert np.array_equal(np.asarray(got.value), item.value), key
            elif isinstance(item.value, float):
                assert got.value == pytest.approx(item.value, rel=1e-6), key
            else:
                assert got.value == item.value, key


def test_readback_with_gguf_py(mini3):
    result, plan = mini3
    specs = {t.name: t for t in plan.tensors}
    seen = []
    for i, path in enumerate(result.paths):
        reader = GGUFReader(path)
        assert int(reader.fields["split.no"].parts[-1][0]) == i
        assert int(reader.fields["split.count"].parts[-1][0]) == 3
        for t in reader.tensors:
            spec = specs[t.name]
            assert tuple(int(d) for d in t.shape) == spec.shape
            assert t.tensor_type == spec.ggml_type
            assert int(t.n_bytes) == spec.nbytes
            seen.append(t.name)
        if i == 0:
            assert reader.fields["general.architecture"].contents() == "kimi-k3"
            assert len(reader.fields["tokenizer.ggml.tokens"].data) == 1024
    assert seen == [t.name for t in plan.tensors]


def test_names_and_kv_types_are_what_llama_cpp_kimi_k3_loads(mini3):
    result, _ = mini3
    with Model.open(result.paths[0]) as model:
        assert fmt.check_kv_types("kimi-k3", model.kv) == []
        assert fmt.kimi_k3_check_names(set(model.tensors), model.kv) == []
        layout = fmt.kimi_k3_layout_from_kv(model.kv)
    assert layout == {"n_layer": 4, "mla_layers": {3}, "n_dense_lead": 1, "attn_res": True, "latent": True}


def test_roles_and_types(mini3):
    _, plan = mini3
    roles = Counter(fmt.role_of(t.name, len(t.shape)) for t in plan.tensors)
    # 4 layers: 0 dense, 1-3 MoE; 0-2 KDA, 3 MLA
    assert roles["routed_experts"] == 3 * 3
    assert roles["shared_experts"] == 3 * 3
    assert roles["router"] == 3 * 2
    assert roles["embeddings_output"] == 2
    assert roles["dense_ffn"] == 3 + 3 * 2          # layer 0 FFN + latent down/up
    # KDA: 3 conv + q, k, v, f_a, f_b, beta, g, out; MLA: q_a, q_b, kv_a_mqa, k_b, v_b, gate, out
    assert roles["attention"] == 3 * 11 + 7
    assert roles["other"] == 0
    for t in plan.tensors:
        role = fmt.role_of(t.name, len(t.shape))
        if role == "routed_experts":
            assert t.ggml_type == Q.MXFP4
        elif role in ("norms_biases", "router") or "conv1d" in t.name:
            assert t.ggml_type == Q.F32, t.name
        else:
            assert t.ggml_type == Q.Q8_0, t.name
        assert fmt.is_trunk_matrix(t.name, len(t.shape)) == (t.ggml_type == Q.Q8_0)
        assert fmt.converter_keeps_f32(t.name, len(t.shape)) == (t.ggml_type == Q.F32), t.name


def test_random_blocks_are_valid_and_small(mini3):
    _, plan = mini3
    by_name = {t.name: t for t in plan.tensors}

    def values(name):
        t = by_name[name]
        raw = source_bytes(t)
        return gguf.quants.dequantize(raw.reshape(t.shape[::-1][:-1] + (-1,)), t.ggml_type).reshape(-1)

    q8 = values("blk.0.attn_q.weight")
    assert np.isfinite(q8).all() and 0.005 < np.abs(q8).max() <= 0.026 and q8.std() > 0.003
    mx = values("blk.1.ffn_up_exps.weight")
    assert np.isfinite(mx).all() and 0.01 < np.abs(mx).max() <= 0.047
    assert len(np.unique(mx)) > 20
    assert np.array_equal(values("blk.0.attn_norm.weight"), np.ones(256, np.float32))
    ssm_a = values("blk.0.ssm_a")
    assert ((ssm_a <= -1.0) & (ssm_a >= -16.0)).all()
    bias = values("blk.1.exp_probs_b.bias")
    assert np.isfinite(bias).all() and np.abs(bias).max() < 0.1
    # different tensors are different windows of the pool
    assert values("blk.0.attn_k.weight")[:64].tolist() != q8[:64].tolist()


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()


def test_deterministic_given_seed(tmp_path):
    a = _synth(tmp_path / "a", seed=3, n_layers=2, n_experts=4, shards=2)
    b = _synth(tmp_path / "b", seed=3, n_layers=2, n_experts=4, shards=2)
    c = _synth(tmp_path / "c", seed=4, n_layers=2, n_experts=4, shards=2)
    assert _digest(a.paths) == _digest(b.paths)
    assert _digest(a.paths) != _digest(c.paths)
    with Model.open(a.paths[0]) as ma, Model.open(c.paths[0]) as mc:
        layout_a = [(t.name, t.offset) for t in ma.tensors.values()]
        assert layout_a == [(t.name, t.offset) for t in mc.tensors.values()]
        name = "blk.1.ffn_gate_exps.weight"
        assert ma.view(name).tobytes() != mc.view(name).tobytes()


def test_k3_geometry_plan_has_real_dimensions():
    plan = synth.plan("k3", 93, 896)
    specs = {t.name: t for t in plan.tensors}
    assert len(plan.mla_layers) == 24 and plan.mla_layers[-1] == 92 and plan.mla_layers[0] == 3
    assert specs["blk.1.ffn_up_exps.weight"].shape == (3584, 3072, 896)
    assert specs["blk.1.ffn_down_exps.weight"].shape == (3072, 3584, 896)
    assert specs["blk.0.attn_q.weight"].shape == (7168, 96 * 128)
    assert specs["blk.3.attn_q_b.weight"].shape == (1536, 96 * 192)
    assert specs["blk.3.attn_k_b.weight"].shape == (128, 512, 96)
    assert specs["token_embd.weight"].shape == (7168, 163840)
    routed = sum(t.nbytes for t in plan.tensors if fmt.is_routed_expert(t.name))
    trunk = sum(t.nbytes for t in plan.tensors if fmt.is_trunk_matrix(t.name, len(t.shape)))
    assert 1.3e12 < routed < 1.5e12           # notes: ~1.36 TB of MXFP4 experts
    assert 58e9 < trunk < 61e9                 # notes: Q8_0 trunk ~59.6 GB
    kv = {k.key: k for k in plan.kv}
    assert kv["kimi-k3.expert_used_count"].value == 16
    assert kv["kimi-k3.attention.key_length"].value == 512 + 64
    assert fmt.check_kv_types("kimi-k3", kv) == []
    assert fmt.kimi_k3_check_names(set(specs), kv) == []


def test_layer_pattern_always_has_kda_and_mla():
    assert synth.mla_layers(2) == [1]
    assert synth.mla_layers(4) == [3]
    assert synth.mla_layers(9) == [3, 7, 8]
    with pytest.raises(K3Error, match="--layers 1"):
        synth.plan("mini", 1, 8)


def test_balanced_layout():
    names = [f"t{i}" for i in range(10)]
    groups = synth.balanced_layout(names, [10] * 10, 3)
    assert [len(g) for g in groups] == [3, 4, 3] and sum(groups, []) == names
    # one huge tensor first: no shard may be empty, order is kept
    groups = synth.balanced_layout(names, [1000] + [1] * 9, 4)
    assert all(groups) and sum(groups, []) == names and groups[0] == ["t0"]
    assert synth.balanced_layout(names[:3], [5, 5, 5], 3) == [["t0"], ["t1"], ["t2"]]
    with pytest.raises(K3Error, match="only 3 tensors"):
        synth.balanced_layout(names[:3], [5, 5, 5], 4)


def test_vocab_is_byte_level_bpe():
    v = synth.make_vocab(1024)
    assert len(v.tokens) == 1024 == len(set(v.tokens)) == len(v.token_types)
    b2u = synth.bytes_to_unicode()
    assert v.tokens[:256] == [b2u[b] for b in range(256)] and len(set(b2u.values())) == 256
    tokens = set(v.tokens)
    for m in v.merges:
        a, b = m.split(" ")
        assert a in tokens and b in tokens and a + b in tokens
    assert v.token_types[v.bos] == v.token_types[v.eos] == int(TokenType.CONTROL)
    assert v.tokens[v.bos] == "[BOS]" and v.tokens[v.eos] == "[EOS]"
    big = synth.make_vocab(163840)
    assert (big.bos, big.eos) == (163584, 163585)  # K2/K3's ids
    with pytest.raises(K3Error, match="--vocab"):
        synth.make_vocab(100)


def test_cli_json_and_errors(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["synth", "-o", str(out), "--geometry", "mini", "--layers", "2", "--experts", "4",
                 "--shards", "2", "--vocab", "600", "--name", "tiny", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [Path(p).name for p in result["paths"]] == ["tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"]
    assert result["vocab"] == 600 and result["mla_layers"] == [1]
    assert result["file_bytes"] == sum(Path(p).stat().st_size for p in result["paths"])
    assert main(["synth", "-o", str(out / "x"), "--geometry", "mini", "--layers", "3", "--experts", "0"]) == 2
    assert "--experts 0" in capsys.readouterr().err
    assert not (out / "x").exists()
    (tmp_path / "file").write_text("")
    assert main(["synth", "-o", str(tmp_path / "file"), "--geometry", "mini", "--layers", "2",
                 "--experts", "2"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["synth", "-o", str(out / "y"), "--geometry", "mini", "--layers", "2", "--experts", "2",
                 "--seed", "-1"]) == 2
    assert "--seed -1" in capsys.readouterr().err
    assert main(["synth", "-o", str(out / "z"), "--geometry", "mini", "--layers", "2", "--experts", "2",
                 "--name", "../escape"]) == 2
    assert "must be a plain file name" in capsys.readouterr().err
    assert not (out / "z").exists() and not (out / "y").exists()
    assert sorted(p.name for p in out.iterdir()) == ["tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"]
