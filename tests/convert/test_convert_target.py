"""`k3kit convert target`: what each GGUF tensor holds, the trunk types, the tokenizer KVs, errors.

Values are checked against the torch model the checkpoint was saved from, through a mapping
written here independently of the converter's (tests/interop/test_convert_vs_llama.py checks
the same files against llama.cpp's own converter, byte for byte).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from k3_checkpoint import VOCAB, mini_tokenizer, tiny_k3_config, write_checkpoint
from safetensors.torch import load_file, save_file

from k3kit.cli import main
from k3kit.convert.checkpoint import read_safetensors_header
from k3kit.convert.hparams import parse_hparams
from k3kit.convert.mxfp4_repack import repack_mxfp4
from k3kit.convert.target import convert_target, plan_target
from k3kit.errors import ConvertError
from k3kit.gguf import format as fmt
from k3kit.gguf import quants
from k3kit.gguf.reader import GGUFFile
from k3kit.mini.tokenizer import gguf_tokenizer_kv
from k3kit.models.kimi_k3.config import K3ModelConfig
from k3kit.models.kimi_k3.mxfp4 import mxfp4_dequantize, mxfp4_fake_quant, mxfp4_quantize, pack_codes

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "tiny"
    model = write_checkpoint(d)
    return d, model


@pytest.fixture(scope="module")
def f32_file(ckpt, tmp_path_factory):
    d, _ = ckpt
    out = tmp_path_factory.mktemp("out") / "f32.gguf"
    convert_target(d, out, "F32")
    return GGUFFile.open(out)


def _values(f: GGUFFile, name: str) -> np.ndarray:
    t = next(t for t in f.tensors if t.name == name)
    return quants.dequantize(f.view(t), t.ggml_type, t.n_elements).reshape(t.np_shape)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def _neg_exp(x: np.ndarray) -> np.ndarray:
    """-exp, correctly rounded to float32 (numpy's float32 exp can be an ulp off)."""
    return (-np.exp(x.astype(np.float64))).astype(np.float32)


def _expected(model) -> dict[str, np.ndarray]:
    """Every GGUF tensor's float32 values (numpy shape) from the torch model's parameters."""
    cfg = model.cfg
    nh, nope, v, kvr = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    out = {"token_embd.weight": _np(model.embed.weight), "output.weight": _np(model.lm_head.weight),
           "output_norm.weight": _np(model.norm), "output_res_score.weight": _np(model.output_res_score)}
    for il, layer in enumerate(model.layers):
        b, a, f = f"blk.{il}.", layer.attn, layer.ffn
        out |= {b + "attn_norm.weight": _np(layer.attn_norm), b + "ffn_norm.weight": _np(layer.ffn_norm),
                b + "attn_res_score.weight": _np(layer.attn_res_score),
                b + "ffn_res_score.weight": _np(layer.ffn_res_score)}
        if cfg.is_kda(il):
            C, K = a.q_conv.shape
            for x in "qkv":
                out[f"{b}ssm_conv1d_{x}.weight"] = _np(getattr(a, f"{x}_conv")).reshape(1, C, 1, K)
                out[f"{b}attn_{x}.weight"] = _np(getattr(a, f"{x}_proj").weight)
            out |= {b + "ssm_f_a.weight": _np(a.f_a_proj.weight),
                    b + "ssm_f_b.weight": _np(a.f_b_proj.weight),
                    b + "ssm_beta.weight": _np(a.b_proj.weight), b + "ssm_a": _neg_exp(_np(a.A_log)),
                    b + "ssm_dt.bias": _np(a.dt_bias), b + "ssm_g.weight": _np(a.g_proj.weight),
                    b + "ssm_norm.weight": _np(a.o_norm), b + "attn_output.weight": _np(a.o_proj.weight)}
        else:
            kv_b = _np(a.kv_b_proj.weight).reshape(nh, nope + v, kvr)
            out |= {b + "attn_q_a.weight": _np(a.q_a_proj.weight),
                    b + "attn_q_a_norm.weight": _np(a.q_a_norm),
                    b + "attn_q_b.weight": _np(a.q_b_proj.weight),
                    b + "attn_kv_a_mqa.weight": _np(a.kv_a_proj.weight),
                    b + "attn_kv_a_norm.weight": _np(a.kv_a_norm),
                    b + "attn_k_b.weight": kv_b[:, :nope].transpose(0, 2, 1),
                    b + "attn_v_b.weight": kv_b[:, nope:],
                    b + "attn_output.weight": _np(a.o_proj.weight),
                    b + "attn_gate.weight": _np(a.g_proj.weight)}
        if cfg.is_dense(il):
            out |= {b + f"ffn_{p}.weight": _np(getattr(f, f"{p}_proj").weight)
                    for p in ("gate", "up", "down")}
            continue
        out |= {b + "ffn_gate_inp.weight": _np(f.router.weight), b + "exp_probs_b.bias": _np(f.router.bias),
                b + "ffn_routed_down.weight": _np(f.routed_down.weight),
                b + "ffn_routed_up.weight": _np(f.routed_up.weight),
                b + "ffn_routed_norm.weight": _np(f.routed_norm)}
        out |= {b + f"ffn_{p}_shexp.weight": _np(getattr(f.shared, f"{p}_proj").weight)
                for p in ("gate", "up", "down")}
        out |= {b + f"ffn_{p}_exps.weight": _np(mxfp4_fake_quant(getattr(f, f"{p}_exps")))
                for p in ("gate", "up", "down")}
    return out


def test_every_tensor_holds_the_model_weights(ckpt, f32_file):
    _, model = ckpt
    want = _expected(model)
    got = {t.name: t for t in f32_file.tensors}
    assert set(got) == set(want)
    for name, x in want.items():
        t = got[name]
        assert t.np_shape == x.shape, name
        expect_type = T.MXFP4 if name.endswith("_exps.weight") else T.F32
        assert t.ggml_type == expect_type, name
        # experts: the dequantized MXFP4 bytes ARE the QAT-rounded weights, exactly (lossless)
        np.testing.assert_array_equal(_values(f32_file, name), x, err_msg=name)


def test_kv_types_and_layout_load_in_llama_cpp_terms(f32_file):
    assert fmt.check_kv_types(fmt.ARCH_KIMI_K3, f32_file.kv) == []
    assert fmt.kimi_k3_check_names([t.name for t in f32_file.tensors], f32_file.kv) == []
    kv = {k: v.value for k, v in f32_file.kv.items()}
    assert list(kv["kimi-k3.attention.head_count_kv"]) == [0, 1, 0, 1]
    assert kv["kimi-k3.attention.key_length"] == 32 + 32 and kv["kimi-k3.attention.value_length"] == 32
    assert kv["kimi-k3.expert_latent_length"] == 32 and kv["kimi-k3.leading_dense_block_count"] == 1
    assert kv["general.file_type"] == 38     # MOSTLY_MXFP4_MOE, as llama.cpp labels it
    assert kv["kimi-k3.kda.gate_lower_bound"] == -5.0


@pytest.mark.parametrize("trunk", ["Q8_0", "BF16"])
def test_trunk_types_quantize_the_f32_values(ckpt, f32_file, tmp_path, trunk):
    d, _ = ckpt
    out = tmp_path / "t.gguf"
    convert_target(d, out, trunk)
    g = GGUFFile.open(out)
    ref = {t.name: t for t in f32_file.tensors}
    qtype = T[trunk]
    n_trunk = 0
    for t in g.tensors:
        r = ref[t.name]
        assert t.shape == r.shape
        if r.ggml_type in (T.MXFP4,) or fmt.converter_keeps_f32(t.name, len(t.shape)):
            assert t.ggml_type == r.ggml_type, t.name
            assert np.array_equal(g.view(t), f32_file.view(r)), t.name
            continue
        n_trunk += 1
        assert t.ggml_type == qtype, t.name
        x = _values(f32_file, t.name)
        want = quants.quantize(x.reshape(-1, x.shape[-1]), qtype).reshape(-1)
        assert np.array_equal(g.view(t), want), t.name
    assert n_trunk == 50


def test_bf16_checkpoint_widens_exactly(tmp_path):
    d = tmp_path / "tiny"
    model = write_checkpoint(d, dtype=torch.bfloat16, seed=3)
    assert read_safetensors_header(d / WEIGHTS)["language_model.lm_head.weight"].dtype == "BF16"
    convert_target(d, tmp_path / "o.gguf", "F32")
    g = GGUFFile.open(tmp_path / "o.gguf")
    want = model.lm_head.weight.detach().to(torch.bfloat16).float().numpy()
    assert np.array_equal(_values(g, "output.weight"), want)
    got = _values(g, "blk.1.ffn_up_exps.weight")
    assert np.array_equal(got, _np(mxfp4_fake_quant(model.layers[1].ffn.up_exps)))


def test_tokenizer_kvs_are_the_mini_tokenizers(f32_file):
    want = {k.key: k for k in gguf_tokenizer_kv(mini_tokenizer())}
    got = {k: v for k, v in f32_file.kv.items() if k.startswith("tokenizer.")}
    assert set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        assert (g.vtype, g.item_type) == (w.vtype, w.item_type), key
        assert np.array_equal(np.asarray(g.value), np.asarray(w.value)), key


def test_vocab_is_padded_to_config_and_specials_default_to_kimis(tmp_path):
    d = tmp_path / "tiny"
    write_checkpoint(d, tokenizer_config=False, vocab_size=VOCAB + 32)
    kvs, _ = plan_target(d, "F32")
    kv = {k.key: k.value for k in kvs}
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == VOCAB + 32
    assert tokens[VOCAB] == f"[PAD{VOCAB}]" and tokens[-1] == f"[PAD{VOCAB + 31}]"
    assert list(kv["tokenizer.ggml.token_type"][VOCAB:]) == [5] * 32
    assert tokens[kv["tokenizer.ggml.bos_token_id"]] == "[BOS]"
    assert tokens[kv["tokenizer.ggml.eos_token_id"]] == "[EOS]"
    assert "tokenizer.chat_template" not in kv
    assert kv["tokenizer.ggml.add_bos_token"] is True      # the tokenizer's own post-processor adds [BOS]


def test_sharded_checkpoint_gives_the_same_file(ckpt, tmp_path):
    src, _ = ckpt
    d = tmp_path / "tiny"          # same directory name: general.name comes from it
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    tensors = load_file(src / WEIGHTS)
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in parts.items():
        save_file({n: tensors[n] for n in part}, d / fname)
        weight_map |= {n: fname for n in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    convert_target(src, tmp_path / "one.gguf")
    convert_target(d, tmp_path / "two.gguf")
    assert (tmp_path / "one.gguf").read_bytes() == (tmp_path / "two.gguf").read_bytes()


# ---------------------------------------------------------------- hostile input


def _edit_tensors(d: Path, fn) -> None:
    t = load_file(d / WEIGHTS)
    fn(t)
    save_file(t, d / WEIGHTS)


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


P = "language_model.model.layers."


def _truncate(d: Path) -> None:
    with open(d / WEIGHTS, "r+b") as f:
        f.truncate((d / WEIGHTS).stat().st_size - 100)


def _huge_header(d: Path) -> None:
    with open(d / WEIGHTS, "r+b") as f:
        f.write((1 << 62).to_bytes(8, "little"))


BAD_INPUTS = {
    "missing tensor": (lambda d: _edit_tensors(d, lambda t: t.pop(P + "2.self_attn.v_proj.weight")),
                       r"model\.safetensors: missing tensor "
                       r"'language_model\.model\.layers\.2\.self_attn\.v_proj\.weight'"),
    "extra tensor": (lambda d: _edit_tensors(d, lambda t: t.update({P + "0.self_attn.extra": torch.ones(3)})),
                     r"model\.safetensors: tensor 'language_model\.model\.layers\.0\.self_attn\.extra': "
                     r"unexpected"),
    "wrong shape": (lambda d: _edit_tensors(d, lambda t: t.update({P + "1.self_attn.kv_b_proj.weight":
                                                                   torch.ones(96, 32)})),
                    r"model\.safetensors: tensor '.*layers\.1\.self_attn\.kv_b_proj\.weight': "
                    r"shape \[96, 32\], expected \[128, 32\]"),
    "packed as float": (lambda d: _edit_tensors(d, lambda t: t.update(
        {P + "3.block_sparse_moe.experts.5.w2.weight_packed": torch.ones(32, 16)})),
        r"experts\.5\.w2\.weight_packed': dtype F32, expected U8/I8"),
    "unknown quant format": (lambda d: _edit_config(d, lambda c: c["quantization_config"].update(
        format="nvfp4-pack-quantized")), r"config\.json: quantization_config has unsupported quant format"),
    "no quant config": (lambda d: _edit_config(d, lambda c: c.pop("quantization_config")),
                        r"weight_packed': quantized tensor, but config\.json has no quantization_config"),
    "config says more experts": (lambda d: _edit_config(d, lambda c: c["text_config"].update(num_experts=16)),
                                 r"tensor '.*layers\.1\.block_sparse_moe\.gate\.weight': shape \[8, 64\], "
                                 r"expected \[16, 64\]"),
    "extra expert": (lambda d: _edit_tensors(d, lambda t: t.update(
        {P + "2.block_sparse_moe.experts.8.w1.weight_packed": torch.zeros(32, 16, dtype=torch.uint8)})),
        r"model\.safetensors: tensor '.*experts\.8\.w1\.weight_packed': unexpected tensor for this config$"),
    "config says wider hidden": (lambda d: _edit_config(d, lambda c: c["text_config"].update(hidden_size=96)),
                                 r"model\.safetensors: tensor 'language_model\.model\.embed_tokens\.weight': "
                                 r"shape \[512, 64\], expected \[512, 96\]"),
    "bad JSON": (lambda d: (d / "config.json").write_text('{"architectures": ['),
                 r"config\.json: not valid JSON"),
    "config type": (lambda d: _edit_config(d, lambda c: c["text_config"].update(num_attention_heads="2")),
                    r"config\.json: num_attention_heads must be an integer"),
    "not K3": (lambda d: _edit_config(d, lambda c: c.update(architectures=["LlamaForCausalLM"])),
               r"config\.json: architectures is \['LlamaForCausalLM'\]"),
    "truncated weights": (_truncate, r"model\.safetensors: tensor '.*': data past end of file"),
    "huge header": (_huge_header, r"model\.safetensors: safetensors header length \d+ is out of range"),
    "index escapes": (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "../model.safetensors"}})), r"index\.json: weight_map entry 'x' -> '\.\./model"),
    "bad tokenizer": (lambda d: (d / "tokenizer.json").write_text("[]"),
                      r"tokenizer\.json: not a tokenizers JSON"),
    "foreign pre-tokenizer": (lambda d: _edit_json(d / "tokenizer.json", lambda t: t.update(
        pre_tokenizer={"type": "Whitespace"})),
        r"tokenizer\.json: pre-tokenizer is not one llama\.cpp implements"),
}


