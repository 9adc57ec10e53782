"""`k3kit.mini.train` on a tiny geometry and a corpus slice: it learns, it is deterministic, and
the exported MXFP4 checkpoint is exactly the model that was evaluated (QAT)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from k3kit.adapters.kimi_k3_hf import load_hf
from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.mini.train import TrainSettings, build_model, evaluate, mini_config, train
from k3kit.models.kimi_k3.kda import use_fast_kda
from k3kit.models.kimi_k3.moe import use_fast_moe
from k3kit.models.kimi_k3.mxfp4 import mxfp4_round

VOCAB = 384


def _cfg():
    return mini_config(vocab_size=VOCAB, hidden_size=64, num_heads=2, kda_head_dim=16, q_lora_rank=32,
                       kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                       intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       expert_latent_size=32, max_position_embeddings=128)


def _settings(**kw):
    base = dict(steps=40, seq_len=48, batch=4, vocab_size=VOCAB, corpus_bytes=300_000, eval_every=20,
                eval_windows=4, log_every=5, lr=1e-2, warmup=5, checkpoint_every=20, seed=7)
    base.update(kw)
    return TrainSettings(**base)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    a = tmp_path_factory.mktemp("run_a")
    b = tmp_path_factory.mktemp("run_b")
    ra = train(a, _settings(), _cfg(), log=lambda m: None)
    rb = train(b, _settings(), _cfg(), log=lambda m: None)
    return (a, ra), (b, rb)


def _log(d):
    return [json.loads(line) for line in (d / "train_log.jsonl").read_text().splitlines()]


def test_loss_goes_down_and_beats_unigram(runs):
    (d, r), _ = runs
    log = _log(d)
    evals = [x["heldout_nll"] for x in log if "heldout_nll" in x]
    losses = [x["loss"] for x in log if "loss" in x]
    assert log[0]["step"] == 0 and evals[0] > math.log(VOCAB) - 0.5      # starts near uniform
    assert evals[-1] < evals[0] - 0.5, evals                               # held-out improves by > 0.5 nat
    assert losses[-1] < losses[0] - 0.5, losses
    assert r.steps == 40 and r.tokens == 40 * 4 * 48
    assert r.heldout_ppl < r.unigram_ppl, (r.heldout_ppl, r.unigram_ppl)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["heldout_ppl"] == pytest.approx(r.heldout_ppl)


def test_same_seed_same_weights(runs):
    (a, ra), (b, rb) = runs
    assert (a / "hf" / "model.safetensors").read_bytes() == (b / "hf" / "model.safetensors").read_bytes()
    assert ra.heldout_nll == rb.heldout_nll
    # and the seed matters: another seed initialises differently
    p0 = dict(build_model(_cfg(), 7).named_parameters())
    p1 = dict(build_model(_cfg(), 8).named_parameters())
    assert not torch.equal(p0["layers.1.attn.q_proj.weight"], p1["layers.1.attn.q_proj.weight"])


def test_exported_checkpoint_is_the_evaluated_model(runs):
    """QAT: the experts were trained through MXFP4 rounding, so the MXFP4 export loses nothing.
    The reloaded model scores the held-out split exactly as the trainer reported (the reference
    code paths agree with the fast ones on a slice), and its experts sit on the MXFP4 grid."""
    (d, r), _ = runs
    model = load_hf(d / "hf")
    for layer in model.layers:
        if hasattr(layer.ffn, "gate_exps"):
            for w in (layer.ffn.gate_exps, layer.ffn.up_exps, layer.ffn.down_exps):
                assert torch.equal(mxfp4_round(w.detach()), w.detach())
    from tokenizers import Tokenizer

    from k3kit.mini import data
    from k3kit.mini.corpus import build_corpus
    tok = Tokenizer.from_file(str(d / "hf" / "tokenizer.json"))
    held = data.heldout_windows(data.pack(tok, build_corpus(300_000).heldout_docs), 48)
    reference_paths = evaluate(model, held[:3])
    use_fast_kda(model)
    use_fast_moe(model)
    assert evaluate(model, held[:3]) == pytest.approx(reference_paths, abs=1e-5)
    assert evaluate(model, held) == pytest.approx(r.heldout_nll, abs=1e-5)
    cfg = json.loads((d / "hf" / "config.json").read_text())
    tcfg = json.loads((d / "hf" / "tokenizer_config.json").read_text())
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert tok.id_to_token(cfg["bos_token_id"]) == tcfg["bos_token"] == "[BOS]"
    assert tok.id_to_token(cfg["eos_token_id"]) == "[EOS]"
    assert "<|open|>" in tcfg["chat_template"] and "<|end_of_msg|>" in tcfg["chat_template"]


def test_resume_continues_the_same_run(runs, tmp_path):
    """A run stopped at a checkpoint and resumed ends with the uninterrupted run's weights."""
    (a, _), _ = runs
    d = tmp_path / "resumed"
    d.mkdir()
    first = train(d, _settings(stop_at=20, checkpoint_every=1000), _cfg(), log=lambda m: None)
    assert first.steps == 20
    assert (d / "hf" / "model.safetensors").read_bytes() != (a / "hf" / "model.safetensors").read_bytes()
    train(d, _settings(), _cfg(), resume=True, log=lambda m: None)
    assert (d / "hf" / "model.safetensors").read_bytes() == (a / "hf" / "model.safetensors").read_bytes()
    assert [x["step"] for x in _log(d)] == [x["step"] for x in _log(a)]


