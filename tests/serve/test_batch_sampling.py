"""The sampling parameters in the batching scheduler on the shipped mini K3 + its drafter: the
history penalties see each sequence's own prompt and tokens (whoever shares its passes), and with
the draft every greedy request's tokens are the AR server's, its blocks verified row by row with
the proposals before each row counted."""

from __future__ import annotations

from scheduling import ar_tokens, serve_and_close

from k3kit.runtime.sampling import make_sampling
from k3kit.runtime.speculative.schedule import DraftGuard
from k3kit.serve.batch import BatchScheduler
from k3kit.serve.scheduler import GenerationRequest

TEXTS = ("import os", "def add(a, b):", "class Foo:", "for i in range(10):")


def _req(codec, text: str, max_tokens: int = 20, temperature: float = 0.0, seed: int = 1,
         **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(codec.encode(text)), max_tokens=max_tokens,
                             sampling=make_sampling(temperature, 1.0, 0, seed, **kw))


def _spec(session, factory) -> BatchScheduler:
    """The draft server; the guard off: drafting pays or not by this machine's pass times, and these
    tests need drafts verified."""
    return BatchScheduler(session.model, session.codec, max_batch=64, max_queue=16, step_factory=factory,
                          guard=DraftGuard(judge=False))


def test_penalties_change_greedy_output_and_defaults_do_not(spec_session):
    codec = spec_session.codec
    plain, explicit, freq, pres = ar_tokens(spec_session, [
        _req(codec, TEXTS[0], 24), _req(codec, TEXTS[0], 24, min_p=0.0, presence_penalty=0.0,
                                        frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}),
        _req(codec, TEXTS[0], 24, frequency_penalty=1.0), _req(codec, TEXTS[0], 24, presence_penalty=2.0)])
    assert explicit == plain
    repeats = [len(t) - len(set(t)) for t in (plain, freq, pres)]
    assert repeats[1] < repeats[0] and repeats[2] < repeats[0], repeats
    # a large negative bias on the greedy first token removes it; min_p = 1 is greedy
    banned, greedy = ar_tokens(spec_session, [_req(codec, TEXTS[0], 4, logit_bias={plain[0]: -100.0}),
                                              _req(codec, TEXTS[0], 24, temperature=1.0, seed=9, min_p=1.0)])
    assert banned[0] != plain[0] and plain[0] not in banned
    assert greedy == plain


def test_batched_speculation_with_penalties_equals_ar(spec_session, spec_factory):
    """Penalized and plain requests served together, with and without the draft: the same tokens."""
    codec, model = spec_session.codec, spec_session.model
    kws = [dict(frequency_penalty=1.0), dict(presence_penalty=1.5), dict(repetition_penalty=1.4),
           dict(frequency_penalty=0.5, logit_bias={198: -2.0}, min_p=0.3)]
    reqs = [_req(codec, t, 16, **kw) for t, kw in zip(TEXTS, kws, strict=True)] + [_req(codec, TEXTS[0], 16)]
    ref = ar_tokens(spec_session, reqs)
    alone = [ar_tokens(spec_session, [r])[0] for r in reqs]
    assert alone == ref                                       # a sequence's penalties are its own
    got, st = serve_and_close(_spec(spec_session, spec_factory), reqs)
    assert got == ref
    assert st.spec_proposed > 0 and st.spec_accepted > 0
    got1, st1 = serve_and_close(_spec(spec_session, spec_factory), reqs[:1])
    assert got1 == ref[:1] and st1.spec_accepted > 0
    assert model.sequences == 0 and spec_session.draft_model.contexts == 0


def test_batched_speculation_penalized_sampling_repeats(spec_session, spec_factory):
    codec = spec_session.codec
    r = _req(codec, TEXTS[1], 12, temperature=1.0, seed=42, frequency_penalty=0.8, repetition_penalty=1.2)

    def run():
        return serve_and_close(_spec(spec_session, spec_factory), [r])
    (a,), st = run()
    (b,), _ = run()
    assert a == b and len(a) == 12 and st.spec_proposed > 0
