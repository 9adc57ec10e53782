"""The `tokenizer.*` KVs of a converted target, from `tokenizer.json` (+ `tokenizer_config.json`).

llama.cpp's converter recognises a tokenizer by hashing how it splits a probe text and
refuses any hash it does not know, so it cannot convert a new tokenizer at all. k3kit goes
by the pre-tokenizer itself instead: the tokenizer's pre-tokenizer must be exactly the one
k3kit writes for a `tokenizer.ggml.pre` name llama.cpp implements (today `kimi-k2`), since
llama.cpp will split text with its own code for that name, not with the tokenizer's regex.

Special tokens: `tokenizer_config.json` (bos_token / eos_token / pad_token, chat_template)
when present, else Kimi's texts ([BOS], [EOS], [PAD]); `eos_token_id` in config.json wins for
eos, as llama.cpp's K3 converter does. The turn terminator (K3's <|end_of_msg|>, else K2's
<|im_end|>) and the drafter's
[MASK] are written when the vocab has them. A vocab smaller than config's vocab_size is
padded with unused `[PAD{i}]` tokens, as llama.cpp does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import numpy as np
from gguf import GGUFValueType
from tokenizers import Tokenizer

from k3kit.errors import ConvertError
from k3kit.gguf.reader import KV
from k3kit.tokenizer.gguf_kv import PRE_TOKENIZERS, TOKEN_UNUSED, hf_pre_tokenizer, tokenizer_kv

from .checkpoint import read_json

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"
MAX_TOKENIZER_BYTES = 512 << 20

KIMI_BOS, KIMI_EOS, KIMI_PAD, KIMI_MASK = "[BOS]", "[EOS]", "[PAD]", "[MASK]"
KIMI_EOTS = ("<|end_of_msg|>", "<|im_end|>")   # Kimi-K3's message end, Kimi-K2's turn end


def _pre_name(tok_json: dict, where: Path) -> str:
    """The llama.cpp pre-tokenizer name whose split this tokenizer's pre-tokenizer is."""
    got = tok_json.get("pre_tokenizer")
    for name in PRE_TOKENIZERS:
        if json.loads(hf_pre_tokenizer(name).__getstate__()) == got:   # same JSON tokenizers writes
            return name
    raise ConvertError(f"{where}: pre-tokenizer is not one llama.cpp implements "
                       f"(k3kit matches {sorted(PRE_TOKENIZERS)} exactly)")


def _token_text(v: object, key: str, where: Path) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):
        v = v.get("content")
    if not isinstance(v, str):
        raise ConvertError(f"{where}: {key} is not a token string")
    return v


