"""`k3kit synth` with the ggml types of published low-bit K3 files, a metadata shard, and sparse files.

Every generated block is decoded by gguf-py's dequantizers (the reference; bit-exact with
ggml), and the scale fields are read back at the byte offsets of ggml-common.h's block_*
structs, written out here independently of the generator.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, LlamaFileType
from gguf import GGMLQuantizationType as Q

from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.gguf import format as fmt
from k3kit.gguf import synth, synth_blocks
from k3kit.gguf.inspect import inspect_model, trunk_summary
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.shards import Model
from k3kit.gguf.writer import source_bytes

# fp16 scale fields per block type, from ggml-common.h (IQ1_M: see _iq1_m_d)
F16_OFFSETS = {
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ1_S: (0,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.TQ1_0: (52,), Q.TQ2_0: (64,), Q.Q8_0: (0,),
}
FP16_MIN_NORMAL = 6.103515625e-05


def _iq1_m_d(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M's d: the top nibbles of its four uint16 scales (at byte 48), scales[0] lowest."""
    sc = blocks[:, 48:56].copy().view("<u2")
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 12) << 4) | ((sc[:, 2] >> 12) << 8) | ((sc[:, 3] >> 12) << 12)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def _scales(blocks: np.ndarray, qtype: Q) -> list[np.ndarray]:
    if qtype == Q.IQ1_M:
        return [_iq1_m_d(blocks)]
    return [blocks[:, o:o + 2].copy().view("<f2").reshape(-1).astype(np.float32) for o in F16_OFFSETS[qtype]]


@pytest.mark.parametrize("qtype", sorted(synth_blocks.GENERATORS, key=int), ids=lambda q: q.name)
def test_blocks_decode_to_finite_weights_of_the_target_size(qtype):
    blocks = synth_blocks.random_blocks(qtype, 4096, np.random.default_rng(3))
    assert blocks.shape == (4096, GGML_QUANT_SIZES[qtype][1]) and blocks.dtype == np.uint8
    for s in _scales(blocks, qtype):
        assert np.isfinite(s).all() and (s >= FP16_MIN_NORMAL).all() and (s < 0.1).all(), qtype.name
    w = gguf.quants.dequantize(blocks, qtype)
    assert w.shape == (4096, GGML_QUANT_SIZES[qtype][0])
    assert np.isfinite(w).all()
    std = float(w.std())
    assert 0.0108 < std < 0.0132, std                       # TARGET_STD 0.012, like the Q8_0 pool
    assert abs(float(w.mean())) < 0.05 * std                 # centred: mins cancel the code offset
    assert np.abs(w).max() < 10 * synth_blocks.TARGET_STD    # no exploding block
    # per-block sizes vary (d drawn per block) and codes are random, not a constant pattern
    assert len(np.unique(w[:64])) > 3
    again = synth_blocks.random_blocks(qtype, 4096, np.random.default_rng(3))
    assert np.array_equal(blocks, again)


def test_ternary_types_hold_only_ternary_codes():
    w = gguf.quants.dequantize(synth_blocks.random_blocks(Q.TQ2_0, 256, np.random.default_rng(0)), Q.TQ2_0)
    b = synth_blocks.random_blocks(Q.TQ2_0, 256, np.random.default_rng(0))
    d = b[:, 64:66].copy().view("<f2").astype(np.float32)
    assert set(np.unique(np.round(w / d)).tolist()) == {-1.0, 0.0, 1.0}


@pytest.mark.parametrize("qtype", [*synth.EXPERT_TYPES, Q.F16, Q.BF16, Q.F32], ids=lambda q: q.name)
def test_every_type_has_a_pool_of_valid_blocks(qtype):
    nbytes = 512 * GGML_QUANT_SIZES[qtype][1]
    pools = synth.Pools(seed=5, largest={qtype: nbytes})
    chunk = next(pools.window(qtype, "blk.1.ffn_up_exps.weight", nbytes))
    w = gguf.quants.dequantize(np.ascontiguousarray(chunk), qtype)
    assert np.isfinite(w).all() and 0.005 < float(w.std()) < 0.03, (qtype.name, float(w.std()))


def _mini256_plan(**kw):
    types = synth.types_for("IQ2_XXS", "IQ3_XXS", "Q4_K")
    return synth.plan("mini256", 4, 8, shards=3, seed=2, types=types, metadata_shard=True, **kw)


