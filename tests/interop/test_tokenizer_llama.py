"""llama.cpp tokenizes a GGUF carrying the mini K3's tokenizer KVs exactly as k3kit does.

A vocab-only GGUF (arch "llama", no tensors) written by k3kit's writer is loaded through
llama-cpp-python; ids, detokenized bytes, special-token ids and flags, and the rendered chat
must match ours, for the test-size vocab and the default one.
"""

from __future__ import annotations

import ctypes
import random

import pytest
from gguf import GGUFValueType as T

from k3kit.gguf.reader import KV, GGUFFile
from k3kit.gguf.writer import write_gguf
from k3kit.mini.corpus import build_corpus
from k3kit.mini.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    gguf_tokenizer_kv,
    special_token_ids,
    train_tokenizer,
)
from k3kit.tokenizer.chat import KIMI_TEMPLATE, render_kimi
from k3kit.tokenizer.codec import TextCodec, encode
from k3kit.tokenizer.gguf_kv import tokenizer_from_kv

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.interop

MIXED = [
    # Python code
    "def foo(x):\n    return x + 1  # it's fine\n",
    "class Foo(Bar):\n\t\"\"\"Doc.\"\"\"\n\n\tdef __init__(self, *args, **kw) -> None:\n\t\tpass\n",
    "if a<=b and c!=d: print(f'{a!r:>10}', end='')\r\n",
    "x = [i ** 2 for i in range(10) if i % 3 == 0]  # comprehension\n",
    "@decorator\nasync def main():\n    await asyncio.sleep(0.5)\n",
    # digit runs
    "1 12 123 1234 12345 123456 1234567 0 007 3.14159 1e-10 10_000 0xFF 2**64",
    "v1.2.3 x86_64 utf8 sha256 1234567890123",
    # unicode
    "café naïve Ångström façade résumé Ελληνικά русский עברית العربية",
    "中文测试，你好世界！日本語のテキストと한국어 텍스트",
    "emoji 😀🚀 thumbs 👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "math ∑ ∫ ≤ ≥ ½ ² Ⅻ ٣ and combining e\u0301",
    # whitespace runs
    "tabs\tand\t\ttabs   spaces    here",
    "trailing spaces   \nnext line  \n\n\n\nafter blank lines",
    "   leading",
    "trailing   ",
    "\n\n",
    " \t \n \r\n",
    "\u3000ideographic\u00a0nbsp\u2028sep",
    # contractions
    "it's don't they're we've I'm you'll he'd IT'S DON'T THEY'RE 'tis o'clock rock'n'roll",
    "' s 't 're x's x''s",
    "'s at the start",
    "'RE'll'VE",
    "''d \n'm",
    # special tokens inside text
    "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "text [BOS] more [EOS]text[MASK][PAD] <|im_system|>",
    "almost special <|im_end| and [BOS and <|im_middle|>>",
    '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|><|open|>think<|sep|>',
    "almost <|open| and <|sep|>> and <|end_of_msg|>[EOS]<|kimi_image_placeholder|>",
    # edge cases
    "",
    " ",
    "a",
    "\x00nul and \x1f unit separator \u200b zero width \ufeff bom",
]

# Characters whose Unicode category every party agrees on, for random strings.
ALPHABET = list(
    "aBzZqé\u00dfΣωжЖ\u05d0\u0627ア한中文字\u3007\u3005\uf900"
    "0159²½Ⅻ٣'sStTrReEvVlLmMdD"
    " \t\n\r\xa0\u3000\u2028.,;:()[]{}#_-+*/\\\"`~!?@$%^&|<>="
    "\u0301\u200b€©😀🚀"
)


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus():
    return build_corpus()


