"""`k3kit mini chat-tune`: a short run from the shipped mini writes a directory `k3kit mini ship` reads,
with K3's chat markers in the tokenizer and the stage described in the summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from k3kit.errors import K3Error
from k3kit.mini import paths
from k3kit.mini.chat_tune import ChatTuneSettings, chat_tune
from k3kit.mini.tokenizer import CHAT_TEMPLATE


def test_a_short_chat_stage_writes_a_shippable_run(tmp_path):
    from tokenizers import Tokenizer

    from k3kit.adapters.kimi_k3_hf import load_hf

    base = paths.shipped_hf().parent
    out = tmp_path / "run"
    s = ChatTuneSettings(steps=3, conversations=40, heldout_chats=6, code_every=2)
    summary = chat_tune(base, out, s, log=lambda m: None)
    for name in ("hf/config.json", "hf/model.safetensors", "hf/tokenizer.json", "hf/tokenizer_config.json",
                 "train_log.jsonl", "summary.json", "train_settings.json", "corpus_manifest.json"):
        assert (out / name).is_file(), name
    tok = Tokenizer.from_file(str(out / "hf/tokenizer.json"))
    assert tok.token_to_id("<|end_of_msg|>") == 4092 and tok.token_to_id("<|im_end|>") is None
    tcfg = json.loads((out / "hf/tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == CHAT_TEMPLATE
    chat = summary["chat"]
    assert chat["steps"] == 3 and chat["chat_tokens"] > 0 and chat["heldout_chats"] >= 1
    assert summary["steps"] == summary["base"]["steps"] + 3
    assert chat["chat_nll"] < chat["chat_nll_before"] + 1.0
    rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert rows[-1]["stage"] == "chat" and rows[-1]["step"] == summary["steps"]
    assert json.loads((out / "train_settings.json").read_text())["chat"]["steps"] == 3
    assert load_hf(out / "hf").cfg.vocab_size == tok.get_vocab_size()


def test_bad_inputs(tmp_path):
    with pytest.raises(K3Error, match="chat_batch"):
        ChatTuneSettings(chat_batch=0).validate()
    with pytest.raises(K3Error, match="missing"):
        chat_tune(tmp_path, tmp_path / "out", ChatTuneSettings(steps=1))
    r = subprocess.run([sys.executable, "-m", "k3kit", "mini", "chat-tune", "--from", str(tmp_path),
                        "--out", str(tmp_path / "o"), "--steps", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "missing" in r.stderr and "Traceback" not in r.stderr


def test_the_chat_loss_weighs_what_the_assistant_writes():
    """Weight 1 on exactly the tokens of assistant messages (from after the opener to their
    `<|end_of_msg|>`), `prompt_weight` on the rest: tool declarations, requests, results."""
    import re

    from tokenizers import Tokenizer

    from k3kit.mini import chat_data
    from k3kit.mini.chat_tune import chat_stream_weighted
    from k3kit.mini.corpus import build_corpus
    from k3kit.tokenizer.chat import ChatTemplate

    tok = Tokenizer.from_file(str(paths.shipped_hf() / "tokenizer.json"))
    corpus = build_corpus()
    facts = chat_data.Facts.from_sources(corpus.train_paths, corpus.train_docs)
    template = ChatTemplate(CHAT_TEMPLATE)
    for i in range(12):
        text = chat_data.render(chat_data.conversation(i, facts), template)
        stream, weights, starts = chat_stream_weighted(tok, template, facts, range(i, i + 1), 0.25)
        assert starts == [0] and stream.shape == weights.shape
        assert set(weights.tolist()) <= {0.25, 1.0}
        ids = stream.tolist()
        mine = tok.decode([t for t, w in zip(ids, weights.tolist(), strict=True) if w == 1.0],
                          skip_special_tokens=False)
        spans = re.findall(r'<\|open\|>message role="assistant"[^<]*<\|sep\|>(.*?<\|end_of_msg\|>)',
                           text, re.S)
        assert spans and mine == "".join(spans), i
    with pytest.raises(K3Error, match="prompt_weight"):
        ChatTuneSettings(prompt_weight=1.5).validate()
