"""Structured output on the shipped mini K3 through the batching scheduler, in process: a hundred
sampled answers to JSON schemas (nested objects, arrays, enums, bounded numbers, required and
optional fields) all validate with `jsonschema`; a hundred answers to "any JSON object" all parse;
greedy answers under a schema are the same tokens with DSpark as without; seeded sampling under a
grammar repeats, with and without the draft.

The mini is an 8M-parameter model trained on Python code and on chats whose only JSON answers
have one shape: after a code prompt it does not write these documents, and under a grammar it
happily fills strings and digits for as long as it may. The schemas bound their strings
(maxLength) and numbers (ranges, multipleOf) so that every answer completes within `max_tokens`;
code prompts under "any JSON object" carry a logit bias towards `"` and `}` for the same reason (a
client's knob like any other: the grammar still decides which tokens are allowed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from k3kit.runtime.sampling import make_sampling  # noqa: E402
from k3kit.runtime.speculative.schedule import DraftGuard  # noqa: E402
from k3kit.serve.api import ChatRequest  # noqa: E402
from k3kit.serve.batch import BatchScheduler  # noqa: E402
from k3kit.serve.grammar import vocabulary  # noqa: E402
from k3kit.serve.scheduler import FinishEvent, GenerationRequest, TokenEvent  # noqa: E402
from k3kit.serve.serial import SerialScheduler  # noqa: E402
from k3kit.serve.tools import chat_inputs  # noqa: E402

NUMBER = {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.25}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": NUMBER, "y": NUMBER}, "required": ["x", "y"],
                  "additionalProperties": False},
        "color": {"enum": ["red", "green", "blue"]}},
     "required": ["point", "color"], "additionalProperties": False},
    {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": 1, "maxItems": 4},
        "ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["ids", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "kind": {"const": "user"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "score": NUMBER},
     "required": ["kind", "tags", "score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "op": {"enum": ["add", "del"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["op", "n"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
]
PROMPTS = ["config = ", "data = json.loads(", "return ", "kwargs = ", "self.options = ", "DEFAULTS = "]


def serve(sched: BatchScheduler | SerialScheduler,
          reqs: Sequence[GenerationRequest]) -> list[tuple[list[int], str, str]]:
    """Every request submitted at once (a BatchScheduler admits them at the same pass); -> (tokens,
    text, finish reason) each. Closes `sched`."""
    async def one(stream: Any) -> tuple[list[int], str, str]:
        tokens: list[int] = []
        text, reason = "", ""
        async for ev in stream:
            if isinstance(ev, TokenEvent):
                tokens += ev.tokens
                text += ev.text
            elif isinstance(ev, FinishEvent):
                reason = ev.reason
        return tokens, text, reason

    async def main() -> list[tuple[list[int], str, str]]:
        with sched._cv:
            streams = [sched.submit(r) for r in reqs]
        return list(await asyncio.gather(*[one(s) for s in streams]))
    try:
        return asyncio.run(main())
    finally:
        sched.close()


def ar(session: Any) -> BatchScheduler:
    return BatchScheduler(session.model, session.codec, max_batch=256, max_queue=128, max_sequences=100)


def spec(session: Any, factory: Any) -> BatchScheduler:
    return BatchScheduler(session.model, session.codec, max_batch=256, max_queue=128, max_sequences=100,
                          step_factory=factory, guard=DraftGuard(judge=False))


def request(codec: Any, prompt: str, grammar: Any, *, temperature: float = 0.0, seed: int = 1,
            max_tokens: int = 128, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(codec.encode(prompt)), max_tokens=max_tokens,
                             sampling=make_sampling(temperature, seed=seed, **sampling), grammar=grammar)


def test_a_hundred_schema_answers_validate(spec_session):
    codec = spec_session.codec
    vocab = vocabulary(codec)
    grammars = [vocab.json_schema(s) for s in SCHEMAS]
    reqs = [request(codec, PROMPTS[i % len(PROMPTS)], grammars[i % len(SCHEMAS)], temperature=0.9, seed=i)
            for i in range(100)]
    out = serve(ar(spec_session), reqs)
    for i, (tokens, text, reason) in enumerate(out):
        assert reason == "stop", f"answer {i} did not complete: {text!r}"
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
        assert not set(tokens) & codec.stop_ids()          # ended by the grammar, not by an end token
    assert len({text for _, text, _ in out}) >= 90
    # the same requests without the grammar: the mini writes Python, not these documents
    free = serve(ar(spec_session), [GenerationRequest(r.prompt_ids, 48, r.sampling) for r in reqs[:20]])
    valid = 0
    for i, (_, text, _) in enumerate(free):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
            valid += 1
        except ValueError:
            pass
    assert valid == 0


def chat_prompt(codec: Any, user: str) -> str:
    """The served prompt for one user message asking for a JSON object, thinking off, rendered as
    the server renders it (the file's Kimi-K3 template, `response_format` as its system message)."""
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": user}],
                                       "response_format": {"type": "json_object"},
                                       "chat_template_kwargs": {"thinking": False}})
    inputs = chat_inputs(body, codec.chat.source)
    return codec.chat.render(inputs.messages, add_generation_prompt=True, tools=inputs.tools,
                             **inputs.variables)


