"""Tokenizer KVs: llama.cpp's kimi-k2 split, and the HF tokenizer <-> GGUF `tokenizer.*` KVs.

The split is checked against `reference_split`, an independent Python statement of what
llama.cpp's kimi-k2 splitter (src/unicode.cpp) does, on hand-picked and generated text. The
comparison with llama.cpp itself is tests/interop/test_tokenizer_llama.py. The tokenizer the
KVs are written from is the mini K3's, trained in conftest.py.
"""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
from gguf import GGUFValueType as T
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_cases import HAND_PICKED, VOCAB
from tokenizers import Regex, pre_tokenizers

from k3kit.errors import FormatError
from k3kit.gguf.reader import KV, GGUFFile
from k3kit.gguf.writer import write_gguf
from k3kit.mini.tokenizer import BOS, gguf_tokenizer_kv
from k3kit.tokenizer.codec import encode
from k3kit.tokenizer.gguf_kv import KIMI_K2_SPLIT, special_ids_from_kv, tokenizer_from_kv

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


# ---------------------------------------------------------------- GGUF KVs


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