def test_plan_puts_each_tensor_in_its_type():
    p = _mini256_plan()
    assert p.layout[0] == [] and all(p.layout[1:])
    kept = set(p.trunk_kept_q8_0)
    for t in p.tensors:
        n = len(t.shape)
        if fmt.is_routed_expert(t.name):
            want = Q.IQ3_XXS if ".ffn_down_exps." in t.name else Q.IQ2_XXS
        elif fmt.role_of(t.name, n) == fmt.ROLE_EMBEDDINGS_OUTPUT:
            want = Q.Q8_0                                     # as `k3kit requant` keeps them
        elif fmt.is_trunk_matrix(t.name, n):
            want = Q.Q8_0 if t.shape[0] % 256 else Q.Q4_K     # rows that do not fit stay Q8_0
            assert (t.name in kept) == (t.shape[0] % 256 != 0)
        else:
            want = Q.F32
        assert t.ggml_type == want, t.name
    assert {n.split(".")[2] for n in kept} == {"ssm_f_b", "attn_q_b", "attn_k_b", "attn_v_b", "attn_output"}
    kv = {k.key: k.value for k in p.kv}
    assert kv["general.file_type"] == int(LlamaFileType.MOSTLY_IQ2_XXS)
    assert kv["general.name"] == "kimi-k3-synth-mini256-4L-8E-IQ2_XXS-IQ3_XXS-Q4_K"
    assert fmt.kimi_k3_check_names({t.name for t in p.tensors}, {k.key: k for k in p.kv}) == []


def test_file_type_names_the_mix():
    ft = lambda *a: synth.types_for(*a).file_type  # noqa: E731
    assert ft() == int(LlamaFileType.MOSTLY_MXFP4_MOE)                # today's default, unchanged
    assert ft("IQ1_S", "IQ3_XXS") == int(LlamaFileType.MOSTLY_IQ1_S)
    assert ft("IQ2_S") == int(LlamaFileType.MOSTLY_IQ2_M)             # IQ2_M's default type
    assert ft("Q2_K", None, "Q4_K") == int(LlamaFileType.MOSTLY_Q2_K)
    assert ft(None, None, "Q4_K") == int(LlamaFileType.MOSTLY_Q4_K_S)  # what requant writes
    assert ft(None, None, "BF16") == int(LlamaFileType.MOSTLY_BF16)
    assert synth.types_for(trunk="q6_k").trunk == Q.Q6_K


def test_bad_types_and_rows_are_one_line_errors():
    with pytest.raises(K3Error, match="--expert-type IQ4_XS: expected one of MXFP4"):
        synth.types_for("IQ4_XS")
    with pytest.raises(K3Error, match="--trunk-type IQ2_XXS"):
        synth.types_for(trunk="IQ2_XXS")
    with pytest.raises(K3Error, match="rows of 128 .*mini256"):
        synth.plan("mini", 2, 4, types=synth.types_for("IQ1_S"))
    with pytest.raises(K3Error, match="--metadata-shard needs --shards >= 2"):
        synth.plan("mini", 2, 4, metadata_shard=True)
    # 32-weight expert types fit mini's 128 / 96 rows
    assert synth.plan("mini", 2, 4, types=synth.types_for("Q8_0")).tensors


@pytest.fixture(scope="module")
def meta_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta")
    result = synth.synthesize(out, "mini256", 4, 8, shards=3, seed=2, expert_type="IQ2_XXS",
                              expert_type_down="IQ3_XXS", trunk_type="Q4_K", metadata_shard=True,
                              progress=False)
    return result, _mini256_plan()


