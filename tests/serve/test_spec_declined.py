"""What the draft server does where drafting is declined (shipped mini K3 + its drafter): no draft
work at all in those passes, and everything a later draft needs kept, so that drafting can resume
at any pass with the AR output."""

from __future__ import annotations

from scheduling import ar_tokens, serve_and_close, serve_together

from k3kit.runtime.sampling import make_sampling
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder
from k3kit.runtime.speculative.schedule import DraftGuard
from k3kit.serve.batch import PLAIN_FROM, BatchScheduler
from k3kit.serve.scheduler import GenerationRequest

TEXTS = ["import os", "def add(a, b):", "class Foo:", "x = [", "for i in range(10):", "# a comment"]


class _Gate(DraftGuard):
    """Declines drafting for the first `closed` questions, then leaves it to the allocator."""

    def __init__(self, closed: int) -> None:
        super().__init__(judge=False)
        self.closed, self.questions = closed, 0

    def allow(self, n: int) -> bool:
        self.questions += 1
        return self.questions > self.closed


def _requests(codec, max_tokens=20):
    return [GenerationRequest(prompt_ids=tuple(codec.encode(t)), max_tokens=max_tokens,
                              sampling=make_sampling(0.0, seed=1)) for t in TEXTS]


def _spy(monkeypatch, draft):
    """Count every call into the draft network's forward paths and its context syncs."""
    calls = {"sync": 0, "context_kv": 0, "draft_blocks": 0, "draft_block": 0, "forward": 0}
    net = draft.draft
    for obj, name in [(draft, "sync"), (draft, "draft_blocks"), (draft, "draft_block"),
                      (net, "context_kv"), (net, "forward_batch")]:
        real = getattr(obj, name)

        def wrapped(*a, _real=real, _name=name, **k):
            calls["forward" if _name == "forward_batch" else _name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(obj, name, wrapped)
    return calls


def test_declined_passes_do_no_draft_work_and_output_is_ar(spec_session, monkeypatch, spec_factory):
    """Drafting declined in every pass: the drafter never runs (no sync, no context K/V, no draft
    forward), no draft context is held, each sequence's feature ring still follows its committed
    positions, and the greedy tokens are the AR tokens."""
    model, codec, draft = spec_session.model, spec_session.codec, spec_session.draft_model
    reqs = _requests(codec)
    ref = ar_tokens(spec_session, reqs)
    calls = _spy(monkeypatch, draft)
    rings: list[tuple[int, int]] = []
    sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=spec_factory,
                        guard=_Gate(closed=10**9))
    run = sp._run

    def checked(entries):
        run(entries)
        for s, _ in entries:
            if s.dec is not None:
                rings.append((s.dec.ring.length, s.dec.target.position))
    monkeypatch.setattr(sp, "_run", checked)
    got, st = serve_and_close(sp, reqs)
    assert got == ref
    assert calls == {"sync": 0, "context_kv": 0, "draft_blocks": 0, "draft_block": 0, "forward": 0}
    assert st.drafted_passes == 0 and st.decode_passes > 0 and st.spec_proposed == 0
    assert rings and all(a == b for a, b in rings)          # the ring holds every committed position
    assert draft.contexts == 0 and model.sequences == 0


def test_drafting_resumes_after_declined_passes_with_ar_output(spec_session, monkeypatch, spec_factory):
    """Drafting declined for the first passes (prompts and several tokens decoded without the
    drafter), then allowed: the draft context is built from the ring only then, the drafts are
    accepted (the ring's taps are the right ones), and the output is still AR's."""
    model, codec, draft = spec_session.model, spec_session.codec, spec_session.draft_model
    reqs = _requests(codec, max_tokens=24)
    ref = ar_tokens(spec_session, reqs)
    calls = _spy(monkeypatch, draft)
    gate = _Gate(closed=8)
    first_sync: list[int] = []
    sync = draft.sync

    def noted(ring):
        if not first_sync:
            first_sync.append(gate.questions)
        return sync(ring)
    monkeypatch.setattr(draft, "sync", noted)
    sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=spec_factory,
                        guard=gate)
    got, st = serve_and_close(sp, reqs)
    assert got == ref
    assert first_sync and first_sync[0] > gate.closed       # no draft work before drafting was allowed
    assert calls["forward"] > 0 and st.drafted_passes > 0
    assert st.spec_accepted > 0 and st.spec_committed > st.spec_passes
    assert draft.contexts == 0 and model.sequences == 0


def _auto_factory(session):
    """Decoders as `k3kit serve --draft` builds them (`--verify-budget auto`)."""
    def build(target, sampler):
        return SpeculativeDecoder(target, session.draft_model, sampler.sampling, sampler.generator,
                                  schedule=ScheduleConfig(draft_cost=None), stop_ids=session.codec.stop_ids())
    return build


