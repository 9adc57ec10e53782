"""Constrained decoding: the tokens a sequence may take next, from a grammar, as a mask on its logits.

A grammar (a JSON schema, any JSON object, a Lark grammar, llama.cpp's GBNF) is compiled by
llguidance over the model's vocabulary (`Vocabulary`: an `llguidance.LLTokenizer` built from the
tokenizer's Hugging Face JSON, the logits' width and the ids that end a sequence) into a
`Grammar`; each sequence that follows it holds a `Constraint`, its own `LLMatcher`.

* `mask(rows, proposals)` sets the logits of the tokens the grammar forbids to -inf, on the
  logits' own device. Row k is masked with the matcher's state after `proposals[:k]`: a
  speculative verify block is masked row by row exactly as plain decoding would mask it when it
  picks that row's token (the matcher is advanced over the proposals the grammar allows, then
  rolled back). A proposal the grammar forbids is never accepted (its probability under the
  masked target is 0), so speculative decoding stays lossless under a grammar.
* The ids that end a sequence (end of text, end of turn) are allowed only where the grammar is
  complete (llguidance's `is_accepting`).
* `walk()` lets a drafter propose under the grammar: each proposal row masked with the state
  after the proposals before it (more of them survive verification; the masked draft
  distribution is the proposal distribution, so acceptance stays exact), rolled back after.
* `consume(tokens)` advances the matcher over the tokens picked; once the grammar can take
  nothing more (`is_stopped`: a JSON value closed, the last rule matched) the sequence ends right
  there, with the token that completed it: `ended_at` is how many tokens it had then.

The mask is applied after the logit bias and the history penalties and before temperature,
top-k, min-p and top-p (k3kit.runtime.sampling): truncation sees only allowed tokens, and the
greedy pick is the best allowed token. JSON schemas compile with bounded whitespace between
tokens (none, one space, or a newline and up to 20 spaces or tabs: llama.cpp's rule), so a model
cannot spend its tokens on endless blank space. llguidance is imported on first use (it comes
with the `serve` extra).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from k3kit.errors import K3Error
from k3kit.kernels import fused

# between two JSON tokens: nothing, a space, or a newline and an indent (llama.cpp's json grammar)
JSON_WHITESPACE = r"(?:\x20|\n[\x20\t]{0,20})?"
JSON_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(K3Error):
    """A grammar or schema llguidance cannot compile; the message is one line."""


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:     # pragma: no cover - llguidance comes with the serve and dev extras
        raise GrammarError("structured output needs llguidance: pip install 'k3kit[serve]'") from None
    return llguidance


def one_line(message: str) -> str:
    """llguidance's error text (a message, then often a source excerpt with a caret) as one line."""
    lines = [ln.strip() for ln in str(message).strip().splitlines() if ln.strip()]
    return lines[0] if lines else "invalid grammar"


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """An llguidance grammar for JSON values that follow `schema` (a JSON Schema object)."""
    llg = _llg()
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    try:
        return str(llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_pattern": JSON_WHITESPACE}))
    except (ValueError, TypeError) as e:
        raise GrammarError(one_line(str(e))) from None


def lark_grammar(text: str) -> str:
    """An llguidance grammar from Lark text (llguidance's dialect: `%json {...}`, `<|special|>`)."""
    return str(_llg().LLMatcher.grammar_from_lark(text))


def gbnf_grammar(text: str) -> str:
    """An llguidance grammar from llama.cpp's GBNF, converted to Lark by llguidance."""
    try:
        return str(_llg().grammar_from("gbnf", text))
    except ValueError as e:
        raise GrammarError(one_line(str(e)).removeprefix("Failed to convert the grammar from GBNF to Lark: ")
                           ) from None


class Vocabulary:
    """A model's vocabulary as llguidance sees it: the tokenizer (Hugging Face `tokenizers` JSON),
    the logits' width (`n_vocab`) and the ids that end a sequence. Building it walks the whole
    vocabulary once (K3's 163,840 tokens: well under a second); grammars compiled against it share
    it."""

    def __init__(self, tokenizer_json: str, n_vocab: int, stop_ids: Iterable[int]) -> None:
        llg = _llg()
        self.stop_ids = tuple(sorted({int(t) for t in stop_ids}))
        if not self.stop_ids:
            raise GrammarError("a vocabulary for constrained decoding needs at least one end-of-sequence id")
        self.n_vocab = int(n_vocab)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=self.n_vocab, eos_token=list(self.stop_ids))
        self.words = (self.tokenizer.vocab_size + 31) // 32

    def special(self, text: str) -> bool:
        """Whether `text` is one special token of this vocabulary (a Lark grammar names it `<text>`)."""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        return len(ids) == 1 and self.tokenizer.is_special_token(ids[0])

    def compile(self, grammar: str) -> Grammar:
        """A checked Grammar (GrammarError with llguidance's message, as one line, if it does not
        compile against this vocabulary)."""
        llg = _llg()
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(one_line(matcher.get_error()))
        return Grammar(self, grammar, matcher)

    def json_schema(self, schema: dict[str, Any] | bool) -> Grammar:
        return self.compile(json_schema_grammar(schema))

    def json_object(self) -> Grammar:
        return self.json_schema(JSON_OBJECT)

    def lark(self, text: str) -> Grammar:
        return self.compile(lark_grammar(text))

    def gbnf(self, text: str) -> Grammar:
        return self.compile(gbnf_grammar(text))


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar over one Vocabulary; `constraint()` starts a sequence on it."""

    vocab: Vocabulary
    text: str                     # llguidance's grammar text
    _start: Any = field(repr=False)   # the compiled matcher in its initial state (copied per sequence)

    def constraint(self) -> Constraint:
        return Constraint(self.vocab, self._start.deep_copy())


@dataclass
class MaskTimes:
    """Seconds spent on constraint work (what it adds to a decode step)."""

    fill: float = 0.0             # llguidance computing bitmasks
    apply: float = 0.0            # the bitmask applied to the logits
    consume: float = 0.0          # the matcher advanced over the picked tokens
    masks: int = 0                # rows masked

    @property
    def total(self) -> float:
        return self.fill + self.apply + self.consume


_SHIFTS: dict[torch.device, Tensor] = {}


def _shifts(device: torch.device) -> Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return s


def apply_bitmask(rows: Tensor, bits: Tensor) -> Tensor:
    """Rows of logits [R, V] with -inf where `bits` [R, W] (int32, bit j of word i: token 32 i + j)
    has a 0, and past its last word: a masked copy, on the rows' device."""
    if (native := fused.apply_bitmask(rows, bits)) is not None:
        return native
    r, v = rows.shape
    bits = bits.to(rows.device, non_blocking=True)
    allowed = ((bits.unsqueeze(-1) >> _shifts(rows.device)) & 1).reshape(r, -1).bool()
    n = min(v, allowed.shape[1])
    out = torch.full_like(rows, float("-inf"))
    out[:, :n] = rows[:, :n].masked_fill(~allowed[:, :n], float("-inf"))
    return out


