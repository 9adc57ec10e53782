"""`k3kit draft convert`: a tiny DSpark checkpoint against a synthetic mini kimi-k3 target.

The converted file is read back with gguf-py's GGUFReader (an independent parser) and checked
tensor by tensor against the safetensors source and gguf-py's own Q8_0 quantizer.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from draft_fixture import draft_config, write_draft, write_target

from k3kit.cli import main
from k3kit.convert.draft import convert_draft, parse_config
from k3kit.convert.draft_mapping import detect_family, load_mapping
from k3kit.errors import ConvertError
from k3kit.gguf.format import check_kv_types, dflash_expected_tensors
from k3kit.gguf.reader import GGUFFile
from k3kit.models.dflash.config import DraftConfig
from k3kit.models.dflash.names import gguf_tensor_name


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("draft")
    return d, write_draft(d)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, draft, target):
    out = tmp_path_factory.mktemp("out")
    rc = main(["draft", "convert", str(draft[0]), "--target", str(target), "-o", str(out / "d.gguf"),
               "--report", str(out / "report.json"), "--json"])
    assert rc == 0
    return out / "d.gguf", json.loads((out / "report.json").read_text())


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def _floats(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy()


def _leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.startswith(".")]


def test_report_states_every_figure(converted, draft, capsys):
    path, rep = converted
    _, tensors = draft
    src = draft[0] / "model.safetensors"
    assert rep["source_tensors"] == len(tensors) == 29
    assert rep["mapped_tensors"] == 29 and rep["dropped_tensors"] == []
    assert rep["parameters"] == rep["mapped_parameters"] == sum(t.numel() for t in tensors.values())
    assert rep["source_file_bytes"] == src.stat().st_size
    assert rep["source_tensor_bytes"] == sum(t.numel() * 2 for t in tensors.values())
    assert rep["output_bytes"] == path.stat().st_size
    assert rep["ratio"] == pytest.approx(path.stat().st_size / src.stat().st_size)
    n2 = sum(1 for t in tensors.values() if t.dim() == 2)
    assert rep["type_counts"] == {"Q8_0": n2, "F32": len(tensors) - n2}
    assert rep["output_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert rep["family"] == "dspark" and rep["requested_type"] == "Q8_0" and rep["fallbacks"] == []
    lossy = [v for k, v in rep["rmse"].items() if rep["config"]["types"][k] == "Q8_0"]
    exact = [v for k, v in rep["rmse"].items() if rep["config"]["types"][k] == "F32"]
    assert len(lossy) == rep["lossy_tensors"] == n2
    assert all(0.001 < v < 0.01 for v in lossy) and all(v == 0.0 for v in exact)
    assert rep["rmse_rms"] == pytest.approx(math.sqrt(sum(v * v for v in lossy) / len(lossy)))
    assert rep["rmse_max"] == max(lossy) == rep["rmse"][rep["rmse_max_tensor"]]

    # the human table carries the same figures
    from k3kit.convert.draft import DraftReport
    table = DraftReport(**rep).table()
    for s in (f"{rep['parameters']:,}", rep["output_sha256"], f"{n2} Q8_0", f"{rep['rmse_rms']:.8f}",
              f"{rep['rmse_max']:.8f}", f"{rep['source_file_bytes']:,} -> {rep['output_bytes']:,}",
              f"{rep['ratio'] * 100:.2f}%", "mapped tensors     29", "source tensors     29"):
        assert s in table, s
    capsys.readouterr()


def test_sampled_rmse_is_measured_on_the_written_rows(converted, draft):
    """Recompute the sampled figure with gguf-py's dequantizer on the same rows, and check that
    the whole-tensor figure is close to the sampled one."""
    path, rep = converted
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    for src_name, t in draft[1].items():
        name = gguf_tensor_name(src_name)
        if rep["config"]["types"][name] != "Q8_0":
            continue
        ref = _floats(t).reshape(-1, t.shape[-1]).astype(np.float64)
        got = gguf.quants.dequantize(by_name[name].data, gguf.GGMLQuantizationType.Q8_0)
        got = got.reshape(ref.shape).astype(np.float64)
        rows = np.unique(np.linspace(0, ref.shape[0] - 1, min(ref.shape[0], 64)).round().astype(int))
        sampled = math.sqrt(((got[rows] - ref[rows]) ** 2).sum() / (ref[rows] ** 2).sum())
        assert rep["rmse"][name] == pytest.approx(sampled, rel=1e-9)
        whole = math.sqrt(((got - ref) ** 2).sum() / (ref ** 2).sum())
        assert rep["rmse"][name] == pytest.approx(whole, rel=0.15)


def test_gguf_holds_what_llama_cpp_reads(converted, draft, target):
    path, _ = converted
    cfg = draft_config()
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == "dflash"
    expect = {
        "dflash.block_count": 2, "dflash.embedding_length": 256, "dflash.feed_forward_length": 512,
        "dflash.attention.head_count": 4, "dflash.attention.head_count_kv": 2,
        "dflash.attention.key_length": 64, "dflash.context_length": 4096, "dflash.block_size": 7,
        "dflash.target_layers": [1, 3], "tokenizer.ggml.mask_token_id": 1000,
        "dflash.rope.scaling.type": "yarn", "dflash.rope.scaling.original_context_length": 256,
        "dflash.sample_from_anchor": True, "dflash.has_confidence_head": True,
    }
    for k, v in expect.items():
        assert _field(reader, k) == v, k
    # floats from the config, stored as float32
    for k, v in (("dflash.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"]),
                 ("dflash.rope.freq_base", cfg["rope_parameters"]["rope_theta"]),
                 ("dflash.rope.scaling.factor", cfg["rope_parameters"]["factor"])):
        assert _field(reader, k) == pytest.approx(v, rel=1e-6), k

    # tokenizer: exactly the target's, plus the mask id
    tgt = gguf.GGUFReader(target)
    tok_t = {k for k in tgt.fields if k.startswith("tokenizer.")}
    tok_d = {k for k in reader.fields if k.startswith("tokenizer.")}
    assert tok_d == tok_t | {"tokenizer.ggml.mask_token_id"}
    for k in tok_t:
        assert _field(reader, k) == _field(tgt, k), k

    f = GGUFFile.open(path)
    assert check_kv_types("dflash", f.kv) == []
    required, optional = dflash_expected_tensors(2)
    names = {t.name for t in f.tensors}
    assert required <= names and names <= required | optional
    f.close()


def test_tensor_bytes_match_the_source(converted, draft):
    path, _ = converted
    by_name = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert len(by_name) == len(draft[1])
    for src_name, t in draft[1].items():
        g = by_name[gguf_tensor_name(src_name)]        # the torch model's own name table agrees
        assert list(g.shape) == list(reversed(t.shape)), src_name
        x = _floats(t)
        if t.dim() == 1:
            assert g.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.asarray(g.data).reshape(-1), x.reshape(-1))
        else:
            assert g.tensor_type == gguf.GGMLQuantizationType.Q8_0
            want = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            np.testing.assert_array_equal(np.asarray(g.data).reshape(-1), want.reshape(-1))


def test_runtime_config_reads_back_the_same_draft(converted, draft):
    """The runtime's DraftConfig from the GGUF metadata equals DraftConfig from config.json."""
    path, _ = converted
    f = GGUFFile.open(path)
    kv = {k: (list(v.value) if v.vtype == gguf.GGUFValueType.ARRAY and not isinstance(v.value, list)
              else v.value) for k, v in f.kv.items()}
    f.close()
    hf = DraftConfig.from_hf(draft_config())
    gg = DraftConfig.from_gguf_kv(kv, vocab_size=1024, markov_rank=32)
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "block_size", "target_layer_ids", "mask_token_id", "sample_from_anchor", "has_confidence"):
        assert getattr(gg, name) == getattr(hf, name), name
    assert gg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert gg.rope_theta == pytest.approx(hf.rope_theta, rel=1e-6)
    assert gg.rope_scaling.factor == hf.rope_scaling.factor
    ys_g, ys_h = gg.rope_scaling, hf.rope_scaling
    assert ys_g.original_max_position_embeddings == ys_h.original_max_position_embeddings