def test_metadata_shard_holds_only_kvs_and_the_model_opens(meta_shards):
    result, p = meta_shards
    paths = [Path(x) for x in result.paths]
    assert [x.name[-20:] for x in paths] == [f"-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert not list(paths[0].parent.glob(".*"))                       # no temporaries left
    first = GGUFReader(paths[0])
    assert len(first.tensors) == 0
    assert int(first.fields["split.count"].parts[-1][0]) == 3
    assert int(first.fields["split.tensors.count"].parts[-1][0]) == len(p.tensors)
    assert first.fields["tokenizer.ggml.tokens"].data                 # all KVs live in shard 1
    later = GGUFReader(paths[1])
    assert "general.architecture" not in later.fields and int(later.fields["split.no"].parts[-1][0]) == 1
    with Model.open(paths[2]) as model:
        assert [len(f.tensors) for f in model.files] == [len(g) for g in p.layout]
        assert list(model.tensors) == [t.name for t in p.tensors]
        assert model.kv["general.file_type"].value == int(LlamaFileType.MOSTLY_IQ2_XXS)
        specs = {t.name: t for t in p.tensors}
        for name, info in model.tensors.items():
            raw = np.asarray(model.view(name))
            assert raw.tobytes() == source_bytes(specs[name]).tobytes(), name
            w = gguf.quants.dequantize(raw.reshape(-1, raw.shape[-1]), info.ggml_type)
            assert np.isfinite(w).all(), name
    assert result.expert_type == "IQ2_XXS" and result.trunk_type == "Q4_K" and result.trunk_kept_q8_0 == 7
    assert result.disk_bytes >= result.file_bytes * 0.9 and not result.sparse


def test_sparse_files_have_exact_headers_and_no_blocks(tmp_path, meta_shards):
    dense, _ = meta_shards
    sparse = synth.synthesize(tmp_path, "mini256", 4, 8, shards=3, seed=2, expert_type="IQ2_XXS",
                              expert_type_down="IQ3_XXS", trunk_type="Q4_K", metadata_shard=True,
                              sparse=True, progress=False)
    assert sparse.sparse and sparse.file_bytes == dense.file_bytes
    for a, b in zip(dense.paths, sparse.paths, strict=True):
        fa = GGUFFile.open(a)
        assert os.path.getsize(a) == os.path.getsize(b)
        with open(a, "rb") as x, open(b, "rb") as y:
            assert x.read(fa.data_offset) == y.read(fa.data_offset)   # header to the byte
            y.seek(fa.data_offset)
            assert not any(y.read())                                  # the hole reads as zeros
    with Model.open(sparse.paths[0]) as model:
        assert len(model.tensors) == sparse.tensors


def test_full_k3_sparse_model_inspects_in_under_a_second(tmp_path):
    """K3's real geometry: 93 layers, 896 experts, vocab 163840, 32 shards, ~1.5 TB."""
    r = synth.synthesize(tmp_path, "k3", 93, 896, shards=32, metadata_shard=True, sparse=True,
                         progress=False)
    paths = [Path(x) for x in r.paths]
    assert len(paths) == 32 and r.tensors == 2573
    assert r.file_bytes == sum(x.stat().st_size for x in paths) > 1.5e12
    assert r.disk_bytes == sum(x.stat().st_blocks * 512 for x in paths) < 16e6   # header blocks only
    t0 = time.process_time()
    with Model.open(paths[5]) as model:
        result = inspect_model(model)
    assert time.process_time() - t0 < 1.0
    assert result["n_tensors"] == 2573 and result["files"][0]["n_tensors"] == 0
    experts = result["by_role"]["routed_experts"]["bytes"]
    assert experts == 92 * 896 * 3 * 3584 * 3072 * 17 // 32                    # MXFP4, 2.72T weights
    q8 = result["by_type"]["Q8_0"]["bytes"]
    assert 59.0e9 < q8 < 59.7e9                                                # notes: ~59.6 GB Q8_0
    trunk, _ = trunk_summary(result)
    assert trunk == result["total_bytes"] - experts
    assert [f["size"] for f in result["files"]] == [x.stat().st_size for x in paths]
    assert result["architecture"]["layers"] == 93 and result["architecture"]["vocab"] == 163840


def test_k3_q4_k_trunk_plan_matches_requant_convention():
    p = synth.plan("k3", 93, 896, types=synth.types_for(trunk="Q4_K"))
    trunk = sum(t.nbytes for t in p.tensors if fmt.is_trunk_matrix(t.name, len(t.shape)))
    assert 32e9 < trunk < 34.5e9                                             # notes: ~34.2 GB
    assert sorted({n.split(".")[2] for n in p.trunk_kept_q8_0}) == ["attn_k_b", "ssm_f_b"]
    assert len(p.trunk_kept_q8_0) == 69 + 24


def test_cli_flags(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["synth", "-o", str(out), "--geometry", "mini256", "--layers", "2", "--experts", "4",
                 "--shards", "2", "--metadata-shard", "--expert-type", "IQ1_S", "--expert-type-down",
                 "Q3_K", "--trunk-type", "BF16", "--sparse", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    types = (result["expert_type"], result["expert_type_down"], result["trunk_type"])
    assert types == ("IQ1_S", "Q3_K", "BF16")
    assert result["metadata_shard"] and result["sparse"] and len(result["paths"]) == 2
    assert result["file_type"] == int(LlamaFileType.MOSTLY_IQ1_S)
    with Model.open(result["paths"][1]) as model:
        types = {t.ggml_type for t in model.tensors.values()}
    assert types == {Q.IQ1_S, Q.Q3_K, Q.BF16, Q.Q8_0, Q.F32}
    assert main(["synth", "-o", str(out / "x"), "--geometry", "mini", "--layers", "2", "--experts", "2",
                 "--expert-type", "Q4_K"]) == 2
    assert "mini256" in capsys.readouterr().err and not (out / "x").exists()
    with pytest.raises(SystemExit):
        main(["synth", "-o", str(out / "y"), "--layers", "2", "--experts", "2", "--trunk-type", "IQ1_S"])
