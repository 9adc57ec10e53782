"""The serve package's model-neutral parts on a toy model: sequence output rules and the phase-1
scheduler (serial order, bounded queue, cancellation, failures, shutdown). No server, no GGUF."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from k3kit.runtime.sampling import make_sampling
from k3kit.serve.scheduler import FinishEvent, GenerationRequest, QueueFull, SchedulerClosed, TokenEvent
from k3kit.serve.sequence import SequenceOutput
from k3kit.serve.serial import SerialScheduler
from k3kit.tokenizer.codec import TextStream

EOS = 9
PIECES = [b"a", b"b", b"c", b"\xe2\x82", b"\xac", b" stop", b"st", b"op", b"!", b""]


class ToyCodec:
    token_bytes = PIECES
    n_vocab = len(PIECES)

    def decode_bytes(self, ids):
        return b"".join(PIECES[t] for t in ids)

    def streamer(self):
        return TextStream(self)

    def stop_ids(self):
        return {EOS}


class ToyModel:
    """Next token = script[position] (then EOS); `gate` holds every forward until set."""

    context_length = 64

    def __init__(self, script, fail_at: int | None = None, vocab: int = len(PIECES)):
        self.script, self.fail_at, self.vocab_size = list(script), fail_at, vocab
        self.position, self.resets, self.forwards = 0, 0, 0
        self.gate = threading.Event()
        self.gate.set()

    def reset(self):
        self.position = 0
        self.resets += 1

    def forward(self, ids, all_logits=False):
        assert self.gate.wait(10)
        self.forwards += 1
        self.position += len(ids)
        if self.fail_at is not None and self.position >= self.fail_at:
            raise RuntimeError("boom")
        nxt = self.script[self.position - 1] if self.position - 1 < len(self.script) else EOS
        row = torch.full((self.vocab_size,), -5.0)
        row[nxt] = 5.0
        return row[None]


def request(prompt=(0,), max_tokens=8, stop=(), logprobs=None, temperature=0.0, seed=1):
    return GenerationRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, stop=tuple(stop),
                             sampling=make_sampling(temperature, 1.0, 0, seed), logprobs=logprobs)


def feed(tokens, **kw):
    events = []
    seq = SequenceOutput(request(**kw), ToyCodec(), {EOS}, events.append)
    for t in tokens:
        if seq.push(t, torch.zeros(len(PIECES))):
            break
    if not seq.done:
        seq.cancel()
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    finish = [e for e in events if isinstance(e, FinishEvent)]
    assert len(finish) == 1 and isinstance(events[-1], FinishEvent)
    return text, finish[0], events


# ---- SequenceOutput -----------------------------------------------------------------------------

def test_stop_string_across_tokens_is_never_shown():
    text, fin, events = feed([0, 6, 7, 1], stop=["stop"])
    assert (text, fin.reason, fin.completion_tokens) == ("a", "stop", 3)
    assert all("st" not in e.text for e in events if isinstance(e, TokenEvent))


def test_held_text_is_released_when_it_is_not_a_stop():
    text, fin, events = feed([0, 6, 1], stop=["stop"], max_tokens=3)
    assert (text, fin.reason) == ("astb", "length")
    assert [e.text for e in events if isinstance(e, TokenEvent)] == ["a", "", "stb"]


def test_held_text_is_flushed_at_the_length_limit():
    text, fin, _ = feed([0, 6], stop=["stop"], max_tokens=2)
    assert (text, fin.reason) == ("ast", "length")


def test_utf8_character_split_over_tokens():
    text, fin, events = feed([3, 4], max_tokens=2)
    assert text == "\u20ac" and [e.text for e in events if isinstance(e, TokenEvent)] == ["", "\u20ac"]


def test_end_token_stops_counts_and_renders_nothing():
    text, fin, _ = feed([0, EOS, 1])
    assert (text, fin.reason, fin.completion_tokens) == ("a", "stop", 2)


def test_max_tokens_is_exact():
    text, fin, _ = feed([0, 1, 2, 0, 1], max_tokens=3)
    assert (text, fin.reason, fin.completion_tokens) == ("abc", "length", 3)


def test_logprobs_are_log_softmax_with_top_k():
    events = []
    seq = SequenceOutput(request(logprobs=2), ToyCodec(), {EOS}, events.append)
    row = torch.tensor([0.0, 1.0, 2.0] + [-9.0] * 7)
    seq.push(1, row)
    lp = events[0].logprobs[0]
    want = torch.log_softmax(row, -1)
    assert lp.token == 1 and lp.logprob == pytest.approx(float(want[1]))
    assert [t for t, _ in lp.top] == [2, 1]


# ---- SerialScheduler ----------------------------------------------------------------------------

async def collect(stream):
    text, finish = [], None
    async for ev in stream:
        if isinstance(ev, TokenEvent):
            text.append(ev.text)
        else:
            finish = ev
    return "".join(text), finish


async def wait_for(cond, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_requests_run_serially_and_state_is_freed():
    model = ToyModel([0, 1, 2, 0, 1, 2])

    async def main():
        sched = SerialScheduler(model, ToyCodec(), max_queue=4)
        try:
            a, b = sched.submit(request(max_tokens=3)), sched.submit(request(max_tokens=10))
            (ta, fa), (tb, fb) = await asyncio.gather(collect(a), collect(b))
            assert (ta, fa.reason, fa.completion_tokens) == ("abc", "length", 3)
            # the whole script, then the end token (counted, not shown)
            assert (tb, fb.reason, fb.completion_tokens) == ("abcabc", "stop", 7)
            st = sched.stats()
            assert (st.active, st.queued, st.requests) == (0, 0, {"length": 1, "stop": 1})
            assert st.generated_tokens == 10 and st.prompt_tokens == 2
        finally:
            sched.close()
        assert model.resets >= 4             # before and after each request

    asyncio.run(main())


def test_queue_full_cancel_and_close():
    model = ToyModel([0] * 40)

    async def main():
        sched = SerialScheduler(model, ToyCodec(), max_queue=2)
        model.gate.clear()                                  # the worker blocks inside its first pass
        running = sched.submit(request(max_tokens=30))
        await wait_for(lambda: sched.stats().active == 1)
        q1, q2 = sched.submit(request()), sched.submit(request())
        with pytest.raises(QueueFull):
            sched.submit(request())
        assert sched.stats().rejected == 1
        await q1.aclose()                                   # a queued request leaves at once
        assert (await collect(q1))[1].reason == "cancelled"
        assert sched.stats().queued == 1
        sched.cancel(running.id)                            # a running one stops at its next pass
        model.gate.set()
        text, fin = await collect(running)
        assert fin.reason == "cancelled" and fin.completion_tokens < 30
        assert (await collect(q2))[1].completion_tokens == 8
        await wait_for(lambda: sched.stats().active == 0)
        model.gate.clear()
        blocked = sched.submit(request(max_tokens=30))
        waiting = sched.submit(request())
        await wait_for(lambda: sched.stats().active == 1)
        closer = asyncio.get_running_loop().run_in_executor(None, sched.close)
        await asyncio.sleep(0.05)
        model.gate.set()
        await closer
        assert (await collect(waiting))[1].reason == "error"
        assert (await collect(blocked))[1].reason == "cancelled"
        with pytest.raises(SchedulerClosed):
            sched.submit(request())

    asyncio.run(main())


def test_a_failing_request_does_not_stop_the_worker():
    model = ToyModel([0] * 10, fail_at=3)

    async def main():
        sched = SerialScheduler(model, ToyCodec(), max_queue=2)
        try:
            _, fin = await collect(sched.submit(request(max_tokens=8)))
            assert fin.reason == "error" and "boom" in fin.error
            model.fail_at = None
            text, fin = await collect(sched.submit(request(max_tokens=2)))
            assert (text, fin.reason) == ("aa", "length")
        finally:
            sched.close()

    asyncio.run(main())


def test_a_multi_token_step_respects_max_tokens():
    """A speculative-style step returns several tokens per pass; the sequence takes only what fits."""
    model = ToyModel([8])
    built = []

    class TwoAtATime:
        def __init__(self, model, sampler):
            self.passes = 0
            built.append(self)

        def prefill(self, ids):
            return model.forward(ids)

        def __call__(self, anchor, remaining):
            self.passes += 1
            return [1, 2]

    async def main():
        sched = SerialScheduler(model, ToyCodec(), step_factory=TwoAtATime, max_queue=2)
        try:
            text, fin = await collect(sched.submit(request(max_tokens=4)))
            assert (text, fin.completion_tokens) == ("!bcb", 4)
            assert fin.reason == "length" and built[0].passes == 2
            # with logprobs the step is not used (plain AR passes give the rows)
            await collect(sched.submit(request(max_tokens=2, logprobs=0)))
            assert len(built) == 1
        finally:
            sched.close()

    asyncio.run(main())


def test_batched_posts_wake_each_loop_once_and_keep_each_streams_order():
    """A pass's events, posted from the worker inside `batched_posts`, reach the event loop in one
    callback when the block ends, each stream's in its order; a FinishEvent marks its stream at
    once; outside the block each post is its own callback."""
    from k3kit.serve.scheduler import RequestStream, batched_posts

    async def main() -> None:
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe

        def counted(cb, *args):
            if getattr(cb, "__name__", "") in ("_deliver", "put_nowait"):     # the streams' own
                calls.append(cb)
            return real(cb, *args)
        loop.call_soon_threadsafe = counted          # type: ignore[method-assign]
        req = GenerationRequest((1, 2), 4, make_sampling(0.0))
        a, b = RequestStream(req, lambda _: None), RequestStream(req, lambda _: None)

        def worker() -> None:
            with batched_posts():
                for i in range(3):
                    a.post(TokenEvent(f"a{i}", (i,)))
                    b.post(TokenEvent(f"b{i}", (i,)))
                b.post(FinishEvent("stop", 2, 3))
                assert b.finished and not a.finished and not calls   # held until the block ends
            a.post(TokenEvent("a3", (3,)))                            # outside: at once
        t = threading.Thread(target=worker)
        t.start()
        await asyncio.to_thread(t.join)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(calls) == 2                       # one for the pass, one for the last post
        got_a = [(await anext(a)).text for _ in range(4)]
        got_b = [await anext(b) for _ in range(4)]
        assert got_a == ["a0", "a1", "a2", "a3"]
        assert [e.text for e in got_b[:3]] == ["b0", "b1", "b2"] and isinstance(got_b[3], FinishEvent)

    asyncio.run(main())
