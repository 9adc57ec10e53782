"""A byte-level BPE tokenizer as GGUF `tokenizer.*` KVs, and back (HF `tokenizers` <-> GGUF).

This lives in k3kit.tokenizer, not k3kit.gguf, so that reading, inspecting or rewriting a GGUF
never imports `tokenizers`. k3kit's runtime tokenizes from the GGUF alone, and llama.cpp must
tokenize the same GGUF the same way. llama.cpp does not run the tokenizer's own pre-tokenizer:
it picks a splitter by the name in `tokenizer.ggml.pre` (src/llama-vocab.cpp) and runs its own
code for it (src/unicode.cpp). So for each pre name we support, `PRE_TOKENIZERS` holds a regex that
reproduces that code's split, written for HF `tokenizers` (Oniguruma), and the same regex is
used when training, when writing KVs and when rebuilding a tokenizer from KVs.

`kimi-k2` (what real Kimi-K2/K3 GGUFs carry) is llama.cpp's custom splitter, which is NOT the
regex in Kimi's tokenization_kimi.py: it does not split CamelCase (any run of non-Han letters is
one word), combining marks (\\p{M}) are not part of words, and a contraction ('s 't 're 've 'm
'll 'd, any case) sticks to the word before it.
Its parts, in priority order at each position:
  Han runs (llama.cpp's own range list, not \\p{Han}) | one optional non-letter/non-digit, not
  CR/LF, then non-Han letters, then an optional contraction | 1-3 digits (\\p{N}) |
  an optional space, then non-space non-letter non-digit chars, then CR/LF |
  whitespace up to the last CR/LF of the run | whitespace but the last char when more follows |
  whitespace.
Whitespace is llama.cpp's table (Unicode White_Space without U+180E), spelled out so it does
not depend on the regex engine's idea of `\\s`.

Token types follow llama.cpp: 1 normal, 3 control (special tokens: matched in text only when
parsing specials, rendered only when asked), 4 user-defined (always matched and rendered),
5 unused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType, Keys
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from k3kit.errors import FormatError
from k3kit.gguf.reader import KV

TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5

K = Keys.Tokenizer  # gguf-py's key names: "tokenizer.ggml.tokens", "tokenizer.chat_template", ...
# The special-token ids by role, in the order they are written.
SPECIAL_KEYS = {"bos": K.BOS_ID, "eos": K.EOS_ID, "eot": K.EOT_ID, "pad": K.PAD_ID, "mask": K.MASK_ID}

MAX_VOCAB = 1 << 22  # 4M tokens: far above any real vocab (K3: 163840), bounds hostile files
MAX_TOKEN_BYTES = 1 << 16

_WS = r"\t\n\x0B\x0C\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}"
_HAN = (r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}"
        r"\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}")
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

KIMI_K2_SPLIT = (
    rf"[{_HAN}]+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+{_CONTRACTION}?"
    r"|\p{N}{1,3}"
    rf"| ?[^{_WS}\p{{L}}\p{{N}}]+[\r\n]*"
    rf"|[{_WS}]*[\r\n]+"
    rf"|[{_WS}]+(?![^{_WS}])"
    rf"|[{_WS}]+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp pre-tokenizes for one `tokenizer.ggml.pre` name."""

    split: str  # Oniguruma regex; every match (and every gap) is one pre-token
    ignore_merges: bool  # llama.cpp takes a whole pre-token that is in the vocab without merging


PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "kimi-k2": PreTokenizerSpec(KIMI_K2_SPLIT, ignore_merges=False),
}


def pre_tokenizer_spec(pre: str, where: str = "tokenizer") -> PreTokenizerSpec:
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise FormatError(f"{where}: tokenizer.ggml.pre {pre!r} is not supported "
                          f"(k3kit knows {sorted(PRE_TOKENIZERS)})")
    return spec


