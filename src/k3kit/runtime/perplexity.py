"""Perplexity of a causal model over a text, and how far its next-token distribution is from a base's.

This is llama-perplexity's job (llama.cpp tools/perplexity/perplexity.cpp, `perplexity()` and
`kl_divergence()`), on any k3kit.runtime.protocols.CausalModel, so the cost of a quant type
(IQ1_S vs Q2_K vs Q4_K of one model) and k3kit's numerics against llama.cpp's are measured the
way llama.cpp users measure them.

Chunks, as llama-perplexity cuts them: the text's token ids (BOS first when the tokenizer adds
one: the caller encodes with add_bos=True, as llama.cpp's common_tokenize(..., true) does) are
cut into n_tokens // ctx chunks of ctx tokens (the tail that fills no chunk is not evaluated).
Each chunk runs from a fresh sequence (reset) with its first token replaced by BOS when the
tokenizer adds one, and is scored on its second half: rows first = ctx // 2 .. ctx - 2 predict
tokens first + 1 .. ctx - 1, so the model always has context. PPL = exp(mean NLL) over the scored
tokens, with llama.cpp's standard error. One difference: llama.cpp wants >= 2 * ctx tokens and
scores nothing when ctx = 2; here one chunk is enough and first is at most ctx - 2, so any
text of >= 2 tokens has a perplexity.

Logits (`save_logits`): every row of every evaluated chunk, float32 [n_chunks * ctx, V], row r =
the logits after the first r % ctx + 1 tokens of chunk r // ctx (for one chunk: after the first
r + 1 tokens of the text). Written as a .npy, streamed row block by row block, atomically.

Divergence from a base (KL(P_base || Q_model) = sum_i p_base,i (log p_base,i - log q_i) per row):
* a .npy of float logits [n_rows, V] (what `save_logits` writes, or any engine's logits of every
  position, e.g. llama-cpp-python's `scores` with logits_all): compared at EVERY row, exactly
  (float64 log-softmax of both sides); the base must have been made with the same text, ctx and
  chunks (the row count is checked, the tokens cannot be);
* llama.cpp's `--kl-divergence-base` file (llama-perplexity --save-all-logits FILE): "_logits_",
  uint32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk * n_ctx], then per chunk
  n_ctx - 1 - n_ctx/2 rows (the scored half) of nv = 2 * ((n_vocab + 1) / 2) + 4 uint16: the first
  four hold float32 scale and min_log_prob, then log p_i = scale * q_i + min_log_prob (q_i = 0 for
  logits more than 16 below the max). The file's tokens, ctx and chunk count are used, and KL is
  summed as llama.cpp sums it (terms with log p_base <= -16 left out), so the figures are those
  `llama-perplexity --kl-divergence` would print for this model's logits.
Reported: mean / median / max KL, top-1 agreement (argmax of both, first maximum on ties, as
llama.cpp), mean |q - p_base| at the base's top token, and the base's own perplexity on the
scored tokens the two share.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from k3kit._io import atomic_write
from k3kit.errors import K3Error
from k3kit.progress import ByteProgress, count_progress
from k3kit.runtime.protocols import CausalModel

DEFAULT_CTX = 512            # llama-perplexity's default -c
DEFAULT_BATCH = 256          # rows per forward call (bounds activation memory, like -b)
LLAMA_MAGIC = b"_logits_"
LLAMA_LOG_FLOOR = -16.0      # llama.cpp stores / sums base log-probs above this only
ROW_BLOCK = 32               # rows per float64 softmax block: 32 x 163840 x 8 B = 42 MB


@dataclass(frozen=True)
class Chunks:
    """How the token ids are cut and scored (see the module doc)."""

    ctx: int                  # tokens per chunk
    n_chunks: int
    first: int                # first scored row of a chunk (it predicts token first + 1)
    bos: int | None           # the first token of every chunk becomes this (None: left as is)

    @property
    def rows(self) -> int:
        return self.ctx * self.n_chunks

    @property
    def scored_per_chunk(self) -> int:
        return self.ctx - 1 - self.first


def plan_chunks(n_tokens: int, *, ctx: int | None = None, chunks: int | None = None,
                context_length: int | None = None, bos: int | None = None, where: str = "text") -> Chunks:
    """llama-perplexity's chunking of n_tokens ids; ctx defaults to 512 or the whole text if shorter."""
    if n_tokens < 2:
        raise K3Error(f"{where}: {n_tokens} token{'' if n_tokens == 1 else 's'}; perplexity needs at least 2")
    if ctx is None:
        ctx = min(DEFAULT_CTX, n_tokens, context_length or n_tokens)
    if ctx < 2:
        raise K3Error(f"--ctx {ctx}: must be >= 2")
    if context_length is not None and ctx > context_length:
        raise K3Error(f"--ctx {ctx}: the model holds at most {context_length} positions")
    if ctx > n_tokens:
        raise K3Error(f"{where}: {n_tokens} tokens, fewer than --ctx {ctx}")
    n_chunks = n_tokens // ctx
    if chunks is not None:
        if chunks < 1:
            raise K3Error(f"--chunks {chunks}: must be >= 1")
        n_chunks = min(chunks, n_chunks)
    return Chunks(ctx=ctx, n_chunks=n_chunks, first=min(ctx // 2, ctx - 2), bos=bos)


def chunk_ids(tokens: Sequence[int], plan: Chunks, k: int) -> list[int]:
    """Chunk k's ids as the model sees them (first token replaced by BOS when there is one)."""
    ids = [int(t) for t in tokens[k * plan.ctx:(k + 1) * plan.ctx]]
    if plan.bos is not None:
        ids[0] = plan.bos
    return ids


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------- bases


class NpyBase:
    """Float logits of every position, [n_rows, V], from a .npy (memory-mapped, read per chunk)."""

    kind = "npy"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            arr = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            if isinstance(e, FileNotFoundError | IsADirectoryError | PermissionError):
                raise
            raise K3Error(f"{self.path}: not a .npy of logits nor a llama.cpp logits file "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if not isinstance(arr, np.ndarray):
            raise K3Error(f"{self.path}: an .npz archive, expected one .npy array of logits")
        if arr.ndim != 2 or arr.dtype.kind != "f":
            raise K3Error(f"{self.path}: {arr.dtype} array of shape {tuple(arr.shape)}, "
                          "expected float logits [n_tokens, n_vocab]")
        self.logits = arr

    @property
    def n_vocab(self) -> int:
        return int(self.logits.shape[1])

    def check(self, plan: Chunks, vocab: int) -> None:
        rows, v = self.logits.shape
        if v != vocab:
            raise K3Error(f"{self.path}: logits over {v} tokens, the model's vocab has {vocab}")
        if rows != plan.rows:
            raise K3Error(f"{self.path}: {rows} rows, this run evaluates {plan.rows} positions "
                          f"({plan.n_chunks} chunk{'s' if plan.n_chunks != 1 else ''} of {plan.ctx}); "
                          "use the base's text, --ctx and --chunks")

    def rows(self, plan: Chunks, k: int) -> tuple[int, np.ndarray]:
        """(first row within the chunk, the base's float logits of the chunk's rows from there)."""
        block = np.asarray(self.logits[k * plan.ctx:(k + 1) * plan.ctx], dtype=np.float32)
        bad = ~np.isfinite(block).all(axis=1)
        if bad.any():
            raise K3Error(f"{self.path}: row {k * plan.ctx + int(np.flatnonzero(bad)[0])} is not finite")
        return 0, block


class LlamaBase:
    """llama.cpp's --kl-divergence-base file (see the module doc): quantized log-probs of the scored rows."""

    kind = "llama.cpp"
    HEADER = 20

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(self.HEADER)
        if len(head) < self.HEADER or head[:8] != LLAMA_MAGIC:
            raise K3Error(f"{self.path}: not a llama.cpp logits file (no '_logits_' header)")
        n_ctx = int(np.frombuffer(head, "<u4", 1, 8)[0])
        n_vocab, n_chunk = (int(x) for x in np.frombuffer(head, "<i4", 2, 12))
        if n_ctx < 3 or n_vocab < 1 or n_chunk < 1:
            raise K3Error(f"{self.path}: n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}: "
                          "no scored rows (llama.cpp needs n_ctx >= 3)")
        self.n_ctx, self.n_chunk, self._n_vocab = n_ctx, n_chunk, n_vocab
        self.first = n_ctx // 2
        self.per_chunk = n_ctx - 1 - self.first
        self.nv = 2 * ((n_vocab + 1) // 2) + 4
        tok_bytes = 4 * n_ctx * n_chunk
        want = self.HEADER + tok_bytes + 2 * n_chunk * self.per_chunk * self.nv
        if size != want:
            raise K3Error(f"{self.path}: {size} bytes, a llama.cpp logits file with n_ctx {n_ctx}, "
                          f"n_vocab {n_vocab}, n_chunk {n_chunk} has {want}")
        self.tokens = np.memmap(self.path, dtype="<i4", mode="r", offset=self.HEADER,
                                shape=(n_ctx * n_chunk,))
        self.logp = np.memmap(self.path, dtype="<u2", mode="r", offset=self.HEADER + tok_bytes,
                              shape=(n_chunk, self.per_chunk, self.nv))

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def check(self, plan: Chunks, vocab: int) -> None:
        if self._n_vocab != vocab:
            raise K3Error(f"{self.path}: log-probs over {self._n_vocab} tokens, "
                          f"the model's vocab has {vocab}")
        bad = np.flatnonzero((np.asarray(self.tokens) < 0) | (np.asarray(self.tokens) >= vocab))
        if bad.size:
            raise K3Error(f"{self.path}: token {int(self.tokens[bad[0]])} at position {int(bad[0])} "
                          f"is outside the vocab of {vocab}")

    def plan(self, *, ctx: int | None, chunks: int | None, bos: int | None) -> Chunks:
        """The file's chunking (a --ctx that differs is an error; --chunks may take fewer)."""
        if ctx is not None and ctx != self.n_ctx:
            raise K3Error(f"--ctx {ctx}: {self.path} was computed with n_ctx {self.n_ctx}")
        if chunks is not None and chunks < 1:
            raise K3Error(f"--chunks {chunks}: must be >= 1")
        n = self.n_chunk if chunks is None else min(chunks, self.n_chunk)
        return Chunks(ctx=self.n_ctx, n_chunks=n, first=self.first, bos=bos)

    def rows(self, plan: Chunks, k: int) -> tuple[int, np.ndarray]:
        """(first row within the chunk, uint16 rows [scored, nv]) of chunk k."""
        return self.first, np.asarray(self.logp[k])

    def log_probs(self, raw: np.ndarray) -> np.ndarray:
        """float32 log-probs [n, V] as llama.cpp reads them: scale * q + min_log_prob."""
        head = np.ascontiguousarray(raw[:, :4]).view("<f4")          # [n, 2]: scale, min_log_prob
        q = raw[:, 4:4 + self._n_vocab].astype(np.float32)
        return head[:, :1] * q + head[:, 1:2]


def open_base(path: str | os.PathLike[str]) -> NpyBase | LlamaBase:
    """A base of either format, told apart by llama.cpp's magic."""
    p = Path(path)
    with open(p, "rb") as f:
        magic = f.read(8)
    return LlamaBase(p) if magic == LLAMA_MAGIC else NpyBase(p)


# ---------------------------------------------------------------- accumulators


@dataclass
class Divergence:
    """Per compared row: KL(base || model), top-1 agreement, |q - p_base| at the base's top token."""

    kl: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)
    dp_top: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)     # global row index of each

    def add(self, row0: int, base_logp: np.ndarray, model_logits: np.ndarray, *, floor: float | None) -> None:
        lq = log_softmax64(model_logits)
        lp = np.asarray(base_logp, dtype=np.float64)
        p = np.exp(lp)
        terms = p * (lp - lq)
        if floor is not None:
            terms = np.where(lp > floor, terms, 0.0)
        top_b = lp.argmax(axis=1)
        n = np.arange(len(lp))
        self.kl.append(terms.sum(axis=1))
        self.same_top.append(top_b == lq.argmax(axis=1))
        self.dp_top.append(np.abs(np.exp(lq[n, top_b]) - p[n, top_b]))
        self.rows.append(row0 + n)

    def arrays(self) -> dict[str, np.ndarray]:
        def cat(xs: list[np.ndarray], dt: Any) -> np.ndarray:
            return np.concatenate(xs) if xs else np.zeros(0, dt)
        return {"kl": cat(self.kl, np.float64), "same_top": cat(self.same_top, bool),
                "dp_top": cat(self.dp_top, np.float64), "rows": cat(self.rows, np.int64)}


@dataclass
class _NLL:
    total: float = 0.0
    total2: float = 0.0
    count: int = 0

    def add(self, nll: np.ndarray) -> None:
        self.total += float(nll.sum())
        self.total2 += float((nll * nll).sum())
        self.count += int(nll.size)

    def ppl(self) -> tuple[float, float]:
        """(exp(mean NLL), its standard error as llama.cpp prints it: ppl * sqrt(var / (n - 1)))."""
        if not self.count:
            return math.nan, math.nan
        mean = self.total / self.count
        var = self.total2 / self.count - mean * mean
        err = math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0
        return math.exp(mean), math.exp(mean) * err


# ---------------------------------------------------------------- result


@dataclass
class PerplexityResult:
    tokens: int                       # the text's token ids (BOS included)
    ctx: int
    chunks: int
    rows: int                         # positions evaluated (chunks * ctx)
    scored: int                       # tokens whose NLL makes the perplexity
    perplexity: float
    perplexity_err: float
    nll_mean: float
    seconds: float
    tok_s: float
    logits_file: str | None = None
    base: str | None = None
    base_format: str | None = None
    compared: int = 0                 # rows compared with the base
    kl_mean: float | None = None
    kl_median: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    mean_abs_dp_top: float | None = None
    base_perplexity: float | None = None
    divergence: dict[str, np.ndarray] | None = field(default=None, repr=False)   # per row (not in to_dict)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "divergence"}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


# ---------------------------------------------------------------- the run


def _chunk_logits(model: CausalModel, ids: list[int], batch: int, where: str, row0: int) -> np.ndarray:
    model.reset()
    parts = [model.forward(ids[i:i + batch], all_logits=True) for i in range(0, len(ids), batch)]
    out = torch.cat(parts).float().cpu().numpy()
    if out.shape != (len(ids), model.vocab_size):
        raise K3Error(f"{where}: logits of shape {out.shape}, expected ({len(ids)}, {model.vocab_size})")
    bad = ~np.isfinite(out).all(axis=1)
    if bad.any():
        raise K3Error(f"{where}: non-finite logits at position {row0 + int(np.flatnonzero(bad)[0])}")
    return out


def _write_npy_header(f: BinaryIO, rows: int, vocab: int) -> None:
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, vocab)})


