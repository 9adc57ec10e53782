"""Token streams for training the mini K3: documents packed end to end, windows cut from them.

Every document becomes [BOS] ids [EOS] and the documents are concatenated in corpus order
(sequence packing: no padding, attention runs across document boundaries as in most LM
pre-training; the [BOS] tells the model a new file begins). Training windows start at
positions drawn from a generator seeded by (seed, step), so a resumed run sees exactly the
batches the uninterrupted run would have. Held-out windows are the stream cut into
consecutive, non-overlapping pieces, always the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from k3kit.errors import K3Error
from k3kit.mini.tokenizer import BOS, EOS


def pack(tok: Tokenizer, docs: Sequence[str]) -> Tensor:
    """[BOS] doc [EOS] for every document, concatenated: int64 [n_tokens]."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if bos is None or eos is None:
        raise K3Error(f"tokenizer has no {BOS}/{EOS} tokens")
    parts = []
    for enc in tok.encode_batch(list(docs), add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], dtype=np.int64))
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy(np.concatenate(parts))


def train_batch(stream: Tensor, batch: int, seq_len: int, seed: int, step: int) -> Tensor:
    """`batch` windows of seq_len + 1 tokens (inputs and next-token targets) at random offsets."""
    n = stream.numel() - seq_len - 1
    if n <= 0:
        raise K3Error(f"training stream of {stream.numel()} tokens is shorter than one window "
                      f"of {seq_len + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, n + 1, (batch,), generator=g)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


def heldout_windows(stream: Tensor, seq_len: int, max_windows: int | None = None) -> Tensor:
    """Consecutive non-overlapping windows of seq_len + 1 tokens: [n, seq_len + 1]."""
    n = stream.numel() // (seq_len + 1)
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise K3Error(f"held-out stream of {stream.numel()} tokens is shorter than one window "
                      f"of {seq_len + 1}")
    return stream[:n * (seq_len + 1)].view(n, seq_len + 1)


def unigram_perplexity(train: Tensor, heldout: Tensor, vocab_size: int) -> float:
    """Perplexity on `heldout` of the unigram model of `train` (add-one smoothed, so every id
    has a probability): the baseline a language model must beat to have learnt anything."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(torch.exp(-logp[heldout].mean()))
