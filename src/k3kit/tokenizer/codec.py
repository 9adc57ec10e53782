"""Text in and out of a GGUF model: the tokenizer rebuilt from its KVs, bytes per token, stops, chat.

Encoding goes through k3kit's rebuilt tokenizer (the same split llama.cpp runs for the
file's `tokenizer.ggml.pre`). Decoding is done per token in BYTES (byte-level BPE: each
token string maps back through GPT-2's byte alphabet), and text is produced by an
incremental UTF-8 decoder, so a character split across two tokens is printed once, whole,
when its last byte arrives. Control tokens (bos/eos/end-of-turn...) render as nothing, as
llama.cpp's detokenizer does without `special`. Chat prompts come from the file's own
`tokenizer.chat_template` (k3kit.tokenizer.chat).
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Mapping, Sequence
from functools import lru_cache

from gguf import GGUFValueType
from tokenizers import Tokenizer

from k3kit.errors import FormatError
from k3kit.gguf.reader import KV

from .chat import ChatTemplate
from .gguf_kv import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    K,
    chat_template_from_kv,
    kv_value,
    special_ids_from_kv,
    tokenizer_from_kv,
)


def encode(tok: Tokenizer, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
    """Token ids as llama.cpp's `tokenize(text, add_bos, special)` gives them.

    special=False treats special-token texts in `text` as plain text (llama.cpp's parse_special).
    `add_bos` adds what the tokenizer's post-processor adds (set_added_specials), as llama.cpp's
    add_bos/add_eos do. Not thread-safe: the flag is set on the shared `tok` for the call.
    """
    tok.encode_special_tokens = not special
    try:
        return tok.encode(text, add_special_tokens=add_bos).ids
    finally:
        tok.encode_special_tokens = False


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
    """Tokenizer, per-token bytes, stop ids and chat template of one model file."""

    def __init__(self, kv: Mapping[str, KV], where: str = "gguf") -> None:
        self.where = where
        self.tokenizer = tokenizer_from_kv(kv, where)
        tokens: list[str] = list(kv_value(kv, K.LIST, GGUFValueType.ARRAY, where, GGUFValueType.STRING))
        stored = kv_value(kv, K.TOKEN_TYPE, GGUFValueType.ARRAY, where, GGUFValueType.INT32, required=False)
        types = [int(t) for t in stored] if stored is not None else [TOKEN_NORMAL] * len(tokens)
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
        self.add_bos = bool(kv_value(kv, K.ADD_BOS, GGUFValueType.BOOL, where, required=False))
        self.vocab_tokens = tokens
        # Special tokens as a template sees them: their text, as transformers passes bos_token.
        named = {f"{r}_token": self._text(self.special[r], types[self.special[r]])
                 for r in ("bos", "eos") if r in self.special}
        self.chat = ChatTemplate(chat_template_from_kv(kv, where), where=where, vocab=self.vocab_tokens,
                                 **named)

    def _text(self, i: int, typ: int) -> str:
        """Token `i` as text: control tokens by their own text (they render as nothing in output)."""
        if typ == TOKEN_CONTROL:
            return self.vocab_tokens[i]
        return self.token_bytes[i].decode("utf-8", errors="replace")

    @property
    def n_vocab(self) -> int:
        return len(self.token_bytes)

    @property
    def has_chat_template(self) -> bool:
        """Whether the file carries its own `tokenizer.chat_template` (else the built-in Kimi format)."""
        return self.chat.source is not None

    def stop_ids(self) -> set[int]:
        """End of text and end of turn: generation stops at either."""
        return {self.special[r] for r in ("eos", "eot") if r in self.special}

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids as llama.cpp's tokenize(text, add_bos, special) gives them."""
        return encode(self.tokenizer, text, add_bos=self.add_bos if add_bos is None else add_bos,
                      special=special)

    def chat_prompt(self, user: str) -> str:
        """One user turn, rendered by the file's chat template, ready for the assistant's reply."""
        return self.chat.render([{"role": "user", "content": user}], add_generation_prompt=True)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        n = len(self.token_bytes)
        for t in ids:
            if not 0 <= t < n:
                raise FormatError(f"{self.where}: token id {t} outside the vocab of {n}")
        return b"".join(self.token_bytes[t] for t in ids)

    def streamer(self, shown: Collection[int] = ()) -> TextStream:
        """An incremental decoder; control tokens in `shown` decode as their own text."""
        return TextStream(self, shown)

    def control_ids(self, texts: Collection[str]) -> frozenset[int]:
        """The control tokens (which decode as nothing) whose text is one of `texts`."""
        want = set(texts)
        return frozenset(i for i, t in enumerate(self.vocab_tokens)
                         if t in want and not self.token_bytes[i])


class TextStream:
    """Feed token ids one at a time; get back the text that became complete."""

    def __init__(self, codec: TextCodec, shown: Collection[int] = ()) -> None:
        self.codec = codec
        self.shown = {int(t): codec.vocab_tokens[int(t)].encode("utf-8") for t in shown}
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token: int) -> str:
        raw = self.shown.get(token)
        piece = self._dec.decode(self.codec.decode_bytes([token]) if raw is None else raw)
        self.text += piece
        return piece

    def flush(self) -> str:
        piece = self._dec.decode(b"", final=True)
        self.text += piece
        return piece