@pytest.fixture(scope="module")
def heldout_lines(corpus):
    lines = "".join(corpus.heldout_docs).splitlines(keepends=True)
    step = max(1, len(lines) // 400)
    return lines[::step][:400]


@pytest.fixture(scope="module", params=[512, 4096], ids=["vocab512", "vocab4096"])
def pair(request, corpus, tmp_path_factory):
    """(our tokenizer, its GGUF path, llama.cpp's Llama on that GGUF)."""
    vocab_size = request.param
    docs = corpus.train_docs if vocab_size > 512 else build_corpus(max_bytes=600_000).train_docs
    tok = train_tokenizer(docs, vocab_size)
    kv = [
        KV("general.architecture", T.STRING, "llama"),
        KV("llama.context_length", T.UINT32, 256),
        KV("llama.embedding_length", T.UINT32, 64),
        KV("llama.block_count", T.UINT32, 1),
        KV("llama.feed_forward_length", T.UINT32, 128),
        KV("llama.attention.head_count", T.UINT32, 4),
        KV("llama.attention.layer_norm_rms_epsilon", T.FLOAT32, 1e-5),
        *gguf_tokenizer_kv(tok),
    ]
    path = write_gguf(tmp_path_factory.mktemp("tok") / f"vocab{vocab_size}.gguf", kv, [])
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    yield tok, path, llm
    llm.close()


def llama_tokenize(llm, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)


def llama_detokenize(llm, ids: list[int]) -> bytes:
    """llama.cpp's own detokenizer (the Python wrapper's per-piece buffer is only 32 bytes)."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 * (len(ids) + 1)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, True)
    assert 0 <= n <= size
    return buf.raw[:n]


def test_tokenize_mixed_text(pair):
    tok, _, llm = pair
    for text in MIXED:
        assert llama_tokenize(llm, text) == encode(tok, text), repr(text)
        assert llama_tokenize(llm, text, special=False) == encode(tok, text, special=False), repr(text)
        assert llama_tokenize(llm, text, add_bos=True) == encode(tok, text, add_bos=True), repr(text)


def test_tokenize_random_text(pair):
    tok, _, llm = pair
    for text in random_texts(300, seed=len(tok.get_vocab())):
        assert llama_tokenize(llm, text) == encode(tok, text), repr(text)


def test_tokenize_heldout_corpus(pair, corpus, heldout_lines):
    tok, _, llm = pair
    assert len(heldout_lines) >= 200
    for line in heldout_lines:
        assert llama_tokenize(llm, line) == encode(tok, line), repr(line)
    doc = corpus.heldout_docs[0]  # a whole file, as the model sees it
    assert llama_tokenize(llm, doc) == encode(tok, doc)


def test_detokenize_round_trip(pair, heldout_lines):
    tok, _, llm = pair
    for text in MIXED + heldout_lines + random_texts(100, seed=7):
        ids = encode(tok, text)
        assert llama_detokenize(llm, ids) == text.encode("utf-8"), repr(text)
        assert llm.detokenize(ids, special=True) == text.encode("utf-8"), repr(text)
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_vocab_metadata(pair):
    tok, _, llm = pair
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n = tok.get_vocab_size()
    ids = special_token_ids(tok)
    assert llama_cpp.llama_vocab_n_tokens(vocab) == n
    assert llama_cpp.llama_vocab_bos(vocab) == ids["bos"]
    assert llama_cpp.llama_vocab_eos(vocab) == ids["eos"]
    assert llama_cpp.llama_vocab_eot(vocab) == ids["end_of_msg"]
    assert llama_cpp.llama_vocab_pad(vocab) == ids["pad"] == n - 1
    assert llama_cpp.llama_vocab_mask(vocab) == ids["mask"] == n - 2
    assert llama_cpp.llama_vocab_get_add_bos(vocab) is True
    assert llama_cpp.llama_vocab_get_add_eos(vocab) is False
    for text in SPECIAL_TOKENS:
        i = tok.token_to_id(text)
        assert llama_cpp.llama_vocab_is_control(vocab, i), text
        assert llama_cpp.llama_vocab_get_text(vocab, i) == text.encode()
    for i in (0, 100, n - len(SPECIAL_TOKENS) - 1):
        assert not llama_cpp.llama_vocab_is_control(vocab, i)
    assert llama_cpp.llama_vocab_is_eog(vocab, ids["eos"])
    assert llama_cpp.llama_vocab_is_eog(vocab, ids["end_of_msg"])
    assert not llama_cpp.llama_vocab_is_eog(vocab, ids["bos"])


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?\n"}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": "{\"f\": 1}"},
     {"role": "tool", "content": "result 'quoted' 中文"}],
]


def llama_chat(template: bytes, messages, add_ass: bool) -> str:
    msgs = [llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode())
            for m in messages]
    arr = (llama_cpp.llama_chat_message * len(msgs))(*msgs)
    size = 4096
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template, arr, len(messages), add_ass, buf, size)
    assert 0 < n <= size, n
    return buf.raw[:n].decode("utf-8")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_llama_builtin(pair, add_generation_prompt):
    tok, _, llm = pair
    assert llama_cpp.llama_model_chat_template(llm.model, None) == CHAT_TEMPLATE.encode()
    stored = KIMI_TEMPLATE.encode()     # k3kit's built-in format for files without a template
    for messages in CONVERSATIONS:
        ours = render_kimi(messages, add_generation_prompt=add_generation_prompt)
        # llama.cpp recognises the template as its built-in kimi-k2 format and renders it natively.
        assert llama_chat(stored, messages, add_generation_prompt) == ours
        assert llama_tokenize(llm, ours) == encode(tok, ours)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_template_rendered_by_k3kit_matches_llama(pair, add_generation_prompt):
    """k3kit renders a file's own template (sandboxed Jinja) as llama.cpp renders it: Kimi-K2's, which
    llama.cpp's template API renders natively (Kimi-K3's own: tests/tokenizer/test_chat_k3_tools.py)."""
    _, path, _ = pair
    kv = dict(GGUFFile.open(path).kv)
    kv["tokenizer.chat_template"] = KV("tokenizer.chat_template", T.STRING, KIMI_TEMPLATE)
    codec = TextCodec(kv, str(path))
    assert codec.has_chat_template
    stored = KIMI_TEMPLATE.encode()
    for messages in CONVERSATIONS:
        assert codec.chat.render(messages, add_generation_prompt) == \
            llama_chat(stored, messages, add_generation_prompt)


def test_tokenizer_rebuilt_from_gguf_matches_llama(pair, heldout_lines):
    tok, path, llm = pair
    rebuilt = tokenizer_from_kv(GGUFFile.open(path).kv, str(path))
    for text in MIXED + heldout_lines[:100]:
        assert encode(rebuilt, text) == llama_tokenize(llm, text), repr(text)
        # add_bos comes from the GGUF's tokenizer.ggml.add_bos_token, as in llama.cpp
        assert rebuilt.encode(text).ids == llama_tokenize(llm, text, add_bos=True), repr(text)


def test_split_probe(tmp_path):
    """Catch any pre-token boundary that differs between llama.cpp and our regex.

    A small vocab rarely shows a split difference in the ids (both sides fall back to the same
    byte tokens). This probe's merges are learned WITHOUT any split, on the very strings we
    test, so nearly every adjacent pair can merge and the ids end exactly where pre-tokens end:
    a different boundary on either side gives different ids.
    """
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from k3kit.tokenizer.gguf_kv import build_bpe_tokenizer, tokenizer_kv

    texts = random_texts(400, seed=99) + MIXED
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    plain = [t.replace("[", "(").replace("<|", "<") for t in texts]  # never learn a special token's text
    raw.train_from_iterator(plain, trainers.BpeTrainer(
        vocab_size=6000, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(raw.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].__getitem__) + list(SPECIAL_TOKENS)
    merges = [tuple(m) for m in model["merges"]]
    assert len(merges) > 3000
    probe = build_bpe_tokenizer(tokens, merges, [1] * (len(tokens) - len(SPECIAL_TOKENS))
                                + [3] * len(SPECIAL_TOKENS), "kimi-k2")
    kv = [KV("general.architecture", T.STRING, "llama"), KV("llama.context_length", T.UINT32, 256),
          KV("llama.embedding_length", T.UINT32, 64), KV("llama.block_count", T.UINT32, 1),
          KV("llama.feed_forward_length", T.UINT32, 128), KV("llama.attention.head_count", T.UINT32, 4),
          KV("llama.attention.layer_norm_rms_epsilon", T.FLOAT32, 1e-5),
          *tokenizer_kv(probe, pre="kimi-k2", bos="[BOS]", eos="[EOS]")]
    path = write_gguf(tmp_path / "probe.gguf", kv, [])
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        multi = 0
        for text in texts:
            ours = encode(probe, text)
            assert llama_tokenize(llm, text) == ours, repr(text)
            multi += len(text) > 0 and len(ours) < len(text.encode())
        assert multi > len(texts) // 2  # the probe really merged across characters
    finally:
        llm.close()
