"""The mini K3 tokenizer: llama.cpp's kimi-k2 split, BPE training, special tokens, chat template, GGUF KVs.

The split is checked against `reference_split`, an independent Python statement of what
llama.cpp's kimi-k2 splitter (src/unicode.cpp) does, on hand-picked and generated text. The
comparison with llama.cpp itself is tests/interop/test_tokenizer_llama.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import unicodedata

import jinja2
import numpy as np
import pytest
from gguf import GGUFValueType as T
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

from k3kit.errors import FormatError, K3Error
from k3kit.gguf.reader import KV, GGUFFile
from k3kit.gguf.tokenizer_kv import KIMI_K2_SPLIT, special_ids_from_kv, tokenizer_from_kv
from k3kit.gguf.writer import write_gguf
from k3kit.mini.corpus import build_corpus
from k3kit.mini.tokenizer import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    MASK,
    MAX_TOKEN_BYTES,
    PAD,
    SPECIAL_TOKENS,
    apply_chat_template,
    encode,
    gguf_tokenizer_kv,
    special_token_ids,
    tokenizer_manifest,
    train_tokenizer,
)

VOCAB = 512

# ---------------------------------------------------------------- reference split

_WS = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000")
_WS |= {chr(c) for c in range(0x2000, 0x200B)}
_HAN = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]


def reference_split(text: str) -> list[str]:
    """llama.cpp's kimi-k2 pre-tokenizer, restated from its description, for characters whose
    Unicode category is the same in Python's tables, Oniguruma's and llama.cpp's."""
    n = len(text)

    def cat(i):
        return unicodedata.category(text[i]) if i < n else ""

    def letter(i):
        return cat(i).startswith("L")

    def number(i):
        return cat(i).startswith("N")

    def space(i):
        return i < n and text[i] in _WS

    def han(i):
        return i < n and any(a <= ord(text[i]) <= b for a, b in _HAN)

    out, pos, start = [], 0, 0

    def cut(end):
        nonlocal start
        if end > start:
            out.append(text[start:end])
        start = end

    while pos < n:
        c = text[pos]
        if han(pos):
            while han(pos):
                pos += 1
            cut(pos)
            continue
        lead = c not in "\r\n" and not letter(pos) and not number(pos)
        if (letter(pos) and not han(pos)) or (lead and letter(pos + 1) and not han(pos + 1)):
            pos += 1
            while letter(pos) and not han(pos):
                pos += 1
            rest = text[pos:pos + 3].lower()
            if rest[:2] in ("'s", "'t", "'m", "'d") and rest[1:2] == text[pos + 1:pos + 2].lower():
                pos += 2
            elif rest in ("'re", "'ve", "'ll"):
                pos += 3
            cut(pos)
            continue
        if number(pos):
            while number(pos):
                run = pos
                while number(pos) and pos - run < 3:
                    pos += 1
                cut(pos)
            continue
        p = pos + 1 if c == " " else pos
        if p < n and not (space(p) or letter(p) or number(p)):
            pos = p
            while pos < n and not (space(pos) or letter(pos) or number(pos)):
                pos += 1
            while pos < n and text[pos] in "\r\n":
                pos += 1
            cut(pos)
            continue
        nws, last_nl = 0, 0
        while space(pos + nws):
            if text[pos + nws] in "\r\n":
                last_nl = pos + nws + 1
            nws += 1
        if last_nl:
            pos = last_nl
        elif nws > 1 and pos + nws < n:
            pos += nws - 1
        elif nws:
            pos += nws
        else:
            pos += 1
        cut(pos)
    return out


_SPLIT = pre_tokenizers.Split(Regex(KIMI_K2_SPLIT), behavior="isolated")


def hf_split(text: str) -> list[str]:
    return [piece for piece, _ in _SPLIT.pre_tokenize_str(text)]


