"""The mini K3 tokenizer's training: vocab layout, determinism, compression, its KVs and manifest.

What the tokenizer package does with any tokenizer (the split, KVs <-> tokenizer, encode, chat
templates) is tested in tests/tokenizer/.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType as T
from tokenizers import pre_tokenizers

from k3kit.errors import K3Error
from k3kit.mini.corpus import build_corpus
from k3kit.mini.tokenizer import (
    BOS,
    CHAT_TEMPLATE,
    CHAT_TOKENS,
    END_OF_MSG,
    EOS,
    MASK,
    MAX_TOKEN_BYTES,
    PAD,
    SPECIAL_TOKENS,
    gguf_tokenizer_kv,
    special_token_ids,
    tokenizer_manifest,
    train_tokenizer,
    with_chat_tokens,
)
from k3kit.tokenizer.codec import encode
from k3kit.tokenizer.gguf_kv import special_ids_from_kv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tokenizer"))
from tokenizer_cases import HAND_PICKED, VOCAB  # noqa: E402

# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(max_bytes=600_000)


@pytest.fixture(scope="module")
def tok(corpus):
    return train_tokenizer(corpus.train_docs, VOCAB)


def test_vocab_layout(tok):
    assert tok.get_vocab_size() == VOCAB
    ids = special_token_ids(tok)
    n = len(SPECIAL_TOKENS)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(VOCAB - n, VOCAB))
    assert ids["pad"] == VOCAB - 1 and ids["mask"] == VOCAB - 2 and ids["bos"] == VOCAB - n
    added = tok.get_added_tokens_decoder()
    assert sorted(added) == list(range(VOCAB - n, VOCAB))
    assert all(a.special for a in added.values())
    # Byte-level token strings have one character per byte.
    assert max(len(tok.id_to_token(i)) for i in range(VOCAB - n)) <= MAX_TOKEN_BYTES
    # All 256 byte symbols are tokens, so any text encodes without an unknown token.
    vocab = tok.get_vocab()
    assert all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet())


def test_training_is_deterministic_across_processes(corpus, tok):
    code = ("from k3kit.mini.corpus import build_corpus; from k3kit.mini.tokenizer import train_tokenizer;"
            f"print(train_tokenizer(build_corpus(max_bytes=600_000).train_docs, {VOCAB}).to_str())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    assert json.loads(out) == json.loads(tok.to_str())


def test_round_trip_and_compression(tok):
    held = build_corpus().heldout_docs
    for doc in held:
        assert tok.decode(encode(tok, doc), skip_special_tokens=False) == doc
    # Merges learned on the train files compress files never seen (1.0 = bytes; measured ~1.9).
    text = "".join(held)
    assert len(text.encode()) / len(encode(tok, text)) > 1.7
    for text in HAND_PICKED:
        assert tok.decode(encode(tok, text), skip_special_tokens=False) == text


def test_bad_training_inputs():
    with pytest.raises(K3Error, match="no room"):
        train_tokenizer(["abc"], vocab_size=256 + len(SPECIAL_TOKENS))
    with pytest.raises(K3Error, match="corpus too small"):
        train_tokenizer(["print('hello world')\n"] * 3, vocab_size=1024)


# ---------------------------------------------------------------- GGUF KVs


def test_kv_contents(tok):
    kv = {k.key: k for k in gguf_tokenizer_kv(tok)}
    assert kv["tokenizer.ggml.model"].value == "gpt2"
    assert kv["tokenizer.ggml.pre"].value == "kimi-k2"
    tokens = kv["tokenizer.ggml.tokens"].value
    assert len(tokens) == VOCAB and tokens[-1] == PAD and tokens[-2] == MASK
    types = kv["tokenizer.ggml.token_type"]
    assert types.item_type == T.INT32
    assert list(types.value[-len(SPECIAL_TOKENS):]) == [3] * len(SPECIAL_TOKENS)
    assert set(types.value[:-len(SPECIAL_TOKENS)].tolist()) == {1}
    merges = kv["tokenizer.ggml.merges"].value
    assert len(merges) == VOCAB - len(SPECIAL_TOKENS) - 256
    assert all(a + b in tokens for a, b in (m.split(" ") for m in merges))
    assert special_ids_from_kv(kv) == {"bos": tokens.index(BOS), "eos": tokens.index(EOS),
                                       "eot": tokens.index(END_OF_MSG), "pad": VOCAB - 1, "mask": VOCAB - 2}
    assert kv["tokenizer.ggml.mask_token_id"].vtype == T.UINT32
    assert kv["tokenizer.ggml.add_bos_token"].value is True
    assert kv["tokenizer.chat_template"].value == CHAT_TEMPLATE


def test_manifest(tok):
    m = tokenizer_manifest(tok)
    assert m["pre"] == "kimi-k2" and m["vocab_size"] == VOCAB
    assert m["merges"] == VOCAB - 256 - len(SPECIAL_TOKENS)
    assert m["special_tokens"]["[MASK]"] == VOCAB - 2
    kv = {k.key: k.value for k in gguf_tokenizer_kv(tok)}
    blob = "\n".join(kv["tokenizer.ggml.tokens"]) + "\n\n" + "\n".join(kv["tokenizer.ggml.merges"])
    assert m["sha256"] == hashlib.sha256(blob.encode()).hexdigest()
    other = train_tokenizer(build_corpus(max_bytes=300_000).train_docs, VOCAB)
    assert tokenizer_manifest(other)["sha256"] != m["sha256"]


# ---------------------------------------------------------------- K3's chat markers


def test_chat_markers_are_single_control_tokens(tok):
    ids = special_token_ids(tok)
    text = '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
    got = tok.encode(text, add_special_tokens=False).ids
    assert got[0] == ids["open"] and got[-1] == ids["end_of_msg"]
    assert got.count(ids["sep"]) == 2 and got.count(ids["close"]) == 1
    assert tok.decode(got, skip_special_tokens=False) == text
    assert "<|open|>" in CHAT_TEMPLATE and "<|end_of_msg|>" in CHAT_TEMPLATE


def test_with_chat_tokens_renames_a_k2_tokenizer_and_keeps_everything_else(tok):
    data = json.loads(tok.to_str())
    k2 = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
    rename = dict(zip(CHAT_TOKENS, k2, strict=False))
    data["model"]["vocab"] = {rename.get(t, t): i for t, i in data["model"]["vocab"].items()}
    for added in data["added_tokens"]:
        added["content"] = rename.get(added["content"], added["content"])
    from tokenizers import Tokenizer

    old = Tokenizer.from_str(json.dumps(data))
    assert old.token_to_id("<|open|>") is None and old.token_to_id("<|im_end|>") == VOCAB - 7
    new = with_chat_tokens(old)
    assert [new.token_to_id(t) for t in CHAT_TOKENS] == list(range(VOCAB - 7, VOCAB - 2))
    assert new.token_to_id("<|im_end|>") is None
    assert json.loads(new.to_str())["model"]["merges"] == json.loads(old.to_str())["model"]["merges"]
    doc = build_corpus(max_bytes=50_000).train_docs[0]
    assert new.encode(doc).ids == old.encode(doc).ids == tok.encode(doc).ids
    assert new.encode("<|end_of_msg|>", add_special_tokens=False).ids == [VOCAB - 4]
    assert with_chat_tokens(new) is new
    broken = json.loads(tok.to_str())
    vocab = broken["model"]["vocab"]
    broken["model"]["vocab"] = {("x" if t == "<|open|>" else t): i for t, i in vocab.items()}
    with pytest.raises(K3Error, match="five chat markers"):
        with_chat_tokens(Tokenizer.from_str(json.dumps(broken)))
