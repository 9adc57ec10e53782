"""The mini K3's tokenizer: a small byte-level BPE with Kimi's special tokens and chat format.

It is trained with HF `tokenizers` on the corpus's train split and pre-tokenizes with the
split llama.cpp runs for `tokenizer.ggml.pre = "kimi-k2"` (the name real K3 GGUFs carry; the
regex that reproduces llama.cpp's code lives in `k3kit.tokenizer.gguf_kv`), so llama.cpp,
k3kit's runtime (which rebuilds the tokenizer from the GGUF) and this trainer agree token for
token.

Special tokens sit at the END of the vocab like real Kimi models (K2: [BOS] 163584 ... [PAD]
163839; K3's drafter mask 163824). [MASK] is the drafter's `mask_token_id`: DSpark/DFlash drafts
fill the block after the anchor with it.

The chat format is Kimi-K3's: the "XTML" markers `<|open|>`, `<|close|>`, `<|sep|>` and
`<|end_of_msg|>` are control tokens (what llama.cpp's kimi-k3 chat handler preserves; tag names
such as `think` or `call` stay ordinary text), `<|kimi_image_placeholder|>` is the template's image
slot, and the template is llama.cpp's models/templates/Kimi-K3.jinja (shipped beside the mini as
assets/kimi-k3.jinja). A reply ends with `<|end_of_msg|>`, the file's end-of-turn token, while
[EOS] ends a document.
Encoding and the chat rendering live in k3kit.tokenizer; this module only trains and describes
the mini's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from k3kit.errors import K3Error
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
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
IMAGE = "<|kimi_image_placeholder|>"
# Kimi-K3's chat markers, in id order after [EOS].
CHAT_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG, IMAGE)
# In id order; they take the last len(SPECIAL_TOKENS) ids, [PAD] last as in Kimi-K2.
SPECIAL_TOKENS = (BOS, EOS, *CHAT_TOKENS, MASK, PAD)

# The template the mini writes into its GGUF and tokenizer_config.json: Kimi-K3's.
CHAT_TEMPLATE = (Path(__file__).parent / "assets" / "kimi-k3.jinja").read_text(encoding="utf-8")


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
    """Ids of the Kimi special tokens by role (bos, eos, open, ..., mask, pad)."""
    names = {"bos": BOS, "eos": EOS, "open": OPEN, "close": CLOSE, "sep": SEP, "end_of_msg": END_OF_MSG,
             "image": IMAGE, "mask": MASK, "pad": PAD}
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
    """The mini K3's `tokenizer.*` KVs: eos [EOS] (documents), eot <|end_of_msg|> (messages), mask
    for drafts."""
    return tokenizer_kv(tok, pre=PRE, bos=BOS, eos=EOS, eot=END_OF_MSG, pad=PAD, mask=MASK,
                        add_bos=True, add_eos=False, chat_template=CHAT_TEMPLATE)


def with_chat_tokens(tok: Tokenizer) -> Tokenizer:
    """`tok` with its five chat-marker ids (those after [EOS]) renamed to Kimi-K3's markers.

    A tokenizer trained when the mini spoke Kimi-K2's format holds `<|im_end|>` ... `<|im_middle|>`
    there; the merges and every other id stay, so a model trained with it keeps its weights and
    only learns what the renamed ids now mean. A tokenizer that already has the markers is returned
    as it is."""
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    eos = vocab.get(EOS)
    if eos is None:
        raise K3Error(f"tokenizer has no {EOS} token")
    if all(vocab.get(t) == eos + 1 + k for k, t in enumerate(CHAT_TOKENS)):
        return tok
    by_id = {i: t for t, i in vocab.items()}
    old = [by_id.get(eos + 1 + k) for k in range(len(CHAT_TOKENS))]
    if None in old or any(vocab.get(t) is not None for t in CHAT_TOKENS):
        raise K3Error("tokenizer: the ids after [EOS] are not five chat markers to rename")
    rename = dict(zip(old, CHAT_TOKENS, strict=True))
    data["model"]["vocab"] = {rename.get(t, t): i for t, i in vocab.items()}
    for added in data.get("added_tokens", []):
        added["content"] = rename.get(added["content"], added["content"])
    return finish_tokenizer(Tokenizer.from_str(json.dumps(data)))
