"""The mini K3's tokenizer: a small byte-level BPE with Kimi's special tokens and chat format.

It is trained with HF `tokenizers` on the corpus's train split and pre-tokenizes with the
split llama.cpp runs for `tokenizer.ggml.pre = "kimi-k2"` (the name real K3 GGUFs carry; the
regex that reproduces llama.cpp's code lives in `k3kit.tokenizer.gguf_kv`), so llama.cpp,
k3kit's runtime (which rebuilds the tokenizer from the GGUF) and this trainer agree token for
token.

Special tokens use Kimi-K2's texts and sit at the END of the vocab like real Kimi models
(K2: [BOS] 163584 ... [PAD] 163839; K3's drafter mask 163824). [MASK] is the drafter's
`mask_token_id`: DSpark/DFlash drafts fill the block after the anchor with it.

The chat format is Kimi-K2's (`<|im_user|>user<|im_middle|>...<|im_end|>`, k3kit.tokenizer.chat's
KIMI_TEMPLATE), without K2's default "You are Kimi" system message: that is exactly what
llama.cpp's built-in `kimi-k2` template renders, and llama.cpp picks that built-in for any
template containing `<|im_assistant|>assistant<|im_middle|>`. (Real K3 moved to an XML-like
format with `<|open|>`/`<|close|>`/`<|end_of_msg|>`; a model this small gains nothing from it.)
Encoding and the chat rendering live in k3kit.tokenizer; this module only trains and describes
the mini's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from k3kit.errors import K3Error
from k3kit.tokenizer.chat import IM_ASSISTANT, IM_END, IM_MIDDLE, IM_SYSTEM, IM_USER, KIMI_TEMPLATE
from k3kit.tokenizer.gguf_kv import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    build_bpe_tokenizer,
    hf_pre_tokenizer,
    set_added_specials,
    tokenizer_kv,
)

PRE = "kimi-k2"
DEFAULT_VOCAB_SIZE = 4096
# Longest token, in bytes. llama-cpp-python's Llama.detokenize renders each token into a
# 32-byte buffer and silently drops longer ones; long tokens (runs of '#' or spaces) buy a
# tiny model nothing anyway.
MAX_TOKEN_BYTES = 32

BOS = "[BOS]"
EOS = "[EOS]"
MASK = "[MASK]"
PAD = "[PAD]"
# In id order; they take the last len(SPECIAL_TOKENS) ids, [PAD] last as in Kimi-K2.
SPECIAL_TOKENS = (BOS, EOS, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, MASK, PAD)

# The template the mini writes into its GGUF and tokenizer_config.json: Kimi-K2's format.
CHAT_TEMPLATE = KIMI_TEMPLATE


def train_tokenizer(docs: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *,
                    min_frequency: int = 2) -> Tokenizer:
    """Train the byte-level BPE on `docs`; the result is a pure function of the docs.

    The BPE part gets `vocab_size - len(SPECIAL_TOKENS)` tokens (256 bytes + merges) and the
    special tokens follow. A corpus too small to yield that many merges is an error rather
    than a silently smaller vocab, because the model's embedding size is set from vocab_size.
    """
    n_bpe = vocab_size - len(SPECIAL_TOKENS)
    if n_bpe <= 256:
        raise K3Error(f"vocab_size {vocab_size} leaves no room for merges "
                      f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = hf_pre_tokenizer(PRE)
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=MAX_TOKEN_BYTES,  # in byte-level characters, i.e. bytes
    )
    raw.train_from_iterator(docs, trainer)
    model = json.loads(raw.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    if len(vocab) != n_bpe:
        raise K3Error(f"corpus too small: BPE training reached {len(vocab)} tokens, "
                      f"vocab_size {vocab_size} needs {n_bpe} before the special tokens")
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(n_bpe)):
        raise K3Error("BPE training returned ids with gaps")  # a tokenizers bug, not user input
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    merges = [(a, b) for a, b in pairs]
    types = [TOKEN_NORMAL] * n_bpe + [TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    return finish_tokenizer(build_bpe_tokenizer(tokens + list(SPECIAL_TOKENS), merges, types, PRE))


def finish_tokenizer(tok: Tokenizer, add_bos: bool = True) -> Tokenizer:
    """Make `tok.encode(text)` prepend [BOS] like llama.cpp's add_bos (add_special_tokens=False: none)."""
    bos = tok.token_to_id(BOS)
    if bos is None:
        raise K3Error(f"tokenizer has no {BOS} token")
    return set_added_specials(tok, bos if add_bos else None, None)


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the Kimi special tokens by role (bos, eos, im_end, ..., mask, pad)."""
    names = {"bos": BOS, "eos": EOS, "im_end": IM_END, "im_user": IM_USER, "im_assistant": IM_ASSISTANT,
             "im_system": IM_SYSTEM, "im_middle": IM_MIDDLE, "mask": MASK, "pad": PAD}
    out = {}
    for role, text in names.items():
        i = tok.token_to_id(text)
        if i is None:
            raise K3Error(f"tokenizer has no {text} token")
        out[role] = i
    return out


def tokenizer_manifest(tok: Tokenizer) -> dict:
    """What the model card states about the tokenizer. `sha256` covers the token strings and
    merges exactly as written to the GGUF (`tokenizer.ggml.tokens`, `.merges`), each list
    joined with newlines and the two lists separated by a blank line."""
    kv = {k.key: k.value for k in gguf_tokenizer_kv(tok)}
    tokens, merges = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.merges"]
    digest = hashlib.sha256(("\n".join(tokens) + "\n\n" + "\n".join(merges)).encode("utf-8")).hexdigest()
    return {
        "type": "byte-level BPE (HF tokenizers)",
        "pre": PRE,
        "vocab_size": len(tokens),
        "merges": len(merges),
        "max_token_bytes": MAX_TOKEN_BYTES,
        "special_tokens": {t: tokens.index(t) for t in SPECIAL_TOKENS},
        "sha256": digest,
    }


def gguf_tokenizer_kv(tok: Tokenizer):
    """The mini K3's `tokenizer.*` KVs: eos [EOS] (documents), eot <|im_end|> (turns), mask for drafts."""
    return tokenizer_kv(tok, pre=PRE, bos=BOS, eos=EOS, eot=IM_END, pad=PAD, mask=MASK,
                        add_bos=True, add_eos=False, chat_template=CHAT_TEMPLATE)