ASKS = ["Give the module and name of {m}.{n} as JSON.", "Describe {m}.{n} as a JSON object.",
        "Return {m}.{n} as JSON with any fields you like."]
NAMES = [("json", "loads"), ("os.path", "join"), ("re", "sub"), ("shutil", "copyfile"), ("csv", "reader"),
         ("textwrap", "dedent"), ("heapq", "heappush"), ("bisect", "insort"), ("glob", "glob"),
         ("random", "choice"), ("string", "capwords"), ("fnmatch", "fnmatch"), ("copy", "deepcopy"),
         ("base64", "b64encode"), ("zlib", "crc32"), ("math", "isclose"), ("difflib", "ndiff"),
         ("calendar", "isleap"), ("operator", "itemgetter"), ("socket", "create_connection")]


def test_a_hundred_json_object_answers_parse(spec_session):
    """`response_format: json_object` on chat prompts (sampled at temperature 0.7), a hundred
    answers: each ends by the grammar and parses to an object; raw code prompts under the same
    grammar, with a logit bias towards closing (the mini writes Python there), parse too."""
    codec = spec_session.codec
    grammar = vocabulary(codec).json_object()
    reqs = [request(codec, chat_prompt(codec, ASKS[i % len(ASKS)].format(m=m, n=n)), grammar,
                    temperature=0.7, seed=i)
            for i, (m, n) in enumerate(NAMES * 4)]
    closing = {i: 3.0 for i, b in enumerate(codec.token_bytes) if b in (b'"', b"}")}
    reqs += [request(codec, PROMPTS[i % len(PROMPTS)], grammar, temperature=1.0, seed=i, logit_bias=closing,
                     max_tokens=256) for i in range(20)]
    out = serve(ar(spec_session), reqs)
    for i, (_, text, reason) in enumerate(out):
        assert reason == "stop", f"answer {i} did not complete: {text!r}"
        assert isinstance(json.loads(text), dict), text
    assert len({text for _, text, _ in out}) >= 40


def test_dspark_greedy_under_a_schema_is_ar(spec_session, spec_factory):
    """Greedy answers under schemas: DSpark's tokens are AR's, with proposals verified, some
    accepted and some rejected (the drafter does not know the grammar)."""
    codec = spec_session.codec
    vocab = vocabulary(codec)
    grammars = [vocab.json_schema(s) for s in SCHEMAS]
    reqs = [request(codec, PROMPTS[i], grammars[i % len(SCHEMAS)]) for i in range(len(PROMPTS))]
    ref = serve(ar(spec_session), reqs)
    sp = spec(spec_session, spec_factory)
    got = serve(sp, reqs)
    st = sp.stats()
    assert [t for t, _, _ in got] == [t for t, _, _ in ref]
    assert all(reason == "stop" for _, _, reason in got)
    assert st.spec_proposed > st.spec_accepted > 0
    for i, (_, text, _) in enumerate(got):
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])


def test_serial_scheduler_follows_the_grammar(spec_session, spec_factory):
    """The one-at-a-time scheduler, plain and with its step factory's decoders: the batching
    scheduler's greedy tokens under schemas."""
    codec = spec_session.codec
    vocab = vocabulary(codec)
    reqs = [request(codec, PROMPTS[i], vocab.json_schema(SCHEMAS[i])) for i in range(3)]
    ref = [t for t, _, _ in serve(ar(spec_session), reqs)]
    for factory in (None, spec_factory):
        got = serve(SerialScheduler(spec_session.model, codec, step_factory=factory), reqs)
        assert [t for t, _, _ in got] == ref and all(reason == "stop" for _, _, reason in got)


def test_seeded_sampling_under_a_grammar_repeats(spec_session, spec_factory):
    codec = spec_session.codec
    vocab = vocabulary(codec)
    grammar = vocab.json_schema(SCHEMAS[2])
    gbnf = vocab.gbnf('root ::= "x = " [0-9] [0-9]? ("," [a-z] [a-z]? [a-z]?)?')
    reqs = [request(codec, p, g, temperature=0.8, seed=7 + i, top_k=40, presence_penalty=0.5)
            for i, p in enumerate(PROMPTS[:3]) for g in (grammar, gbnf)]
    for make in (lambda: ar(spec_session), lambda: spec(spec_session, spec_factory)):
        first, again = serve(make(), reqs), serve(make(), reqs)
        assert [t for t, _, _ in first] == [t for t, _, _ in again]
        for k, (_, text, reason) in enumerate(first):
            assert reason == "stop"
            if k % 2 == 0:
                jsonschema.validate(json.loads(text), SCHEMAS[2])
            else:
                assert text.startswith("x = ") and text[4].isdigit()
    other = serve(ar(spec_session), [request(codec, PROMPTS[0], grammar, temperature=0.8, seed=s)
                                     for s in range(100, 104)])
    assert len({text for _, text, _ in other}) > 1              # the seed matters