class Constraint:
    """One sequence's grammar state (its own LLMatcher); see the module docstring."""

    def __init__(self, vocab: Vocabulary, matcher: Any) -> None:
        self.vocab = vocab
        self.matcher = matcher
        self.consumed = 0                 # tokens consumed so far
        self.ended_at: int | None = None  # `consumed` when the grammar stopped
        self.times = MaskTimes()
        self._bits = torch.zeros((1, vocab.words), dtype=torch.int32)
        # the last draft walk's bitmasks: (consumed when it began, the tokens it stepped over,
        # row k = the mask after tokens[:k]); a verify of the same proposals reuses them
        self._walked: tuple[int, list[int], list[Tensor]] | None = None

    @property
    def stopped(self) -> bool:
        return self.ended_at is not None

    def _fill(self, bits: Tensor, k: int) -> None:
        m = self.matcher
        row = bits[k]
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if m.is_error():       # never reached through mask/consume; end the sequence rather than fail it
            row.zero_()
            for t in self.vocab.stop_ids:
                row[t >> 5] |= _bit(t)

    def bitmasks(self, proposals: Sequence[int] = ()) -> Tensor:
        """[len(proposals) + 1, W] int32 bitmasks: row k after proposals[:k] (rows after a proposal
        the grammar forbids repeat the row that forbids it: no token of theirs can be accepted).
        A view of a buffer the next call overwrites."""
        t0 = time.perf_counter()
        n = len(proposals)
        if self._bits.shape[0] < n + 1:
            self._bits = torch.zeros((n + 1, self.vocab.words), dtype=torch.int32)
        bits = self._bits[:n + 1]
        advanced = 0
        reused: list[Tensor] = []       # the walk's rows for the prefix these proposals share with it
        if self._walked is not None and self._walked[0] == self.consumed:
            _, walked, rows = self._walked
            shared = 0
            while shared < min(n, len(walked)) and int(proposals[shared]) == walked[shared]:
                shared += 1
            reused = rows[:shared + 1]
        for k in range(n + 1):
            if k < len(reused):
                bits[k] = reused[k]             # the walk filled this state's mask already
            else:
                self._fill(bits, k)
            if k == n:
                break
            t = int(proposals[k])
            if not _allowed(bits[k], t) or self.matcher.try_consume_tokens([t]) != 1:
                bits[k + 1:] = bits[k]
                break
            advanced += 1
        if advanced:
            self.matcher.rollback(advanced)
        self.times.fill += time.perf_counter() - t0
        return bits

    def mask(self, rows: Tensor, proposals: Sequence[int] = ()) -> Tensor:
        """Rows of logits [R, V] (R <= len(proposals) + 1) -> masked copies; row k with the state
        after proposals[:k]."""
        if rows.shape[0] > len(proposals) + 1:
            raise ValueError(f"{rows.shape[0]} rows need {rows.shape[0] - 1} proposals, got {len(proposals)}")
        bits = self.bitmasks(proposals[:rows.shape[0] - 1])
        t0 = time.perf_counter()
        out = apply_bitmask(rows, bits)
        self.times.apply += time.perf_counter() - t0
        self.times.masks += rows.shape[0]
        return out

    def walk(self) -> Walk:
        """A draft's walk from the current state (see Walk); close it before anything else uses
        the constraint."""
        return Walk(self)

    def consume(self, tokens: Iterable[int]) -> int:
        """Advance over picked tokens; -> how many of them the sequence keeps: all, or up to and
        including the one that completed the grammar (nothing after it is taken)."""
        t0 = time.perf_counter()
        kept = 0
        for t in tokens:
            if self.ended_at is not None:
                break
            if not self.matcher.consume_token(int(t)):
                self.times.consume += time.perf_counter() - t0
                error = one_line(self.matcher.get_error())
                raise ValueError(f"token {t} does not follow the grammar: {error}")
            kept += 1
            self.consumed += 1
            if self.matcher.is_stopped():
                self.ended_at = self.consumed
        self.times.consume += time.perf_counter() - t0
        return kept