def test_bad_settings_are_user_errors(tmp_path, capsys):
    with pytest.raises(K3Error, match="--steps or --minutes"):
        train(tmp_path, TrainSettings(), _cfg())
    with pytest.raises(K3Error, match="no checkpoint"):
        train(tmp_path / "x", _settings(), _cfg(), resume=True)
    assert main(["mini", "train", "--out", str(tmp_path / "y")]) == 2
    assert "--steps or --minutes" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["mini", "train", "--out", str(f), "--steps", "3"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_ship_writes_gguf_card_and_qat_table(runs, tmp_path):
    """The shipping step: GGUF from the converter, a QAT table whose rows are real re-encodings,
    the curve and the card; the shipped GGUF scores like the checkpoint it came from."""
    from k3kit.gguf.reader import GGUFFile
    from k3kit.gguf.shards import Model
    from k3kit.mini.card import ship

    (d, r), _ = runs
    dest = ship(d, tmp_path / "mini-k3", log=lambda m: None)
    for name in ("hf/config.json", "hf/model.safetensors", "hf/tokenizer.json", "hf/tokenizer_config.json",
                 "mini-k3.gguf", "MODEL_CARD.md", "training_curve.png", "qat.json", "corpus_manifest.json"):
        assert (dest / name).is_file(), name
    assert (dest / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = Model.open(dest / "mini-k3.gguf")
    types = {t.name: t.ggml_type.name for t in m.tensors.values()}
    m.close()
    # the model's name, not its checkpoint directory's (`hf`): `k3kit serve` reports it as the model id
    assert GGUFFile.open(dest / "mini-k3.gguf").kv["general.name"].value == "mini-k3"
    assert types["blk.1.ffn_gate_exps.weight"] == "MXFP4" and types["blk.1.attn_q.weight"] == "Q8_0"
    table = json.loads((dest / "qat.json").read_text())
    assert [(x["trunk"], x["experts"]) for x in table[:4]] == [
        ("BF16", "MXFP4"), ("Q8_0", "MXFP4"), ("Q8_0", "MXFP4 -> Q4_K"), ("Q8_0 -> Q4_K", "MXFP4")]
    assert table[0]["heldout_nll"] == pytest.approx(r.heldout_nll, abs=0.02)     # BF16 trunk
    assert json.loads((dest / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert abs(table[1]["heldout_nll"] - table[0]["heldout_nll"]) < 0.02          # Q8_0 trunk: tiny loss
    assert table[2]["heldout_nll"] != table[1]["heldout_nll"]                     # Q4_K experts differ
    card = (dest / "MODEL_CARD.md").read_text()
    assert f"{r.heldout_ppl:.2f}" in card and f"{r.unigram_ppl:.1f}" in card
    assert "| held-out |" in card and "sha256" in card
    if len(table) > 4:      # llama-cpp-python installed: llama.cpp scores the shipped GGUF alike
        assert table[4]["heldout_nll"] == pytest.approx(table[4]["torch_same_windows_nll"], abs=0.02)