class _Condemned(DraftGuard):
    """Drafting stands condemned from `n` active sequences up (a verdict, as realized passes give)."""

    def __init__(self, n: int) -> None:
        super().__init__(judge=False)
        self.n = n

    def verdict(self, n: int) -> bool | None:
        return False if n >= self.n else None


def test_greedy_requests_admitted_where_drafting_is_condemned_run_plain(spec_session, monkeypatch):
    """A greedy request admitted while drafting stands condemned at the number of sequences active
    once the waiting ones are in gets no SpeculativeDecoder (no tap capture, no ring: the AR server's
    work); a sampled one always keeps its own (its seed must not depend on timing); the greedy tokens
    are AR's. A server that has seen no pass yet starts the requests of a large round plain too (no
    pass has shown drafting to pay there), but for the first, whose decoder tells it the factory's
    verify budget."""
    model, codec = spec_session.model, spec_session.codec

    auto_factory = _auto_factory(spec_session)
    reqs = _requests(codec)
    sampled = GenerationRequest(prompt_ids=tuple(codec.encode("while True:")), max_tokens=12,
                                sampling=make_sampling(0.8, seed=3))
    ref = ar_tokens(spec_session, reqs)
    for condemned_from, warm, kept in ((3, True, {False}), (100, False, {True, False})):
        sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=auto_factory,
                            guard=_Condemned(condemned_from))
        seen: dict[bool, set[bool]] = {True: set(), False: set()}      # greedy? -> {has a decoder?}
        run = sp._run

        def noted(entries, run=run, seen=seen):
            for s, _ in entries:
                seen[s.request.sampling.greedy].add(s.dec is not None)
            run(entries)
        if warm:               # one alone first: a decoder, and the factory's verify budget known (auto)
            assert serve_together(sp, reqs[:1]) == ref[:1]
        monkeypatch.setattr(sp, "_run", noted)
        got, st = serve_and_close(sp, [*reqs, sampled])
        assert got[:len(reqs)] == ref and len(got[-1]) == 12
        assert seen[True] == kept and seen[False] == {True}
        assert st.plain_sequences == len(reqs) - (0 if warm else 1)
        assert len(reqs) + 1 >= PLAIN_FROM                  # admitted together: that many active
        assert model.sequences == 0 and spec_session.draft_model.contexts == 0


def test_a_request_admitted_with_few_others_keeps_its_draft_even_where_condemned(spec_session, monkeypatch):
    """Below PLAIN_FROM active sequences a greedy request keeps its decoder whatever the verdict (its
    bookkeeping is small there, and the guard's probes need drafting sequences to revisit it)."""
    model, codec = spec_session.model, spec_session.codec

    auto_factory = _auto_factory(spec_session)
    reqs = _requests(codec)[:PLAIN_FROM - 1]
    ref = ar_tokens(spec_session, reqs)
    sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=auto_factory,
                        guard=_Condemned(1))
    kept: set[bool] = set()
    run = sp._run

    def noted(entries):
        kept.update(s.dec is not None for s, _ in entries)
        run(entries)
    monkeypatch.setattr(sp, "_run", noted)
    got, st = serve_and_close(sp, reqs)
    assert got == ref and kept == {True} and st.plain_sequences == 0


def test_requests_coming_back_to_a_busy_server_are_admitted_under_its_recent_load(spec_session):
    """A busy server's clients come back one by one after their answers, so the first of them are
    admitted with few others active: within RECENT_S of a pass that held PLAIN_FROM sequences, a
    greedy request is admitted under that load (plain, where drafting stands condemned there), and
    once RECENT_S has gone by without such a pass, under what is active (its decoder kept)."""
    from k3kit.serve.batch import RECENT_S

    model, codec = spec_session.model, spec_session.codec

    auto_factory = _auto_factory(spec_session)
    reqs = _requests(codec)
    assert len(reqs) == PLAIN_FROM
    few = reqs[:2]
    ref = ar_tokens(spec_session, few)
    now = [0.0]
    sp = BatchScheduler(model, codec, max_batch=64, max_queue=16, step_factory=auto_factory,
                        guard=_Condemned(PLAIN_FROM), clock=lambda: now[0])
    try:
        serve_together(sp, reqs[:1])              # a decoder: the factory's verify budget known
        serve_together(sp, reqs)                  # PLAIN_FROM at once: all plain
        plain = sp.stats().plain_sequences
        assert plain == PLAIN_FROM
        assert serve_together(sp, few) == ref     # right after: admitted under the busy passes' load
        assert sp.stats().plain_sequences == plain + len(few)
        now[0] += RECENT_S * 1.01
        assert serve_together(sp, few) == ref     # the load has gone: decoders again
        assert sp.stats().plain_sequences == plain + len(few)
    finally:
        sp.close()
    assert model.sequences == 0 and spec_session.draft_model.contexts == 0