def _edit_json(path: Path, fn) -> None:
    x = json.loads(path.read_text())
    fn(x)
    path.write_text(json.dumps(x))


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_error_and_writes_nothing(ckpt, tmp_path, case):
    src, _ = ckpt
    d = tmp_path / "tiny"
    shutil.copytree(src, d)
    corrupt, pattern = BAD_INPUTS[case]
    corrupt(d)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConvertError, match=pattern) as exc:
        convert_target(d, out_dir / "x.gguf")
    assert "\n" not in str(exc.value)
    assert str(exc.value).startswith(str(d))
    assert list(out_dir.iterdir()) == []


def test_data_error_while_writing_leaves_nothing(ckpt, tmp_path, monkeypatch):
    """A failure after the output was opened (here: a tensor read fails) removes the temp file."""
    src, _ = ckpt
    from k3kit.convert import checkpoint

    calls = []

    def failing_raw(self, e):
        calls.append(e.name)
        if len(calls) == 20:
            raise ConvertError(f"{e.where}: cannot read (simulated)")
        return original(self, e)

    original = checkpoint.Checkpoint.raw
    monkeypatch.setattr(checkpoint.Checkpoint, "raw", failing_raw)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConvertError, match="simulated"):
        convert_target(src, out_dir / "x.gguf")
    assert len(calls) == 20 and list(out_dir.iterdir()) == []


