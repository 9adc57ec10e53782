"""`k3kit mini train-draft` on a random tiny K3: the batched training forward is the runtime's
forward, training lowers the loss on blocks it never saw, runs are deterministic, and the
saved checkpoint converts with `k3kit draft convert` and loads back unchanged."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from k3_checkpoint import write_checkpoint  # noqa: E402

from k3kit.cli import main  # noqa: E402
from k3kit.convert.draft import convert_draft  # noqa: E402
from k3kit.convert.target import convert_target  # noqa: E402
from k3kit.errors import K3Error  # noqa: E402
from k3kit.gguf import quants  # noqa: E402
from k3kit.gguf.reader import GGUFFile  # noqa: E402
from k3kit.mini import paths, tokenizer  # noqa: E402
from k3kit.mini.draft.batch import block_hidden, context_kv  # noqa: E402
from k3kit.mini.draft.io import load_draft, load_gguf_draft, save_draft  # noqa: E402
from k3kit.mini.draft.ship import ship  # noqa: E402
from k3kit.mini.draft.train import (  # noqa: E402
    DraftTrainSettings,
    default_taps,
    load_target,
    make_round,
    round_loss,
    sample_blocks,
    train_draft_model,
)
from k3kit.models.dflash.config import DraftConfig  # noqa: E402
from k3kit.models.dflash.names import gguf_tensor_name  # noqa: E402
from k3kit.models.dflash.network import DSparkDraft  # noqa: E402


def _settings(**kw) -> DraftTrainSettings:
    base = dict(steps=30, seqs=6, prompt_len=8, gen_len=32, anchors=12, reuse=3, lr=1e-2, warmup=3,
                layers=1, heads=2, kv_heads=2, intermediate=96, markov_rank=16, eval_prompts=2,
                eval_prompt_len=8, eval_tokens=16, log_every=1000, seed=3)
    base.update(kw)
    return DraftTrainSettings(**base)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny K3 (HF checkpoint + F32 GGUF), its tokenizer's [MASK] id and a token stream."""
    d = tmp_path_factory.mktemp("tiny")
    write_checkpoint(d / "hf", seed=1)
    convert_target(d / "hf", d / "tiny.gguf", "F32")
    target, tok = load_target(d / "hf")
    mask = tok.token_to_id(tokenizer.MASK)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, target.cfg.vocab_size - len(tokenizer.SPECIAL_TOKENS), (4000,), generator=g)
    return d, target, mask, stream


@pytest.fixture(scope="module")
def runs(tiny):
    _, target, mask, stream = tiny
    prompts = [stream[i * 50: i * 50 + 8].tolist() for i in range(2)]
    quiet = dict(log=lambda m: None)
    a = train_draft_model(target, stream[:3000], prompts, mask, _settings(), **quiet)
    b = train_draft_model(target, stream[:3000], prompts, mask, _settings(), **quiet)
    return a, b


def test_default_taps_scale_k3_depths():
    assert default_taps(93) == (6, 22, 50, 66, 82)          # K3's target_layers 7/23/51/67/83, minus 1
    assert default_taps(6) == (0, 2, 3, 4)                   # the mini K3: layer inputs 1, 3, 4, 5
    assert all(0 <= i < 3 for i in default_taps(4))


def test_batched_forward_is_the_runtime_forward():
    """Each block of the batched training forward equals DSparkDraft.forward with exactly the
    context rows before its anchor (what the runtime's feature ring holds then)."""
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=100, block_size=7, target_layer_ids=(0, 2),
                      mask_token_id=99, markov_rank=8, has_confidence=True)
    d = DSparkDraft(cfg, embed=torch.randn(100, 64), lm_head=torch.randn(100, 64))
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
    taps = torch.randn(3, 20, 128)
    ids = torch.randint(0, 99, (5, 7))
    ids[:, 1:] = 99
    anchor, seq = torch.tensor([0, 5, 19, 3, 12]), torch.tensor([0, 1, 2, 2, 0])
    h = block_hidden(d, ids, anchor, seq, context_kv(d, taps))
    for n in range(5):
        t, s = int(anchor[n]), int(seq[n])
        ctx = d.context_kv(taps[s, :t], torch.arange(t)) if t else None
        ref = d(ids[n], torch.arange(t, t + 7), ctx)
        torch.testing.assert_close(h[n], ref, atol=1e-5, rtol=1e-5)


