"""The prefill ahead of a conversation's next turn (k3kit.serve.next_turn, BatchScheduler.prefill_ahead)
on the shipped mini K3, whose chat template renders a reply sent back as a message differently from
the tokens the model generated: after it, the next turn restores everything up to its new message
and gives the tokens a server without a cache gives; a request that arrives while the prefill
runs waits for it; the cache's hit counters stay the requests'."""

from __future__ import annotations

import threading
import time

from scheduling import serve_together

from k3kit.runtime.sampling import Sampling
from k3kit.serve.api import ChatRequest
from k3kit.serve.batch import BatchScheduler
from k3kit.serve.next_turn import next_turn_ids
from k3kit.serve.prompt_cache import PromptCache, default_interval
from k3kit.serve.scheduler import GenerationRequest
from k3kit.serve.tool_parsers import ChatOutput, output_parser
from k3kit.serve.tools import chat_inputs

SYSTEM = "You are a helpful assistant with tools for the weather and the docs. " * 8
ASKS = ["What is the weather in Paris?", "And in Rome, for three days?", "Thanks. Search the docs for json."]


class Turns:
    """One conversation through the chat route's reading, rendering and parsing, on a scheduler."""

    def __init__(self, codec):
        self.codec = codec
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM}]

    def request(self, ask: str) -> GenerationRequest:
        self.messages.append({"role": "user", "content": ask})
        self.body = ChatRequest.model_validate({"messages": self.messages})
        inputs = chat_inputs(self.body, self.codec.chat.source)
        self.text = self.codec.chat.render(inputs.messages, add_generation_prompt=True)
        self.parser = output_parser(inputs.format, self.text, call_offset=inputs.call_offset)
        return GenerationRequest(tuple(self.codec.encode(self.text)), 40, Sampling(),
                                 shown=self.codec.control_ids(self.parser.markers))

    def answer(self, tokens: list[int]) -> list[int]:
        """Take the reply (its tokens); -> the next turn's start, as the chat route computes it."""
        out = ChatOutput(self.parser)
        kept = [t for t in tokens if t not in self.codec.stop_ids()]
        stream = self.codec.streamer(self.codec.control_ids(self.parser.markers))
        out.feed("".join(stream.push(t) for t in kept) + stream.flush())
        out.finish()
        message = out.message()
        self.messages.append(message)
        return next_turn_ids(self.codec, self.body, message)


def _cache(session) -> PromptCache:
    m = session.model
    return PromptCache(256 << 20, default_interval(m.recurrent_bytes, m.positional_row_bytes))


def _wait(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


class _Recording(BatchScheduler):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.cached: dict[str, int] = {}

    def _retire(self, done):
        for seq in done:
            self.cached[seq.request.id] = seq.out.cached_tokens
        super()._retire(done)


def test_next_turn_restores_up_to_its_new_message_and_changes_no_token(spec_session):
    s = spec_session
    cold = BatchScheduler(s.model, s.codec, max_batch=64, max_queue=8)
    warm = _Recording(s.model, s.codec, max_batch=64, max_queue=8, prompt_cache=_cache(s))
    try:
        a, b = Turns(s.codec), Turns(s.codec)
        ahead: list[int] = []
        for t, ask in enumerate(ASKS):
            ra, rb = a.request(ask), b.request(ask)
            assert ra.prompt_ids == rb.prompt_ids
            got = serve_together(warm, [ra])[0]
            assert got == serve_together(cold, [rb])[0], f"turn {t + 1}: the cache changed the tokens"
            if t:
                assert warm.cached[ra.id] == len(ahead), "the next turn did not restore the prefill ahead"
            ahead = a.answer(got)
            b.answer(got)
            assert len(ahead) > len(ra.prompt_ids) and list(ahead[:len(ra.prompt_ids)]) == list(ra.prompt_ids)
            assert warm.prefill_ahead(ahead, ra)
            _wait(lambda t=t: warm.stats().ahead_prefills == t + 1)
            assert not warm.prefill_ahead(ahead, ra)               # held now: nothing to run
        st = warm.stats()
        assert st.prompt_cache["hits"] == len(ASKS) - 1 and st.prompt_cache["misses"] == 1
        assert sum(st.requests.values()) == len(ASKS)               # a prefill ahead is no request
        assert st.ahead_tokens > 0
    finally:
        cold.close()
        warm.close()


class _Gated(BatchScheduler):
    """Holds the first pass that runs a prefill ahead until the test opens the gate."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.started, self.gate = threading.Event(), threading.Event()
        self.cached: dict[str, int] = {}

    def _run(self, entries):
        if any(s.request.ahead for s, _ in entries) and not self.started.is_set():
            self.started.set()
            assert self.gate.wait(30)
        super()._run(entries)

    def _retire(self, done):
        for seq in done:
            self.cached[seq.request.id] = seq.out.cached_tokens
        super()._retire(done)


def test_a_request_that_extends_a_running_prefill_waits_for_it(spec_session):
    s = spec_session
    # chunks of 8 rows: the prefill ahead takes several passes, the request comes during the first
    sched = _Gated(s.model, s.codec, max_batch=64, max_queue=8, prefill_chunk=8, prompt_cache=_cache(s))
    try:
        conv = Turns(s.codec)
        first = conv.request(ASKS[0])
        ahead = conv.answer(serve_together(sched, [first])[0])
        nxt = conv.request(ASKS[1])
        assert sched.prefill_ahead(ahead, first)
        assert sched.started.wait(30)
        done: list[list[int]] = []
        th = threading.Thread(target=lambda: done.append(serve_together(sched, [nxt])[0]))
        th.start()
        _wait(lambda: sched.stats().queued == 1)
        sched.gate.set()
        th.join(60)
        assert len(ahead) - len(first.prompt_ids) > 8
        assert done and sched.cached[nxt.id] == len(ahead)
        assert sched.stats().ahead_prefills == 1
    finally:
        sched.gate.set()
        sched.close()