def hf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer that splits exactly like llama.cpp does for `pre`."""
    spec = pre_tokenizer_spec(pre)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def build_bpe_tokenizer(tokens: list[str], merges: list[tuple[str, str]], token_types: list[int],
                        pre: str) -> Tokenizer:
    """A byte-level BPE `Tokenizer` with every token at its given id.

    All tokens, special ones included, go into the BPE vocab so that ids are exactly the list
    positions; control and user-defined tokens are then registered as added tokens, which makes
    HF split them out of text before pre-tokenizing, as llama.cpp does.
    """
    spec = pre_tokenizer_spec(pre)
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate token strings")
    bpe = models.BPE(vocab, merges, ignore_merges=spec.ignore_merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = hf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()

    def added(kind: int) -> list[AddedToken]:
        return [AddedToken(t, special=kind == TOKEN_CONTROL, normalized=False, lstrip=False, rstrip=False,
                           single_word=False)
                for t, tt in zip(tokens, token_types, strict=True) if tt == kind]

    tok.add_special_tokens(added(TOKEN_CONTROL))
    tok.add_tokens(added(TOKEN_USER_DEFINED))
    return tok


def set_added_specials(tok: Tokenizer, bos: int | None, eos: int | None) -> Tokenizer:
    """Make `tok.encode(text)` add BOS/EOS as llama.cpp's add_bos/add_eos do (none with
    add_special_tokens=False). Pass None for a token that is not added."""
    parts = []
    specials = []
    for i, where in ((bos, "start"), (eos, "end")):
        if i is None:
            continue
        text = tok.id_to_token(i)
        if text is None:
            raise ValueError(f"special token id {i} is not in the vocab")
        specials.append((text, i))
        parts.append((where, text))
    if not parts:
        tok.post_processor = None
        return tok
    words = [t for w, t in parts if w == "start"] + ["$A"] + [t for w, t in parts if w == "end"]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(words), special_tokens=specials)
    return tok


def _tokens_and_types(tok: Tokenizer) -> tuple[list[str], list[int]]:
    vocab = tok.get_vocab(with_added_tokens=True)
    n = len(vocab)
    tokens: list[str | None] = [None] * n
    for text, i in vocab.items():
        if not 0 <= i < n or tokens[i] is not None:
            raise ValueError(f"tokenizer ids are not 0..{n - 1} without gaps (id {i})")
        tokens[i] = text
    types = [TOKEN_NORMAL] * n
    for i, added in tok.get_added_tokens_decoder().items():
        types[i] = TOKEN_CONTROL if added.special else TOKEN_USER_DEFINED
    return tokens, types  # type: ignore[return-value]


def _merges(tok: Tokenizer) -> list[str]:
    model = json.loads(tok.to_str())["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers can be written as gpt2 GGUF vocab, got {model.get('type')}")
    out = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        out.append(f"{a} {b}")
    return out


def tokenizer_kv(tok: Tokenizer, *, pre: str, bos: str, eos: str, eot: str | None = None,
                 pad: str | None = None, mask: str | None = None, add_bos: bool = True,
                 add_eos: bool = False, chat_template: str | None = None) -> list[KV]:
    """The `tokenizer.*` KVs llama.cpp and k3kit load a gpt2-style BPE vocab from.

    Special tokens are named by their text (e.g. bos="[BOS]") and must be in the vocab.
    `pre` must be a name in PRE_TOKENIZERS, and `tok` must already split that way (it is
    the caller's tokenizer; we only check the name is one we can reproduce).
    """
    pre_tokenizer_spec(pre)
    tokens, types = _tokens_and_types(tok)
    ids = {t: i for i, t in enumerate(tokens)}

    def special(role: str, text: str) -> KV:
        key = SPECIAL_KEYS[role]
        if text not in ids:
            raise ValueError(f"{key.removeprefix('tokenizer.ggml.')}: token {text!r} is not in the vocab")
        return KV(key, GGUFValueType.UINT32, ids[text])

    out = [
        KV(K.MODEL, GGUFValueType.STRING, "gpt2"),
        KV(K.PRE, GGUFValueType.STRING, pre),
        KV(K.LIST, GGUFValueType.ARRAY, tokens, GGUFValueType.STRING),
        KV(K.TOKEN_TYPE, GGUFValueType.ARRAY, np.asarray(types, dtype=np.int32), GGUFValueType.INT32),
        KV(K.MERGES, GGUFValueType.ARRAY, _merges(tok), GGUFValueType.STRING),
        special("bos", bos),
        special("eos", eos),
    ]
    for role, text in (("eot", eot), ("pad", pad), ("mask", mask)):
        if text is not None:
            out.append(special(role, text))
    out += [
        KV(K.ADD_BOS, GGUFValueType.BOOL, bool(add_bos)),
        KV(K.ADD_EOS, GGUFValueType.BOOL, bool(add_eos)),
    ]
    if chat_template is not None:
        out.append(KV(K.CHAT_TEMPLATE, GGUFValueType.STRING, chat_template))
    return out


def kv_value(kv: Mapping[str, KV], key: str, vtype: GGUFValueType, where: str,
             item_type: GGUFValueType | None = None, required: bool = True) -> Any:
    """The value of `key` checked to be of `vtype` (arrays: of `item_type`); None when absent and
    not `required`. A FormatError naming `where` otherwise."""
    item = kv.get(key)
    if item is None:
        if required:
            raise FormatError(f"{where}: missing {key}")
        return None
    if item.vtype != vtype or (item_type is not None and item.item_type != item_type):
        want = vtype.name if item_type is None else f"{vtype.name} of {item_type.name}"
        got = item.vtype.name if item.item_type is None else f"{item.vtype.name} of {item.item_type.name}"
        raise FormatError(f"{where}: {key} is {got}, expected {want}")
    return item.value


def tokenizer_from_kv(kv: Mapping[str, KV], where: str = "gguf") -> Tokenizer:
    """Rebuild the HF tokenizer from a GGUF's KVs (e.g. `GGUFFile.kv`). `where` names the file."""
    model = kv_value(kv, K.MODEL, GGUFValueType.STRING, where)
    if model != "gpt2":
        raise FormatError(f"{where}: {K.MODEL} {model!r} is not supported (only 'gpt2')")
    pre = kv_value(kv, K.PRE, GGUFValueType.STRING, where)
    pre_tokenizer_spec(pre, where)
    tokens = kv_value(kv, K.LIST, GGUFValueType.ARRAY, where, GGUFValueType.STRING)
    if not 0 < len(tokens) <= MAX_VOCAB:
        raise FormatError(f"{where}: {K.LIST} has {len(tokens)} entries (1..{MAX_VOCAB})")
    if len(set(tokens)) != len(tokens):
        raise FormatError(f"{where}: {K.LIST} has duplicate entries")
    long = next((i for i, t in enumerate(tokens) if not t or len(t) > MAX_TOKEN_BYTES), None)
    if long is not None:
        raise FormatError(f"{where}: {K.LIST}[{long}] is empty or longer than {MAX_TOKEN_BYTES}")
    types = kv_value(kv, K.TOKEN_TYPE, GGUFValueType.ARRAY, where, GGUFValueType.INT32, required=False)
    if types is None:
        types = [TOKEN_NORMAL] * len(tokens)
    elif len(types) != len(tokens):
        raise FormatError(f"{where}: {K.TOKEN_TYPE} has {len(types)} entries for {len(tokens)} tokens")
    types = [int(t) for t in types]
    raw_merges = kv_value(kv, K.MERGES, GGUFValueType.ARRAY, where, GGUFValueType.STRING)
    if len(raw_merges) > len(tokens):
        raise FormatError(f"{where}: {K.MERGES} has {len(raw_merges)} entries for {len(tokens)} tokens")
    vocab = set(tokens)
    merges = []
    for i, m in enumerate(raw_merges):
        a, sep, b = m.partition(" ")
        if not sep or not a or not b or a not in vocab or b not in vocab or a + b not in vocab:
            raise FormatError(f"{where}: {K.MERGES}[{i}] {m!r} is not 'A B' with A, B and AB in the vocab")
        merges.append((a, b))
    tok = build_bpe_tokenizer(list(tokens), merges, types, pre)
    ids = special_ids_from_kv(kv, where)
    add_bos = kv_value(kv, K.ADD_BOS, GGUFValueType.BOOL, where, required=False)
    add_eos = kv_value(kv, K.ADD_EOS, GGUFValueType.BOOL, where, required=False)
    for role, flag, key in (("bos", add_bos, K.ADD_BOS), ("eos", add_eos, K.ADD_EOS)):
        if flag and role not in ids:
            raise FormatError(f"{where}: {key} is set but there is no {role} token id")
    return set_added_specials(tok, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None)


def special_ids_from_kv(kv: Mapping[str, KV], where: str = "gguf") -> dict[str, int]:
    """bos/eos/eot/pad/mask ids present in the KVs, checked against the vocab size."""
    n = len(kv_value(kv, K.LIST, GGUFValueType.ARRAY, where, GGUFValueType.STRING))
    out = {}
    for role, key in SPECIAL_KEYS.items():
        v = kv_value(kv, key, GGUFValueType.UINT32, where, required=False)
        if v is None:
            continue
        if not 0 <= int(v) < n:
            raise FormatError(f"{where}: {key} = {v} is outside the vocab (0..{n - 1})")
        out[role] = int(v)
    return out


def chat_template_from_kv(kv: Mapping[str, KV], where: str = "gguf") -> str | None:
    """The file's own `tokenizer.chat_template` (a Jinja source), or None when it has none."""
    return kv_value(kv, K.CHAT_TEMPLATE, GGUFValueType.STRING, where, required=False)