def test_blocks_are_anchored_on_generated_text_with_greedy_labels(tiny):
    _, target, mask, stream = tiny
    s = _settings()
    rd = make_round(target, stream, s, default_taps(target.cfg.num_layers), 0)
    assert rd.seqs.shape == (s.seqs, s.prompt_len + s.gen_len)
    # generated tokens are the full forward's greedy tokens (decode with state == one pass)
    assert rd.consistency == 1.0
    g = torch.Generator().manual_seed(0)
    ids, labels, anchor, seq = sample_blocks(rd, s.anchors, 7, mask, g)
    assert ids.shape == labels.shape == (s.seqs * s.anchors, 7)
    assert (ids[:, 1:] == mask).all() and (ids[:, 0] == rd.seqs[seq, anchor]).all()
    assert int(anchor.min()) >= s.prompt_len and int(anchor.max()) + 7 <= rd.seqs.shape[1]
    # label k is the target's greedy token after row k, i.e. (inside the sequence) the
    # generated token at anchor + k + 1
    T = rd.seqs.shape[1]
    for k in range(7):
        assert (labels[:, k] == rd.greedy[seq, anchor + k]).all()
        inside = anchor + k + 1 < T
        assert (labels[inside, k] == rd.seqs[seq[inside], anchor[inside] + k + 1]).all()


def test_training_lowers_loss_on_unseen_blocks(tiny, runs):
    _, target, mask, stream = tiny
    a, _ = runs
    s = _settings()
    held = make_round(target, stream[3000:], s, a.draft.cfg.target_layer_ids, 0)   # text never trained on
    untrained = train_draft_model(target, stream[:3000], [], mask, _settings(steps=1, lr=1e-9),
                                  log=lambda m: None)
    ce0, acc0 = round_loss(untrained.draft, held, 12, seed=5)
    ce1, acc1 = round_loss(a.draft, held, 12, seed=5)
    assert ce1 < ce0 - 0.3, (ce0, ce1)
    assert acc1 >= acc0, (acc0, acc1)
    first, last = a.history[0], a.history[-1]
    assert last.ce < first.ce - 0.3, (first.ce, last.ce)
    # acceptance through the runtime loop was measured before and after, consistently
    for acc in (a.before, a.after):
        assert acc.passes == sum(acc.histogram) > 0
        assert 1.0 <= acc.tau <= 8.0
        assert acc.passes <= acc.tokens <= 8 * acc.passes