def _convert_fails(tmp_path: Path, target: Path, match: str, **draft_kw) -> None:
    d = tmp_path / "draft"
    write_draft(d, **draft_kw)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConvertError, match=match):
        convert_draft(d, target, out / "d.gguf", progress=False)
    assert list(out.iterdir()) == [], "nothing may be written"


def test_unmapped_tensor_is_named_and_nothing_written(tmp_path, target):
    _convert_fails(tmp_path, target, r"'layers\.0\.self_attn\.rotary_emb\.inv_freq'.*unmapped",
                   extra={"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)})


def test_doubly_mapped_tensor_is_named(tmp_path, target):
    _convert_fails(tmp_path, target,
                   r"'(model\.)?fc\.weight'.*maps to fc\.weight, which '(model\.)?fc\.weight'",
                   extra={"model.fc.weight": torch.zeros(256, 512, dtype=torch.bfloat16)})


def test_shape_mismatch_is_named(tmp_path, target):
    _convert_fails(tmp_path, target, r"'layers\.1\.mlp\.up_proj\.weight'.*shape \[512, 128\]",
                   replace={"layers.1.mlp.up_proj.weight": torch.zeros(512, 128, dtype=torch.bfloat16)})


def test_missing_tensor_is_named(tmp_path, target):
    _convert_fails(tmp_path, target, r"output_norm\.weight \(from norm\.weight\)", drop=("norm.weight",))


def test_tensor_the_config_does_not_call_for(tmp_path, target):
    d = tmp_path / "d0"
    tensors = write_draft(d)
    cfg = draft_config(enable_confidence_head=False)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match=r"confidence_head\.proj\.(weight|bias)'.*does not call for"):
        convert_draft(d, target, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists() and "confidence_head.proj.bias" in tensors


def test_target_vocab_mismatch(tmp_path, target):
    d = tmp_path / "v2048"
    write_draft(d, vocab_size=2048)
    with pytest.raises(ConvertError, match=r"has 1024 tokens but the draft's vocab_size is 2048"):
        convert_draft(d, target, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_taps_outside_the_target(tmp_path, target):
    with pytest.raises(ConvertError, match=r"4 layers, draft taps target_layer_ids \[5\]"):
        convert_draft(_dir_with(tmp_path, dflash_config={"mask_token_id": 1000, "target_layer_ids": [0, 5]}),
                      target, tmp_path / "x.gguf", progress=False)


def _dir_with(tmp_path: Path, **overrides) -> Path:
    d = tmp_path / "dcfg"
    write_draft(d)
    (d / "config.json").write_text(json.dumps(draft_config(**overrides)))
    return d


def test_cli_error_is_one_line_exit_2(tmp_path, target, capsys):
    d = tmp_path / "draft"
    write_draft(d, extra={"layers.0.bogus.weight": torch.ones(32, 32)})
    rc = main(["draft", "convert", str(d), "--target", str(target), "-o", str(tmp_path / "o.gguf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("k3kit: error: ") and "layers.0.bogus.weight" in err[0]
    assert not (tmp_path / "o.gguf").exists() and _leftovers(tmp_path) == []


def test_q8_0_fallback_for_rows_not_whole_blocks(tmp_path, target):
    """Markov rank 40: markov_w1/w2 rows of 40 and conf_proj rows of 296 cannot be Q8_0; they stay
    BF16 (the source type, exact) and the report says why."""
    d = tmp_path / "d40"
    tensors = write_draft(d, markov_rank=40)
    rep = convert_draft(d, target, tmp_path / "d.gguf", progress=False)
    fb = {x["tensor"]: x for x in rep.fallbacks}
    assert set(fb) == {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight"}
    assert all(x["type"] == "BF16" and "not a multiple of 32" in x["reason"] for x in fb.values())
    by_name = {t.name: t for t in gguf.GGUFReader(tmp_path / "d.gguf").tensors}
    raw = tensors["markov_head.markov_w2.weight"].view(torch.int16).numpy().tobytes()
    assert np.asarray(by_name["markov_w2.weight"].data).tobytes() == raw
    assert rep.rmse["markov_w2.weight"] == 0.0 and rep.lossy_tensors == 15
    assert rep.type_counts == {"Q8_0": 15, "BF16": 3, "F32": 11}


@pytest.mark.parametrize("out_type", ["BF16", "F32"])
def test_float_types_are_exact(tmp_path, target, draft, out_type):
    rep = convert_draft(draft[0], target, tmp_path / "d.gguf", out_type=out_type, progress=False)
    assert rep.rmse_rms == 0.0 and rep.rmse_max == 0.0 and rep.lossy_tensors == 0
    by_name = {t.name: t for t in gguf.GGUFReader(tmp_path / "d.gguf").tensors}
    w = draft[1]["layers.1.self_attn.o_proj.weight"]
    got = np.asarray(by_name["blk.1.attn_output.weight"].data)
    if out_type == "BF16":
        assert got.tobytes() == w.view(torch.int16).numpy().tobytes()
    else:
        np.testing.assert_array_equal(got, _floats(w))
    assert gguf.GGUFReader(tmp_path / "d.gguf").fields["general.file_type"].contents() == (
        32 if out_type == "BF16" else 0)


def test_k3_mapping_keeps_the_confidence_head_f32(tmp_path, target, draft):
    rep = convert_draft(draft[0], target, tmp_path / "d.gguf", mapping="k3_dspark", progress=False)
    assert rep.family == "k3_dspark"
    assert rep.config["types"]["conf_proj.weight"] == "F32"
    assert rep.type_counts == {"Q8_0": 17, "F32": 12}


def test_mapping_file_path_and_dflash_family(tmp_path, target):
    """A plain DFlash draft (no Markov head) is detected as dflash and gets no DSpark keys;
    --mapping also takes a TOML file."""
    d = tmp_path / "dflash"
    write_draft(d, architectures=["DFlashDraftModel"], markov_rank=0, enable_confidence_head=False,
                drop=("markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                      "confidence_head.proj.weight", "confidence_head.proj.bias"))
    rep = convert_draft(d, target, tmp_path / "a.gguf", progress=False)
    assert rep.family == "dflash" and rep.mapped_tensors == 25
    fields = gguf.GGUFReader(tmp_path / "a.gguf").fields
    assert "dflash.sample_from_anchor" not in fields and "markov_w1.weight" not in rep.rmse
    m = tmp_path / "mine.toml"
    m.write_text('family = "mine"\nextends = "dflash"\ndrop = ["layers.1.mlp.up_proj.weight"]\n')
    with pytest.raises(ConvertError, match=r"missing 1 tensor.*blk\.1\.ffn_up\.weight"):
        convert_draft(d, target, tmp_path / "b.gguf", mapping=str(m), progress=False)


def test_family_detection():
    names = {"fc.weight", "markov_head.markov_w1.weight"}
    k3 = {"architectures": ["DSparkDraftModel"], "num_target_layers": 93, "hidden_size": 7168}
    assert detect_family(k3, names, Path("c.json")).family == "k3_dspark"
    assert detect_family({**k3, "num_target_layers": 61}, names, Path("c.json")).family == "dspark"
    assert detect_family({"architectures": ["DFlashDraftModel"]}, {"fc.weight"}, Path("c")).family == "dflash"
    with pytest.raises(ConvertError, match="no draft family matches"):
        detect_family({"architectures": ["LlamaForCausalLM"]}, {"fc.weight"}, Path("c.json"))
    with pytest.raises(ConvertError, match="unknown family"):
        load_mapping("nope")


def test_config_forms_llama_cpp_accepts():
    """Speculators-style nesting: taps counted from 1 in aux_hidden_state_layer_ids, no anchor sampling."""
    cfg = draft_config()
    nested = {k: cfg[k] for k in ("architectures", "markov_rank", "enable_confidence_head")}
    nested["transformer_layer_config"] = {k: v for k, v in cfg.items() if k not in nested}
    nested["aux_hidden_state_layer_ids"] = [1, 3]
    nested["mask_token_id"] = 1000
    del nested["transformer_layer_config"]["dflash_config"]
    s = parse_config(nested, Path("config.json"))
    assert s.target_layer_ids == (0, 2) and s.mask_token_id == 1000 and not s.sample_from_anchor
    assert parse_config(cfg, Path("c")).sample_from_anchor
    bad_mask = {"mask_token_id": 5000, "target_layer_ids": [1]}
    for bad, match in ((dict(markov_head_type="gated"), "vanilla"), (dict(num_attention_heads=3), "multiple"),
                       (dict(rope_parameters={"rope_type": "longrope"}), "longrope"),
                       (dict(dflash_config=bad_mask), "mask_token_id"),
                       (dict(hidden_size=-1), "hidden_size"), (dict(target_hidden_size=512), "target_hidden"),
                       (dict(layer_types=["sliding_attention", "full_attention"]), "sliding"),
                       (dict(max_position_embeddings=None), "max_position_embeddings"),
                       (dict(rope_is_neox_style=False), "NeoX")):
        with pytest.raises(ConvertError, match=match):
            parse_config(draft_config(**bad), Path("config.json"))


def test_no_torch_in_the_converter():
    """The converter module tree must not import torch (a 1.4 TB workflow should not pay for it)."""
    code = ("import sys; import k3kit.convert.draft, k3kit.convert.draft_fix, k3kit.commands.draft; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_self_contained_draft_keeps_its_embedding(tmp_path, target):
    """A draft with its own embed_tokens gets token_embd.weight; as in llama.cpp's DSpark converter
    the full-vocab lm_head and t2d are dropped, and the report lists them."""
    d = tmp_path / "own"
    emb = torch.randn(1024, 256).to(torch.bfloat16)
    write_draft(d, extra={"embed_tokens.weight": emb, "lm_head.weight": torch.zeros(1024, 256),
                          "t2d": torch.ones(1024, dtype=torch.bool)})
    rep = convert_draft(d, target, tmp_path / "d.gguf", progress=False)
    assert rep.source_tensors == 32 and rep.mapped_tensors == 30
    assert sorted(rep.dropped_tensors) == ["lm_head.weight", "t2d"]
    assert rep.parameters - rep.mapped_parameters == 1024 * 256 + 1024
    assert f"({rep.mapped_parameters:,} written)" in rep.table()
    by_name = {t.name: t for t in gguf.GGUFReader(tmp_path / "d.gguf").tensors}
    want = gguf.quants.quantize(_floats(emb), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(np.asarray(by_name["token_embd.weight"].data).reshape(-1), want.reshape(-1))
    assert "output.weight" not in by_name


def test_general_name_is_the_directory_or_the_name_given(converted, draft, target, tmp_path, capsys):
    path, _ = converted
    assert _field(gguf.GGUFReader(path), "general.name") == draft[0].name
    named = tmp_path / "named.gguf"
    assert main(["draft", "convert", str(draft[0]), "--target", str(target), "-o", str(named),
                 "--name", "mini-k3-draft", "--json"]) == 0
    capsys.readouterr()
    assert _field(gguf.GGUFReader(named), "general.name") == "mini-k3-draft"


def test_conversion_is_deterministic(converted, draft, target, tmp_path, capsys):
    _, rep = converted
    again_path = tmp_path / "again.gguf"
    assert main(["draft", "convert", str(draft[0]), "--target", str(target), "-o", str(again_path),
                 "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["output_sha256"] == rep["output_sha256"]
    assert again["rmse"] == rep["rmse"] and again["type_counts"] == rep["type_counts"]


def test_k3_geometry_reproduces_the_published_artifact_figures():
    """The published K3 DSpark Q8_0 artifact (Lucebox, from RadixArk/Kimi-K3-DSpark): 62 source
    tensors, 2,249,289,601 parameters, 38 Q8_0 + 24 F32, a 4,498,585,858-byte BF16 source and a
    2,390,153,888-byte GGUF. Heads and FFN width are not published: 112 heads x 64, 16 KV heads and
    FFN 12288 are one geometry that gives that exact parameter count with hidden 7168, 5 layers,
    5 taps, vocab 163840 and Markov rank 256 (head_dim 128 has no integer solution). With it the
    k3_dspark plan gives the published counts, and its tensor payload fits the published file with
    a few KB of header (the legacy file carried no tokenizer), as the BF16 source fits its file."""
    from k3kit.convert.checkpoint import TensorEntry
    from k3kit.convert.draft import _typed, expected_shapes
    from k3kit.gguf.quants import row_bytes

    cfg = draft_config(hidden_size=7168, num_attention_heads=112, num_key_value_heads=16, head_dim=64,
                       intermediate_size=12288, num_hidden_layers=5, vocab_size=163840, markov_rank=256,
                       num_target_layers=93, max_position_embeddings=1 << 20,
                       dflash_config={"mask_token_id": 163824, "target_layer_ids": [6, 22, 50, 66, 82]})
    spec = parse_config(cfg, Path("config.json"))
    shapes = expected_shapes(spec)
    mapping = detect_family(cfg, {"markov_head.markov_w1.weight"}, Path("config.json"))
    assert mapping.family == "k3_dspark"
    params = sum(math.prod(s) for s in shapes.values())
    assert (len(shapes), params) == (62, 2_249_289_601)
    entry = TensorEntry("x", Path("x"), "BF16", (1,), 0, 2)
    planned = [_typed(n, entry, s, gguf.GGMLQuantizationType.Q8_0, mapping) for n, s in shapes.items()]
    counts: dict[str, int] = {}
    for p in planned:
        counts[p.ggml_type.name] = counts.get(p.ggml_type.name, 0) + 1
    assert counts == {"Q8_0": 38, "F32": 24}
    payload = sum(row_bytes(p.ggml_type, p.shape[0]) * p.n_rows for p in planned)
    assert 0 < 2_390_153_888 - payload < 16_384
    assert 0 < 4_498_585_858 - 2 * params < 16_384
