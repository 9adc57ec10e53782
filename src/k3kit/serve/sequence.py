"""One sequence's output as its client sees it: limits, stops, text and logprobs.

A scheduler samples tokens; this class decides what they mean for the client, the same way
for every scheduler (phase 1's serial worker, phase 2's batches):

* `max_tokens` counts every generated token, an end-of-text / end-of-turn token included, and
  a token at or past the limit is never taken: exactly `k3kit generate`'s rule, so the greedy
  token ids of a request equal `k3kit generate --temperature 0`'s for the same prompt;
* the file's stop ids (eos, eot) end the sequence with reason "stop" and render as nothing; other
  control tokens render as nothing too, except the request's `shown` ones (a chat format's
  markers, which the chat route's output parser reads);
* stop STRINGS are found in the text: the text is cut before the first one, and text that could
  still grow into one is held back until it cannot (so no client ever sees part of a stop);
* text comes from the token bytes through an incremental UTF-8 decoder: a character split over
  two tokens is released once, whole;
* a request with a grammar (`GenerationRequest.grammar`) ends with reason "stop" right after the
  token that completed it (`grammar_end`: the sampler's count of tokens at that point; a
  speculative block is cut there already, so no token past it is taken);
* logprobs are the log-softmax of the model's raw logits row that chose the token (before
  temperature / top-k / top-p and before a grammar's mask), with the k best alternatives of that
  row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from k3kit.serve.scheduler import Event, FinishEvent, GenerationRequest, TokenEvent, TokenLogprob
from k3kit.tokenizer.codec import TextCodec


def token_logprob(row: Tensor, token: int, k: int) -> TokenLogprob:
    """The chosen token's log-probability in `row` (raw logits [V]) and the k best of the row."""
    lp = torch.log_softmax(row.reshape(-1).float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(int(token), float(lp[token]), top)


def _held_suffix(text: str, stops: Iterable[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class SequenceOutput:
    """Feed it each sampled token (and the logits row that chose it); it posts the client's events."""

    def __init__(self, request: GenerationRequest, codec: TextCodec, stop_ids: Iterable[int],
                 post: Callable[[Event], None], grammar_end: Callable[[], int | None] | None = None) -> None:
        self.request = request
        self.grammar_end = grammar_end
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.stops = tuple(s for s in request.stop if s)
        self.post = post
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0   # prompt tokens the prompt cache restored (reported in the FinishEvent)
        self._stream = codec.streamer(request.shown) if request.shown else codec.streamer()
        self._held = ""          # decoded text not yet released (it could start a stop string)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.tokens)

    @property
    def last(self) -> int:
        return self.tokens[-1]

    def push(self, token: int, row: Tensor | None = None) -> bool:
        """Accept one sampled token; True when the sequence has ended (then nothing more is taken)."""
        if self.done:
            return True
        if len(self.tokens) >= self.request.max_tokens:
            self._finish("length")
            return True
        token = int(token)
        self.tokens.append(token)
        lps = None
        if self.request.logprobs is not None and row is not None and token not in self.stop_ids:
            lps = (token_logprob(row, token, self.request.logprobs),)
        if token in self.stop_ids:
            self._finish("stop")
            return True
        text, hit = self._release(self._stream.push(token))
        self.post(TokenEvent(text, (token,), lps))
        end = self.grammar_end() if self.grammar_end is not None else None
        if hit:
            self._finish("stop", flushed=True)
        elif end is not None and len(self.tokens) >= end:
            self._finish("stop")
        elif len(self.tokens) >= self.request.max_tokens:
            self._finish("length")
        return self.done

    def cancel(self, reason: str = "cancelled", error: str | None = None) -> None:
        """End the sequence without flushing held text (the client is gone or the run failed)."""
        if not self.done:
            self.finish_reason = reason
            self.post(FinishEvent(reason, len(self.request.prompt_ids), len(self.tokens), error,
                                  self.cached_tokens))

    def _release(self, piece: str, final: bool = False) -> tuple[str, bool]:
        """The text that can go out now, and whether a stop string was found (text cut before it)."""
        self._held += piece
        if not self.stops:
            out, self._held = self._held, ""
            return out, False
        cut = min((i for i in (self._held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._held = self._held[:cut], ""
            return out, True
        keep = 0 if final else _held_suffix(self._held, self.stops)
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return out, False

    def _finish(self, reason: str, flushed: bool = False) -> None:
        if not flushed:
            text, hit = self._release(self._stream.flush(), final=True)
            if text:
                self.post(TokenEvent(text, ()))
            if hit:
                reason = "stop"
        self.finish_reason = reason
        self.post(FinishEvent(reason, len(self.request.prompt_ids), len(self.tokens),
                              cached_tokens=self.cached_tokens))
