"""The shipped drafter under a JSON schema: its greedy chain with the grammar's masks in native
calls proposes what the row-by-row chain does; DSpark under the grammar writes plain decoding's
tokens, its plain passes as committed decode steps."""

from __future__ import annotations

import pytest
import torch

from k3kit.adapters.session import open_session
from k3kit.mini.paths import shipped_draft, shipped_gguf
from k3kit.runtime.constraint import Vocabulary
from k3kit.runtime.engine import generate
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import make_sampling
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder
from k3kit.runtime.speculative.proposal import propose

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "tags": {"type": "array", "items": {"enum": ["new", "old", "hot"]}, "maxItems": 3}},
    "required": ["name", "id", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def session():
    with open_session(shipped_gguf(), LoadOptions(expert_cache_mib=1024), draft=shipped_draft()) as s:
        yield s


@pytest.fixture(scope="module")
def grammar(session):
    codec = session.codec
    return Vocabulary(codec.tokenizer.to_str(), codec.n_vocab, codec.stop_ids()).json_schema(SCHEMA)


def _prompt(session) -> list[int]:
    return session.codec.encode('A record as JSON: {"name": "lamp", "id": 42, "tags": ["hot"]}\n')


def _generate(session, grammar, draft: bool, decoders: list | None = None):
    stop = session.codec.stop_ids()

    def spec(model, sampler):
        dec = SpeculativeDecoder(model, session.draft_model, sampler.sampling, sampler.generator,
                                 schedule=ScheduleConfig(draft_cost=None), stop_ids=stop,
                                 constraint=sampler.constraint)
        if decoders is not None:
            decoders.append(dec)
        return dec
    session.model.reset()
    return generate(session.model, _prompt(session), max_tokens=80, sampling=make_sampling(0.0),
                    stop_ids=stop, step=spec if draft else None, constraint=grammar.constraint())


def test_dspark_under_a_schema_is_plain_decoding_and_its_plain_passes_commit_at_once(session, grammar):
    plain = _generate(session, grammar, False)
    model = session.model
    taps, verifies = [], []
    forward_taps, verify = model.forward_taps, model.verify
    model.forward_taps = lambda ids: taps.append(len(ids)) or forward_taps(ids)
    model.verify = lambda ids, **kw: verifies.append(len(ids)) or verify(ids, **kw)
    decoders: list[SpeculativeDecoder] = []
    try:
        spec = _generate(session, grammar, True, decoders)
    finally:
        del model.forward_taps, model.verify
    assert spec.token_ids == plain.token_ids
    stats = decoders[0].stats
    assert stats.plain_passes >= 1 and taps == [1] * stats.plain_passes     # the judge's timed plain passes
    assert all(n > 1 for n in verifies[1:])          # after the prompt, every verify held proposals


def test_the_native_masked_chain_proposes_what_the_row_by_row_chain_does(session, grammar):
    drafter = session.draft_model
    _generate(session, grammar, True)
    c = grammar.constraint()
    text = session.codec.encode('{"name": "lamp", "id": ', add_bos=False)
    c.consume(text)
    before = c.bitmasks().clone()
    greedy = make_sampling(0.0)
    position = drafter.context_span[1]
    native_rows = 0
    for anchor in (text[-1], 17, 1000):
        calls: list[int] = []
        masked = drafter.markov_masked

        def counted(*a, calls=calls, masked=masked):
            calls.append(1)
            return masked(*a)
        drafter.markov_masked = counted
        try:
            with torch.no_grad():
                fast = propose(drafter, anchor, position, greedy, None, c)
        finally:
            del drafter.markov_masked
        native_rows += len(calls)
        walked = c._walked
        drafter.markov_masked = lambda *a: None            # the row-by-row chain, torch's ops
        try:
            with torch.no_grad():
                rows = propose(drafter, anchor, position, greedy, None, c)
        finally:
            del drafter.markov_masked
        assert fast.tokens == rows.tokens
        assert fast.confidence is not None and rows.confidence is not None
        torch.testing.assert_close(fast.confidence, rows.confidence, rtol=1e-6, atol=1e-6)
        assert torch.equal(c.bitmasks(), before) and c.consumed == len(text)     # the matcher as it was
        # the walk kept a mask per state it filled, for the verify of these proposals
        assert walked is not None and walked[0] == c.consumed and walked[1] == fast.tokens[:len(walked[1])]
        assert len(walked[2]) == len(calls)
        check = grammar.constraint()
        check.consume(text)
        for t in fast.tokens:
            if check.stopped:
                break
            bits = check.bitmasks()[0]
            assert (int(bits[t >> 5]) >> (t & 31)) & 1, t
            check.consume([t])
    assert native_rows >= 3