class Walk:
    """A draft's walk through a constraint's grammar (k3kit.runtime.speculative.proposal): `mask`
    a proposal row with the state after the proposals chosen so far, `step` over the one chosen;
    `close` rolls the matcher back to where the walk began. A proposal the grammar forbids (none
    is, when every row was masked) ends the walk: later rows go unmasked."""

    def __init__(self, constraint: Constraint) -> None:
        self.c = constraint
        self.steps = 0
        self.open = not constraint.stopped
        self._bits = torch.zeros((1, constraint.vocab.words), dtype=torch.int32)
        self.tokens: list[int] = []       # stepped over
        self.rows: list[Tensor] = []      # row k: the mask after tokens[:k]
        constraint._walked = None

    def mask(self, row: Tensor) -> Tensor:
        """One row of draft logits [V] -> masked (a copy), or the row itself once the walk ended."""
        if not self.open:
            return row
        t0 = time.perf_counter()
        self._fill()
        t1 = time.perf_counter()
        out = apply_bitmask(row[None], self._bits)[0]
        self.c.times.fill += t1 - t0
        self.c.times.apply += time.perf_counter() - t1
        return out

    def greedy(self, row: Tensor) -> tuple[int, Tensor]:
        """The best token of a row of draft logits [V] the grammar allows, and the row as the pick
        saw it: masked only when its best token is forbidden (the argmax is the same either way)."""
        t = int(torch.argmax(row).item())
        if not self.open:
            return t, row
        t0 = time.perf_counter()
        self._fill()
        self.c.times.fill += time.perf_counter() - t0
        if _allowed(self._bits[0], t):
            return t, row
        t1 = time.perf_counter()
        out = apply_bitmask(row[None], self._bits)[0]
        self.c.times.apply += time.perf_counter() - t1
        return int(torch.argmax(out).item()), out

    def bits(self) -> Tensor:
        """The grammar's bitmask [W] int32 for the next row (a buffer the next call overwrites),
        filled as `mask` fills it and kept for the verify likewise."""
        t0 = time.perf_counter()
        self._fill()
        self.c.times.fill += time.perf_counter() - t0
        return self._bits[0]

    def _fill(self) -> None:
        self.c._fill(self._bits, 0)
        if len(self.rows) == self.steps:          # the first fill of this state: kept for the verify
            self.rows.append(self._bits[0].clone())

    def step(self, token: int) -> None:
        if self.open and _allowed(self._bits[0], token) and self.c.matcher.try_consume_tokens([token]) == 1:
            self.steps += 1
            self.tokens.append(int(token))
            self.open = not self.c.matcher.is_stopped()
        else:
            self.open = False

    def close(self) -> None:
        if self.steps:
            self.c.matcher.rollback(self.steps)
        if self.rows:
            self.c._walked = (self.c.consumed, self.tokens, self.rows)
        self.steps, self.open = 0, False


def _bit(t: int) -> int:
    """Bit `t & 31` of an int32 word, as the signed value torch stores."""
    b = 1 << (t & 31)
    return b - (1 << 32) if b >= 1 << 31 else b


def _allowed(row: Tensor, t: int) -> bool:
    if not 0 <= t < row.numel() * 32:
        return False
    return bool((int(row[t >> 5]) >> (t & 31)) & 1)