ALPHABET = list(
    # letters, Han, and the Nl/Lm characters next to the Han blocks
    "aBzZqé\u00dfΣωжЖ\u05d0\u0627ア한中文字\u3007\u3005\uf900\U0002f800\U00020000"
    "0159²½Ⅻ٣"  # numbers
    "'sStTrReEvVlLmMdD"  # contraction material
    " \t\n\r\x0b\x0c\xa0\u3000\u2028\u2003\x85"  # whitespace per llama.cpp
    ".,;:()[]{}#_-+*/\\\"`~!?@$%^&|<>="  # ASCII punctuation
    "\u0301\u200b\ufeff\x00\x1f€©😀🚀"  # marks, format, control, symbols, emoji
)

HAND_PICKED = [
    "def foo(x):\n    return x + 1234567  # it's 'ok'\n",
    "1 12 123 1234 12345 1234567 0.5 3.14159 1e-10 10_000",
    "HelloWorld camelCase snake_case CONSTANT_VALUE __init__",
    "it's IT'S they're we've I'm you'll he'd 'tis rock'n'roll o'clock",
    "café naïve Ångström Ελληνικά русский עברית العربية",
    "中文测试，你好世界！日本語のテキスト한국어 텍스트",
    "emoji 😀🚀 👍🏽 family 👨‍👩‍👧",
    "tabs\tand\t\ttabs   spaces    trailing   \n\n\nlines\r\nwindows\r\n \n  \n",
    "   leading spaces and trailing   ",
    "<|im_end|>[BOS] text <|im_user|>user<|im_middle|>hi<|im_end|>",
    "\u3000ideographic\u00a0nbsp\u2028ls",
    "",
    " ",
    "\n",
    "a",
]


@pytest.mark.parametrize("text", HAND_PICKED)
def test_split_matches_reference_hand_picked(text):
    assert hf_split(text) == reference_split(text)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(ALPHABET), max_size=40))
def test_split_matches_reference_generated(text):
    assert hf_split(text) == reference_split(text)


def test_split_examples():
    assert hf_split("x1234567") == ["x", "123", "456", "7"]
    assert hf_split(" it's") == [" it's"]  # contraction stays with its word, leading space too
    assert hf_split("CamelCase") == ["CamelCase"]  # llama.cpp's kimi-k2 does not split case changes
    assert hf_split("ab中文cd") == ["ab", "中文", "cd"]
    assert hf_split("a   b") == ["a", "  ", " b"]
    assert hf_split("x  \n\n y") == ["x", "  \n\n", " y"]
    assert hf_split("f(x)):\n") == ["f", "(x", ")):\n"]  # punctuation run keeps its newlines


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


def test_special_tokens_in_text(tok):
    ids = special_token_ids(tok)
    text = f"a{IM_END}b{BOS}"
    got = encode(tok, text)
    assert ids["im_end"] in got and ids["bos"] in got
    plain = encode(tok, text, special=False)
    assert not set(plain) & set(ids.values())
    assert tok.decode(plain, skip_special_tokens=False) == text
    assert encode(tok, "x", add_bos=True)[0] == ids["bos"]
    assert encode(tok, "x", add_bos=False) == encode(tok, "x", add_bos=True)[1:]


def test_bad_training_inputs():
    with pytest.raises(K3Error, match="no room"):
        train_tokenizer(["abc"], vocab_size=256 + len(SPECIAL_TOKENS))
    with pytest.raises(K3Error, match="corpus too small"):
        train_tokenizer(["print('hello world')\n"] * 3, vocab_size=1024)


# ---------------------------------------------------------------- chat template

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?\n"}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": "{\"f\": 1}"},
     {"role": "tool", "content": "result <b>&</b> 'quoted'"}],
    [],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_jinja_template_renders_like_python(messages, add_generation_prompt):
    env = jinja2.Environment()

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    template = env.from_string(CHAT_TEMPLATE)
    rendered = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
    assert rendered == apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def test_chat_rendering():
    got = apply_chat_template(CONVERSATIONS[1][:2])
    assert got == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                   "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>")
    with pytest.raises(K3Error, match="unknown role"):
        apply_chat_template([{"role": "bot", "content": "x"}])
    with pytest.raises(K3Error, match="content"):
        apply_chat_template([{"role": "user", "content": None}])


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
                                       "eot": tokens.index(IM_END), "pad": VOCAB - 1, "mask": VOCAB - 2}
    assert kv["tokenizer.ggml.mask_token_id"].vtype == T.UINT32
    assert kv["tokenizer.ggml.add_bos_token"].value is True
    assert kv["tokenizer.chat_template"].value == CHAT_TEMPLATE


