"""The byte-level BPE vocab of a synthetic kimi-k3 model: every text tokenizes, merges are
exercised, and llama.cpp's gpt2 tokenizer accepts it.

Its own module because the vocab is the one part of a synthetic model that is not random bytes:
tests tokenize with it (make_vocab) and compare against llama.cpp's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import TokenType

from k3kit.errors import K3Error

MIN_VOCAB = 512
MAX_VOCAB = 1 << 20


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, so byte-level BPE tokens are valid strings."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: np.ndarray  # int32
    merges: list[str]
    bos: int
    eos: int


def make_vocab(n_vocab: int) -> Vocab:
    """A byte-level BPE vocab of exactly n_vocab tokens that llama.cpp's gpt2 tokenizer accepts.

    ids 0-255: the 256 byte tokens (every text tokenizes); then two-character merges over
    lowercase letters and space (so merging is exercised); then unused fillers; the last R
    ids are control tokens with [BOS] and [EOS] first (R = 256, as K2/K3's 163584.. block).
    """
    if not MIN_VOCAB <= n_vocab <= MAX_VOCAB:
        raise K3Error(f"--vocab {n_vocab}: must be between {MIN_VOCAB} and {MAX_VOCAB}")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    n_reserved = 256 if n_vocab >= 4096 else 16
    alphabet = [b2u[ord(" ")]] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    room = n_vocab - 256 - n_reserved
    merges = [f"{a} {b}" for a in alphabet for b in alphabet][:room]
    tokens += [m.replace(" ", "") for m in merges]
    n_fill = n_vocab - n_reserved - len(tokens)
    tokens += [f"<|k3kit_unused_{i}|>" for i in range(n_fill)]
    first = len(tokens)
    tokens += ["[BOS]", "[EOS]"] + [f"<|reserved_token_{i}|>" for i in range(2, n_reserved)]
    types = np.full(n_vocab, int(TokenType.NORMAL), dtype=np.int32)
    types[256 + len(merges):first] = int(TokenType.UNUSED)
    types[first:] = int(TokenType.CONTROL)
    assert len(tokens) == n_vocab and len(set(tokens)) == n_vocab
    return Vocab(tokens, types, merges, bos=first, eos=first + 1)