def evaluate(model: CausalModel, tokens: Sequence[int], plan: Chunks, *,
             base: NpyBase | LlamaBase | None = None, save_logits: str | os.PathLike[str] | None = None,
             batch: int = DEFAULT_BATCH, progress: bool = False, where: str = "model") -> PerplexityResult:
    """Run `plan`'s chunks of `tokens` through `model`: perplexity, optionally the logits saved and
    the divergence from `base`. `where` names the model in errors."""
    if batch < 1:
        raise K3Error(f"--batch {batch}: must be >= 1")
    vocab = model.vocab_size
    if len(tokens) < plan.rows:
        raise K3Error(f"{where}: {len(tokens)} tokens, the plan evaluates {plan.rows}")
    used = np.asarray(tokens[:plan.rows], dtype=np.int64)
    bad = np.flatnonzero((used < 0) | (used >= vocab))
    if bad.size:
        raise K3Error(f"{where}: token {int(used[bad[0]])} at position {int(bad[0])} is outside the vocab "
                      f"of {vocab}")
    if base is not None:
        base.check(plan, vocab)
    out = Path(save_logits) if save_logits is not None else None
    if out is not None:
        if out.is_dir():
            raise K3Error(f"{out}: is a directory")
        if not out.parent.is_dir():
            raise K3Error(f"{out}: directory {out.parent} does not exist")

    def run(f: BinaryIO | None) -> PerplexityResult:
        if f is not None:
            _write_npy_header(f, plan.rows, vocab)
        nll, nll_base, div = _NLL(), _NLL(), Divergence()
        t0 = time.perf_counter()
        with count_progress("perplexity", plan.rows, "tok", enabled=progress) as bar:
            for k in range(plan.n_chunks):
                _one_chunk(model, tokens, plan, k, batch, where, base, f, nll, nll_base, div, bar)
        dt = time.perf_counter() - t0
        ppl, err = nll.ppl()
        r = PerplexityResult(
            tokens=len(tokens), ctx=plan.ctx, chunks=plan.n_chunks, rows=plan.rows, scored=nll.count,
            perplexity=ppl, perplexity_err=err, nll_mean=nll.total / nll.count if nll.count else math.nan,
            seconds=round(dt, 3), tok_s=round(plan.rows / dt, 3) if dt > 0 else 0.0,
            logits_file=str(out) if out is not None else None)
        if base is not None:
            a = div.arrays()
            r.base, r.base_format, r.compared = str(base.path), base.kind, int(a["kl"].size)
            if a["kl"].size:
                r.kl_mean, r.kl_median = float(a["kl"].mean()), float(np.median(a["kl"]))
                r.kl_max = float(a["kl"].max())
                r.top1_agreement = float(a["same_top"].mean())
                r.mean_abs_dp_top = float(a["dp_top"].mean())
            r.base_perplexity = nll_base.ppl()[0]
            r.divergence = a
        return r

    if out is None:
        return run(None)
    holder: list[PerplexityResult] = []

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            holder.append(run(f))
    atomic_write(out, write)
    return holder[0]