def test_tokenizer_from_gguf_round_trip(tmp_path, corpus, tok):
    path = write_gguf(tmp_path / "tok.gguf", [KV("general.architecture", T.STRING, "llama")]
                      + gguf_tokenizer_kv(tok), [])
    f = GGUFFile.open(path)
    back = tokenizer_from_kv(f.kv, str(path))
    assert back.get_vocab(with_added_tokens=True) == tok.get_vocab(with_added_tokens=True)
    lines = "".join(corpus.heldout_docs).splitlines(keepends=True)[:300] + HAND_PICKED
    for text in lines:
        assert encode(back, text) == encode(tok, text)
        assert encode(back, text, special=False) == encode(tok, text, special=False)
    assert back.decode(encode(back, HAND_PICKED[4])) == HAND_PICKED[4]
    assert back.encode("x").ids == [tok.token_to_id(BOS)] + encode(tok, "x")  # add_bos_token from the KVs
    no_bos = dict(f.kv)
    no_bos["tokenizer.ggml.add_bos_token"] = KV("tokenizer.ggml.add_bos_token", T.BOOL, False)
    assert tokenizer_from_kv(no_bos).encode("x").ids == encode(tok, "x")


def _kv_dict(tok):
    return {k.key: k for k in gguf_tokenizer_kv(tok)}


@pytest.mark.parametrize("key,item,match", [
    ("tokenizer.ggml.model", KV("tokenizer.ggml.model", T.STRING, "llama"), "only 'gpt2'"),
    ("tokenizer.ggml.pre", KV("tokenizer.ggml.pre", T.STRING, "qwen2"), "not supported"),
    ("tokenizer.ggml.pre", KV("tokenizer.ggml.pre", T.UINT32, 3), "expected STRING"),
    ("tokenizer.ggml.tokens", None, "missing tokenizer.ggml.tokens"),
    ("tokenizer.ggml.tokens", KV("tokenizer.ggml.tokens", T.ARRAY, np.zeros(4, np.int32), T.INT32),
     "expected ARRAY of STRING"),
    ("tokenizer.ggml.merges", KV("tokenizer.ggml.merges", T.ARRAY, ["Ġ t", "nope x"], T.STRING),
     r"merges\[1\]"),
    ("tokenizer.ggml.merges", KV("tokenizer.ggml.merges", T.ARRAY, ["Ġt"], T.STRING), r"merges\[0\]"),
    ("tokenizer.ggml.token_type", KV("tokenizer.ggml.token_type", T.ARRAY, np.ones(3, np.int32), T.INT32),
     "3 entries"),
    ("tokenizer.ggml.mask_token_id", KV("tokenizer.ggml.mask_token_id", T.UINT32, VOCAB),
     "outside the vocab"),
])
def test_hostile_kvs(tok, key, item, match):
    kv = _kv_dict(tok)
    if item is None:
        del kv[key]
    else:
        kv[key] = item
    check = special_ids_from_kv if key.endswith("_id") else tokenizer_from_kv
    with pytest.raises(FormatError, match=f"bad.gguf: .*{match}"):
        check(kv, "bad.gguf")


def test_duplicate_tokens_rejected(tok):
    kv = _kv_dict(tok)
    tokens = list(kv["tokenizer.ggml.tokens"].value)
    tokens[300] = tokens[299]
    kv["tokenizer.ggml.tokens"] = KV("tokenizer.ggml.tokens", T.ARRAY, tokens, T.STRING)
    with pytest.raises(FormatError, match="bad.gguf: .*duplicate"):
        tokenizer_from_kv(kv, "bad.gguf")


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
