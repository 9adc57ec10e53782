"""One request admitted to the batching scheduler (_Seq): its stream, output, sampler, sequence
handle and prompt progress, plus what speculation has learnt about it.

Admission creates it, pass building reads its next rows, the speculative widths read and update
its drafting record, and retirement frees its state: a module of its own so that each of those
(k3kit.serve.batch_admission, batch_passes, batch_widths, batch) imports it from one place.
"""

from __future__ import annotations

from typing import Any

from k3kit.runtime.sampling import Sampler
from k3kit.serve.scheduler import Event, FinishEvent, GenerationRequest, RequestStream
from k3kit.serve.sequence import SequenceOutput
from k3kit.tokenizer.codec import TextCodec


class Unheard:
    """The stream of a request nobody reads (a prefill ahead): its events go nowhere."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.id = request.id

    def post(self, event: Event) -> None:
        pass


class _Seq:
    """One admitted request: its stream, output, sampler, model handle and prompt progress."""

    def __init__(self, stream: RequestStream | Unheard, codec: TextCodec, stop_ids: frozenset[int]) -> None:
        self.stream = stream
        self.request = stream.request
        self.cancelled = False
        self.handle: int | None = None
        self.dec: Any = None                      # its SpeculativeDecoder (with --draft)
        self.survival: list[float] | None = None  # its drafts' prefix survival so far (running mean)
        self.undrafted = 0                        # passes since it last drafted
        self.block_survival: list[float] | None = None   # what the last block was expected to keep
        self.prompt = list(self.request.prompt_ids)
        self.fed = 0                              # prompt rows already run
        self.sampler: Sampler = self.request.sampler()
        self.finish: list[Event] = []             # the FinishEvent, held until the state is freed
        self.out = SequenceOutput(self.request, codec, stop_ids, self._post, self._grammar_end)
        self.interval: int | None = None          # prompt-cache point spacing (None: not cached)
        self.points: list[Any] = []               # prompt_cache.Point copies taken while prefilling
        self.base: str | None = None              # the cache entry it was restored from

    def _grammar_end(self) -> int | None:
        return self.sampler.ended_at

    def _post(self, ev: Event) -> None:
        if isinstance(ev, FinishEvent):
            self.finish.append(ev)
        else:
            self.stream.post(ev)

    @property
    def opened(self) -> int:
        """Its sequence handle (it holds one from admission to retirement)."""
        if self.handle is None:
            raise ValueError(f"request {self.request.id} holds no sequence state")
        return self.handle

    @property
    def decoding(self) -> bool:
        return self.fed >= len(self.prompt)

    def next_rows(self, chunk: int) -> list[int]:
        """The rows of its next pass: the last token, or the next prompt chunk. While at least two
        intervals of the prompt are left, a chunk ends on the prompt cache's next point; a shorter
        tail (a conversation's new turn after a hit) runs whole: a cut there would cost a pass
        (about a decode step) on every turn to save at most two intervals of recompute for a
        later request that leaves the conversation inside it."""
        if self.decoding:
            return [self.out.last]
        end = self.fed + chunk
        if self.interval is not None and len(self.prompt) - self.fed >= 2 * self.interval:
            end = min(end, (self.fed // self.interval + 1) * self.interval)
        return self.prompt[self.fed:end]