def _one_chunk(model: CausalModel, tokens: Sequence[int], plan: Chunks, k: int, batch: int, where: str,
               base: NpyBase | LlamaBase | None, f: BinaryIO | None, nll: _NLL, nll_base: _NLL,
               div: Divergence, bar: ByteProgress) -> None:
    row0 = k * plan.ctx
    logits = _chunk_logits(model, chunk_ids(tokens, plan, k), batch, where, row0)
    if f is not None:
        f.write(np.ascontiguousarray(logits, dtype="<f4").tobytes())
    targets = np.asarray(tokens[row0 + plan.first + 1:row0 + plan.ctx], dtype=np.int64)
    scored = slice(plan.first, plan.ctx - 1)
    base_from, base_rows = base.rows(plan, k) if base is not None else (0, None)
    for s in range(0, plan.ctx, ROW_BLOCK):
        e = min(s + ROW_BLOCK, plan.ctx)
        lo, hi = max(s, scored.start), min(e, scored.stop)
        if lo < hi:
            t = targets[lo - plan.first:hi - plan.first]
            nll.add(-log_softmax64(logits[lo:hi])[np.arange(hi - lo), t])
        if base is None or base_rows is None:
            continue
        b_lo, b_hi = max(s, base_from), min(e, base_from + len(base_rows))
        if b_lo >= b_hi:
            continue
        raw = base_rows[b_lo - base_from:b_hi - base_from]
        if isinstance(base, LlamaBase):
            lp, floor = base.log_probs(raw).astype(np.float64), LLAMA_LOG_FLOOR
        else:
            lp, floor = log_softmax64(raw), None
        div.add(row0 + b_lo, lp, logits[b_lo:b_hi], floor=floor)
        lo, hi = max(b_lo, scored.start), min(b_hi, scored.stop)      # the base's NLL on the scored tokens
        if lo < hi:
            t = targets[lo - plan.first:hi - plan.first]
            nll_base.add(-lp[np.arange(lo - b_lo, hi - b_lo), t])
    bar.advance(plan.ctx)


__all__ = ["Chunks", "DEFAULT_CTX", "Divergence", "LlamaBase", "NpyBase", "PerplexityResult", "chunk_ids",
           "evaluate", "log_softmax64", "open_base", "plan_chunks"]