def tokenizer_kvs(model_dir: Path, vocab_size: int, eos_token_id: int | None) -> list[KV]:
    """The tokenizer KVs for the checkpoint in `model_dir`; ConvertError naming the file."""
    path = model_dir / TOKENIZER_NAME
    if not path.is_file():
        raise ConvertError(f"{path}: no such file (k3kit converts HF tokenizers; K3's tiktoken "
                           "vocab is not supported)")
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ConvertError(f"{path}: too large for a tokenizer")
    tok_json = read_json(path, "tokenizer")
    if not isinstance(tok_json, dict) or not isinstance(tok_json.get("model"), dict):
        raise ConvertError(f"{path}: not a tokenizers JSON file")
    if tok_json["model"].get("type") != "BPE":
        raise ConvertError(f"{path}: model type {tok_json['model'].get('type')!r}, expected a byte-level BPE")
    pre = _pre_name(tok_json, path)
    try:
        tok = Tokenizer.from_str(json.dumps(tok_json))
    except Exception as e:   # the Rust side raises plain Exceptions with multi-line text
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConvertError(f"{path}: cannot load ({msg})") from None

    cfg_path = model_dir / TOKENIZER_CONFIG_NAME
    tcfg = read_json(cfg_path, "tokenizer config") if cfg_path.is_file() else {}
    if not isinstance(tcfg, dict):
        raise ConvertError(f"{cfg_path}: not a JSON object")
    vocab = tok.get_vocab(with_added_tokens=True)

    def pick(key: str, default: str) -> str | None:
        text = _token_text(tcfg.get(key), key, cfg_path)
        if text is None:
            return default if default in vocab else None
        if text not in vocab:
            raise ConvertError(f"{cfg_path}: {key} {text!r} is not in {path.name}")
        return text

    bos, eos, pad = pick("bos_token", KIMI_BOS), pick("eos_token", KIMI_EOS), pick("pad_token", KIMI_PAD)
    if eos_token_id is not None:
        eos = tok.id_to_token(eos_token_id)
        if eos is None:
            raise ConvertError(f"{model_dir / 'config.json'}: eos_token_id {eos_token_id} is not in "
                               f"{path.name}")
    if bos is None or eos is None:
        raise ConvertError(f"{path}: no BOS/EOS token (set bos_token/eos_token in {TOKENIZER_CONFIG_NAME})")
    template = tcfg.get("chat_template")
    if template is None and (model_dir / CHAT_TEMPLATE_NAME).is_file():
        template = (model_dir / CHAT_TEMPLATE_NAME).read_text(encoding="utf-8", errors="replace")
    if template is not None and not isinstance(template, str):
        raise ConvertError(f"{cfg_path}: chat_template must be a string (named templates are not supported)")
    # add_bos/add_eos: what the tokenizer itself does when asked to add special tokens
    probe = tok.encode("a", add_special_tokens=True).ids
    add_bos = tcfg.get("add_bos_token", bool(probe) and probe[0] == vocab[bos])
    add_eos = tcfg.get("add_eos_token", bool(probe) and probe[-1] == vocab[eos])
    if not isinstance(add_bos, bool) or not isinstance(add_eos, bool):
        raise ConvertError(f"{cfg_path}: add_bos_token/add_eos_token must be true or false")

    try:
        kvs = tokenizer_kv(tok, pre=pre, bos=bos, eos=eos,
                           eot=next((t for t in KIMI_EOTS if t in vocab), None), pad=pad,
                           mask=KIMI_MASK if KIMI_MASK in vocab else None,
                           add_bos=add_bos, add_eos=add_eos, chat_template=template)
    except ValueError as e:
        raise ConvertError(f"{path}: {e}") from None
    return _pad_vocab(kvs, vocab_size, path)


def _pad_vocab(kvs: list[KV], vocab_size: int, where: Path) -> list[KV]:
    """Extend tokens/token_type to the model's vocab_size with unused [PAD{i}] entries."""
    by_key = {k.key: k for k in kvs}
    tokens = cast("list[str]", by_key["tokenizer.ggml.tokens"].value)   # tokenizer_kv wrote a list
    n = len(tokens)
    if n > vocab_size:
        raise ConvertError(f"{where}: {n} tokens but config.json vocab_size is {vocab_size}")
    if n == vocab_size:
        return kvs
    extra = [f"[PAD{i}]" for i in range(n, vocab_size)]
    clash = set(extra) & set(tokens)
    if clash:
        raise ConvertError(f"{where}: padding token {sorted(clash)[0]!r} is already in the vocab")
    types = cast("np.ndarray", by_key["tokenizer.ggml.token_type"].value)
    new = {
        "tokenizer.ggml.tokens": KV("tokenizer.ggml.tokens", GGUFValueType.ARRAY, list(tokens) + extra,
                                    GGUFValueType.STRING),
        "tokenizer.ggml.token_type": KV("tokenizer.ggml.token_type", GGUFValueType.ARRAY,
                                        np.concatenate([types, np.full(len(extra), TOKEN_UNUSED, np.int32)]),
                                        GGUFValueType.INT32),
    }
    return [new.get(k.key, k) for k in kvs]