def test_training_is_deterministic(runs):
    a, b = runs
    assert [h.loss for h in a.history] == [h.loss for h in b.history]
    for (na, pa), (nb, pb) in zip(a.draft.named_parameters(), b.draft.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    assert a.after.histogram == b.after.histogram


def test_checkpoint_converts_and_loads_back(tiny, runs, tmp_path):
    d, target, _, _ = tiny
    draft = runs[0].draft
    hf = save_draft(draft, tmp_path / "hf", num_target_layers=target.cfg.num_layers,
                    max_position_embeddings=target.cfg.max_position_embeddings)
    back = load_draft(hf)
    assert back.cfg == draft.cfg
    for (n, p), (m, q) in zip(draft.named_parameters(), back.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n

    out = tmp_path / "draft.gguf"
    r = convert_draft(hf, d / "tiny.gguf", out, out_type="F32", progress=False)
    assert r is not None
    f = GGUFFile.open(out)
    kv = {k: v.value for k, v in f.kv.items()}
    assert kv["general.architecture"] == "dflash"
    assert list(np.asarray(kv["dflash.target_layers"])) == [i + 1 for i in draft.cfg.target_layer_ids]
    assert kv["dflash.block_size"] == 7 and kv["tokenizer.ggml.mask_token_id"] == draft.cfg.mask_token_id
    tensors = {t.name: quants.dequantize(f.view(t), t.ggml_type, t.n_elements).reshape(t.np_shape)
               for t in f.tensors}
    assert set(tensors) == {gguf_tensor_name(n) for n, _ in draft.named_parameters()}
    # F32: every value survives; the GGUF loads into a draft with the same config and parameters
    fresh = load_gguf_draft(out, trunk="float")
    assert fresh.cfg.block_size == 7 and fresh.cfg.target_layer_ids == draft.cfg.target_layer_ids
    assert fresh.cfg.markov_rank == draft.cfg.markov_rank and fresh.cfg.has_confidence
    for (n, p), (_, q) in zip(draft.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach()), n
    # Q8_0 (what ships): close, not equal
    q8 = load_gguf_draft(convert_draft(hf, d / "tiny.gguf", tmp_path / "q8.gguf", progress=False) and
                         tmp_path / "q8.gguf", trunk="float")
    w, wq = draft.fc.weight.detach(), q8.fc.weight.detach()
    assert not torch.equal(w, wq) and float((w - wq).norm() / w.norm()) < 0.01


def test_load_draft_rejects_mismatched_tensors(runs, tmp_path):
    draft = runs[0].draft
    hf = save_draft(draft, tmp_path / "hf", num_target_layers=4, max_position_embeddings=128)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["markov_rank"] = 8                       # the file holds rank-16 Markov weights
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(K3Error, match="model.safetensors"):
        load_draft(hf)


def test_cli_train_draft_then_ship(tiny, tmp_path, capsys, monkeypatch):
    d, _, _, _ = tiny
    out = tmp_path / "run"
    rc = main(["mini", "train-draft", "--target", str(d / "hf"), "--out", str(out), "--steps", "2",
               "--seqs", "2", "--gen-len", "16", "--anchors", "4", "--reuse", "1", "--layers", "1",
               "--markov-rank", "8", "--card-tokens", "8", "--corpus-bytes", "300000", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2
    assert {"held-out stdlib code", "chat"} <= set(summary["workloads"])
    for w in summary["workloads"].values():
        assert w["passes"] == sum(w["histogram"]) > 0 and 1.0 <= w["tau"] <= 8.0
    card = (out / "MODEL_CARD.md").read_text()
    assert "| held-out stdlib code |" in card and "block size 7" in card
    assert load_draft(out / "hf").cfg.block_size == 7
    lines = (out / "draft_train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]

    # ship: convert against the target GGUF, measure the file itself, one directory appears
    assets = tmp_path / "assets"
    assets.mkdir()
    dest = assets / paths.DRAFT_DIR
    shipped = ship(out, d / "hf", d / "tiny.gguf", dest, log=lambda m: None)
    assert sorted(p.name for p in assets.iterdir()) == [paths.DRAFT_DIR]     # no staging left behind
    gguf = dest / paths.DRAFT_GGUF_NAME
    assert GGUFFile.open(gguf).kv["general.name"].value == paths.DRAFT_DIR     # not `hf`, its source's
    want = load_draft(out / "hf").cfg
    got = load_gguf_draft(gguf).cfg
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)          # a float32 in the GGUF
    assert dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps) == want
    assert shipped["shipped"]["workloads"].keys() == summary["workloads"].keys()
    assert "Q8_0, loaded back from the file" in (dest / "MODEL_CARD.md").read_text()
    assert json.loads((dest / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_draft(dest / "hf").cfg == load_draft(out / "hf").cfg
    monkeypatch.setattr(paths, "assets_dir", lambda: assets)
    assert main(["mini", "path", "--draft"]) == 0
    assert Path(capsys.readouterr().out.strip()) == gguf.resolve()


def test_cli_bad_settings_are_user_errors(tiny, tmp_path, capsys):
    d, _, _, _ = tiny
    assert main(["mini", "train-draft", "--target", str(d / "hf"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3kit: error: ") and "--steps or --minutes" in err
