"""Text in and out of a GGUF model: the tokenizer rebuilt from its KVs, bytes per token, stops.

Encoding goes through k3kit's rebuilt tokenizer (the same split llama.cpp runs for the
file's `tokenizer.ggml.pre`). Decoding is done per token in BYTES (byte-level BPE: each
token string maps back through GPT-2's byte alphabet), and text is produced by an
incremental UTF-8 decoder, so a character split across two tokens is printed once, whole,
when its last byte arrives. Control tokens (bos/eos/end-of-turn...) render as nothing, as
llama.cpp's detokenizer does without `special`.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from functools import lru_cache

from k3kit.errors import FormatError, K3Error
from k3kit.gguf.reader import KV
from k3kit.gguf.tokenizer_kv import special_ids_from_kv, tokenizer_from_kv

TOKEN_CONTROL = 3


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet for bytes, inverted (char -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TextCodec:
    """Tokenizer, per-token bytes and stop ids of one model file."""

    def __init__(self, kv: Mapping[str, KV], where: str = "gguf") -> None:
        self.where = where
        self.tokenizer = tokenizer_from_kv(kv, where)
        tokens = kv["tokenizer.ggml.tokens"].value
        types = kv.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types.value] if types is not None else [1] * len(tokens)
        dec = _byte_decoder()
        self.token_bytes: list[bytes] = []
        for tok, typ in zip(tokens, types, strict=True):
            if typ == TOKEN_CONTROL:
                self.token_bytes.append(b"")
            elif all(c in dec for c in tok):
                self.token_bytes.append(bytes(dec[c] for c in tok))
            else:     # user-defined tokens are stored as plain text
                self.token_bytes.append(tok.encode("utf-8"))
        self.special = special_ids_from_kv(kv, where)
        add_bos = kv.get("tokenizer.ggml.add_bos_token")
        self.add_bos = bool(add_bos.value) if add_bos is not None else False
        self.vocab_tokens: list[str] = list(tokens)
        self.has_chat_template = "tokenizer.chat_template" in kv

    @property
    def n_vocab(self) -> int:
        return len(self.token_bytes)

    def stop_ids(self) -> set[int]:
        """End of text and end of turn: generation stops at either."""
        return {self.special[r] for r in ("eos", "eot") if r in self.special}

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids as llama.cpp's tokenize(text, add_bos, special) gives them."""
        from k3kit.mini.tokenizer import encode
        return encode(self.tokenizer, text, add_bos=self.add_bos if add_bos is None else add_bos,
                      special=special)

    def chat_prompt(self, user: str) -> str:
        """One user turn in the Kimi chat format, ready for the assistant's reply."""
        from k3kit.mini.tokenizer import IM_ASSISTANT, IM_END, IM_USER, apply_chat_template
        missing = [t for t in (IM_USER, IM_ASSISTANT, IM_END) if t not in self.vocab_tokens]
        if missing:
            raise K3Error(f"{self.where}: --chat needs the Kimi chat tokens; the vocab has no {missing[0]}")
        return apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        n = len(self.token_bytes)
        for t in ids:
            if not 0 <= t < n:
                raise FormatError(f"{self.where}: token id {t} outside the vocab of {n}")
        return b"".join(self.token_bytes[t] for t in ids)

    def streamer(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """Feed token ids one at a time; get back the text that became complete."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token: int) -> str:
        piece = self._dec.decode(self.codec.decode_bytes([token]))
        self.text += piece
        return piece

    def flush(self) -> str:
        piece = self._dec.decode(b"", final=True)
        self.text += piece
        return piece