# ---------------------------------------------------------------- CLI


def test_cli_json_and_errors(ckpt, tmp_path, capsys):
    src, _ = ckpt
    out = tmp_path / "cli.gguf"
    assert main(["convert", "target", str(src), "-o", str(out), "--trunk-type", "bf16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tensors"] == 102 and r["trunk_type"] == "BF16" and r["type_counts"]["MXFP4"] == 9
    assert r["file_bytes"] == out.stat().st_size
    assert r["expert_bytes"] == 9 * 8 * 32 * (32 // 32) * 17
    assert GGUFFile.open(out).kv["general.architecture"].value == "kimi-k3"
    assert GGUFFile.open(out).kv["general.name"].value == src.name          # the directory's name
    named = tmp_path / "named.gguf"
    assert main(["convert", "target", str(src), "-o", str(named), "--name", "mini-k3", "--json"]) == 0
    capsys.readouterr()
    assert GGUFFile.open(named).kv["general.name"].value == "mini-k3"

    assert main(["convert", "target", str(tmp_path / "nope"), "-o", str(tmp_path / "y.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3kit: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "y.gguf").exists()


# ---------------------------------------------------------------- pieces


def test_repack_mxfp4_moves_bits_only():
    """Every code and exponent, through compressed-tensors packing and our repack, decodes to the
    values the compressed-tensors side means."""
    rng = np.random.default_rng(0)
    rows, cols = 6, 96
    codes = torch.from_numpy(rng.integers(0, 16, (rows, cols), dtype=np.uint8))
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    scales = torch.from_numpy(rng.integers(100, 150, (rows, cols // 32), dtype=np.uint8))
    packed = pack_codes(codes).numpy()
    ggml = repack_mxfp4(packed, scales.numpy())
    assert ggml.shape == (rows, cols // 32 * 17)
    assert np.array_equal(ggml.reshape(rows, -1, 17)[..., 0], scales.numpy())
    got = quants.dequantize(ggml.reshape(-1), T.MXFP4, rows * cols).reshape(rows, cols)
    assert np.array_equal(got, mxfp4_dequantize(codes, scales).numpy())


def test_repack_matches_ggml_quantizer_on_rounded_weights():
    """Weights rounded by the model's MXFP4 (ggml's rule), saved compressed-tensors style and
    repacked, are the bytes k3kit's ggml-exact MXFP4 quantizer writes for the same weights."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    codes, scales = mxfp4_quantize(w)
    ours = repack_mxfp4(pack_codes(codes).numpy(), scales.numpy())
    assert np.array_equal(ours.reshape(-1), quants.quantize(w.numpy(), T.MXFP4).reshape(-1))


@pytest.mark.parametrize("over", [{}, {"q_lora_rank": None, "expert_latent_size": 0, "num_shared_experts": 0,
                                      "gate_lower_bound": None, "attn_res_block_size": 0}])
def test_hparams_agree_with_the_model_config(tmp_path, over):
    cfg = tiny_k3_config(**over)
    raw = cfg.to_hf_config()
    hp = parse_hparams(raw, "config.json")
    ref = K3ModelConfig.from_hf_config(raw)
    assert hp.n_layer == ref.num_layers
    assert hp.mla_layers == {i for i, k in enumerate(ref.layer_kinds) if k == "mla"}
    assert (hp.q_lora_rank, hp.latent, hp.n_shared, hp.gate_lower_bound, hp.attn_res_block_size) == (
        ref.q_lora_rank, ref.expert_latent_size, ref.num_shared_experts, ref.gate_lower_bound,
        ref.attn_res_block_size)
    assert (hp.kda_dim, hp.moe_in, hp.n_ff_exp, hp.experts_mxfp4) == (
        ref.kda_dim, ref.moe_in_dim, ref.moe_intermediate_size, ref.experts_mxfp4)


def test_variant_without_optional_parts_converts(tmp_path):
    """Plain q_proj, no latent, no shared expert, no attn-res, float experts: the other branches."""
    d = tmp_path / "v"
    model = write_checkpoint(d, q_lora_rank=None, expert_latent_size=0, num_shared_experts=0,
                             attn_res_block_size=0, experts_mxfp4=False)
    convert_target(d, tmp_path / "v.gguf", "F32")
    g = GGUFFile.open(tmp_path / "v.gguf")
    names = {t.name for t in g.tensors}
    assert "blk.1.attn_q.weight" in names and "blk.1.attn_q_a.weight" not in names
    assert not any("res_score" in n or "shexp" in n or "routed" in n for n in names)
    assert fmt.kimi_k3_check_names(names, g.kv) == []
    exps = next(t for t in g.tensors if t.name == "blk.2.ffn_down_exps.weight")
    assert exps.ggml_type == T.F32 and exps.shape == (32, 64, 8)
    assert np.array_equal(_values(g, "blk.2.ffn_down_exps.weight"), _np(model.layers[2].ffn.down_exps))
    assert g.kv["general.file_type"].value == 0


def test_planning_reads_headers_only_and_writing_streams(ckpt, tmp_path, monkeypatch):
    """All checks run before any tensor data is read; then each tensor's data is read while
    that tensor is written (the sources are callables), never all up front."""
    src, _ = ckpt
    from k3kit.convert import checkpoint
    from k3kit.gguf import writer

    reads: list[str] = []
    original = checkpoint.Checkpoint.raw
    def counting_raw(self, e):
        reads.append(e.name)
        return original(self, e)

    monkeypatch.setattr(checkpoint.Checkpoint, "raw", counting_raw)
    kvs, specs = plan_target(src, "Q8_0")
    assert reads == [] and all(callable(t.source) for t in specs)

    order: list[tuple[str, int]] = []
    original_write = writer._write_data

    def spy(fd, t, progress):
        order.append((t.name, len(reads)))
        original_write(fd, t, progress)

    monkeypatch.setattr(writer, "_write_data", spy)
    writer.write_gguf(tmp_path / "s.gguf", kvs, specs)
    reads_before = [n for _, n in order]
    assert reads_before == sorted(reads_before) and reads_before[0] == 0   # reads grow as tensors are written
    assert reads_before[-1] < len(reads)


def test_kimi_linear_shaped_a_log_becomes_a_head_vector(ckpt, tmp_path):
    src, model = ckpt
    d = tmp_path / "tiny"
    shutil.copytree(src, d)
    name = "language_model.model.layers.2.self_attn.A_log"
    _edit_tensors(d, lambda t: t.update({name: t[name].reshape(1, 1, -1, 1).contiguous()}))
    convert_target(d, tmp_path / "a.gguf", "F32")
    g = GGUFFile.open(tmp_path / "a.gguf")
    t = next(t for t in g.tensors if t.name == "blk.2.ssm_a")
    assert t.shape == (2,)
    assert np.array_equal(_values(g, "blk.2.ssm_a"), _neg_exp(_np(model.layers[2].attn.A_log)))
