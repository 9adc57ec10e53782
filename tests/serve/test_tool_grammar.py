"""The grammar of a required tool call in Kimi-K3's format (k3kit.serve.grammar), at the matcher:
the mini K3's tokenizer with K3's markers added as special tokens (as real K3 files have them),
and as it is (markers as text, the way the mini runs K3's template). Hand-written answers are
taken or refused where they break the syntax, the tool set or an argument's schema; answers
written from random logits under the grammar always parse (k3kit.serve.tool_parsers) into calls
whose arguments validate against the tools' schemas."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from tokenizers import AddedToken, Tokenizer  # noqa: E402

from k3kit.gguf.shards import Model  # noqa: E402
from k3kit.runtime.sampling import Sampler, make_sampling  # noqa: E402
from k3kit.serve.api import OutputSpec  # noqa: E402
from k3kit.serve.grammar import request_grammar  # noqa: E402
from k3kit.serve.tool_parsers import ChatOutput, output_parser  # noqa: E402
from k3kit.serve.tools import ChatInputs  # noqa: E402
from k3kit.tokenizer.codec import TextCodec  # noqa: E402

MINI = Path(__file__).resolve().parents[2] / "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"
MARKERS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["c", "f"]}, "hourly": {"type": "boolean"}},
    "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {}}}]
BOUNDED = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": WEATHER["properties"]["days"], "hourly": {"type": "boolean"},
                                     "where": {"type": "object", "properties": {"lat": {"enum": [1, 2]}},
                                               "required": ["lat"], "additionalProperties": False}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "stop", "parameters": {"type": "object", "properties": {},
                                                                    "additionalProperties": False}}}]
ASSISTANT = '<|open|>message role="assistant"<|sep|>'
THINK = ASSISTANT + "<|open|>think<|sep|>"
RESPONSE = ASSISTANT + "<|open|>response<|sep|>"


class Codec:
    """What the grammar needs of a codec: a tokenizer, the vocabulary size, the end ids."""

    def __init__(self, tokenizer: Tokenizer, stop: set[int]) -> None:
        self.tokenizer, self.n_vocab, self._stop = tokenizer, tokenizer.get_vocab_size(), stop

    def stop_ids(self) -> set[int]:
        return self._stop

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module", params=["special", "text"])
def codec(request) -> Codec:
    model = Model.open(MINI)
    try:
        mini = TextCodec(model.kv)
    finally:
        model.close()
    tok = Tokenizer.from_str(mini.tokenizer.to_str())
    if request.param == "special":
        tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return Codec(tok, mini.stop_ids())


def grammar(codec: Codec, prompt: str, tools: list[dict[str, Any]] = TOOLS, parallel: bool | None = None,
            spec: OutputSpec | None = None, required: bool = True):
    choice = "required" if required else None
    inputs = ChatInputs(messages=[], tools=tools, format="kimi-k3", tool_choice=choice)
    return asyncio.run(request_grammar(codec, spec, chat=inputs, prompt=prompt, parallel_tool_calls=parallel))


def call(name: str, index: int, args: str) -> str:
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{args}<|close|>call<|sep|>'


def arg(key: str, kind: str, value: str) -> str:
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'


def block(*calls: str) -> str:
    return "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"


EMPTY = "<|open|>response<|sep|><|close|>response<|sep|>"
CLOSED = "<|close|>response<|sep|>"
PARIS = call("get_weather", 1, arg("city", "string", "Paris & <b>") + arg("days", "number", "3")
             + arg("unit", "string", "f"))


def taken(codec: Codec, g, text: str) -> bool:
    """Whether the grammar takes all of `text` and is complete after it."""
    c = g.constraint()
    for t in codec.encode(text):
        if c.stopped or not c.matcher.try_consume_tokens([t]):
            return False
        c.consumed += 1
        c.ended_at = c.consumed if c.matcher.is_stopped() else None
    return c.stopped


def test_answers_the_grammar_takes(codec):
    g = grammar(codec, THINK)
    answer = "I will look it up.<|close|>think<|sep|>" + EMPTY + block(
        PARIS, call("now", 2, arg("tz", "string", "UTC")))
    assert taken(codec, g, answer)
    parsed = ChatOutput(output_parser("kimi-k3", THINK, tools=TOOLS))
    parsed.feed(answer)
    parsed.finish()
    msg = parsed.message()
    assert msg["reasoning_content"] == "I will look it up." and msg["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        {"city": "Paris & <b>", "days": 3, "unit": "f"}, {"tz": "UTC"}]
    assert taken(codec, grammar(codec, RESPONSE), CLOSED + block(PARIS))
    assert taken(codec, grammar(codec, ASSISTANT), EMPTY + block(PARIS))             # no channel opened
    assert taken(codec, grammar(codec, ASSISTANT), block(PARIS))
    thought = "<|open|>think<|sep|>hm<|close|>think<|sep|>"
    assert taken(codec, grammar(codec, ASSISTANT), thought + block(PARIS))


@pytest.mark.parametrize("answer", [
    block(PARIS),                                                            # the response channel left open
    "Sure!" + CLOSED + block(PARIS),                                         # prose instead of a call
    CLOSED + block(call("get_time", 1, "")),                                 # a tool not declared
    CLOSED + block(call("get_weather", 1, arg("days", "number", "3"))),      # the required city missing
    CLOSED + block(call("get_weather", 1, arg("city", "string", "Oslo") + arg("days", "number", "30"))),
    CLOSED + block(call("get_weather", 1, arg("city", "string", "Oslo") + arg("days", "string", "3"))),
    CLOSED + block(call("get_weather", 1, arg("city", "string", "Oslo") + arg("days", "number", "3")
                        + arg("unit", "string", "k"))),
    CLOSED + block(call("get_weather", 2, arg("city", "string", "Oslo") + arg("days", "number", "3"))),
    CLOSED + block(PARIS, PARIS),                                            # the second call's index
    CLOSED + block(PARIS) + "and more",
    CLOSED,                                                                  # no call at all
])
def test_answers_the_grammar_refuses(codec, answer):
    g = grammar(codec, RESPONSE)
    assert taken(codec, g, CLOSED + block(PARIS))
    assert not taken(codec, g, answer)


def test_one_call_without_parallel_calls_and_a_named_function(codec):
    two = EMPTY + block(PARIS, call("now", 2, ""))
    assert taken(codec, grammar(codec, ASSISTANT), two)
    assert not taken(codec, grammar(codec, ASSISTANT, parallel=False), two)
    assert taken(codec, grammar(codec, ASSISTANT, parallel=False), EMPTY + block(PARIS))
    named = grammar(codec, ASSISTANT, tools=TOOLS[1:])
    assert taken(codec, named, EMPTY + block(call("now", 1, "")))
    assert not taken(codec, named, EMPTY + block(PARIS))


def test_json_answer_or_calls_unless_tool_choice_none(codec):
    g = grammar(codec, RESPONSE, spec=OutputSpec("json_schema", {"type": "object", "required": ["a"]}, "x"),
                required=False)
    assert taken(codec, g, '{"a": [1, 2]}<|close|>response<|sep|><|close|>message<|sep|>')
    assert not taken(codec, g, '{"b": 1}<|close|>response<|sep|>')
    assert taken(codec, g, CLOSED + block(PARIS))
    inputs = ChatInputs(messages=[], tools=TOOLS, format="kimi-k3", tool_choice="none")
    spec = OutputSpec("json_object", None, "x")
    none = asyncio.run(request_grammar(codec, spec, chat=inputs, prompt=RESPONSE))
    assert not taken(codec, none, CLOSED + block(PARIS)) and taken(codec, none, '{"b": 1}')


def test_answers_from_random_logits_parse_into_valid_calls(codec):
    """Tokens drawn from random logits under the grammar, with the response channel open: every
    answer ends within 400 tokens and parses into 1-8 calls of declared tools whose arguments
    validate against their schemas."""
    g = grammar(codec, RESPONSE, tools=BOUNDED)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    names = set()
    for seed in range(6):
        sampler = Sampler(make_sampling(1.0, seed=seed), [], g.constraint())
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while sampler.ended_at is None and len(out) < 400:
            out.append(sampler(torch.randn(codec.n_vocab, generator=gen) * 3))
        assert sampler.ended_at == len(out)
        parsed = ChatOutput(output_parser("kimi-k3", RESPONSE, tools=BOUNDED))
        parsed.feed(codec.decode(out))
        parsed.finish()
        calls = parsed.message()["tool_calls"]
        assert 1 <= len(calls) <= 8
        for c in calls:
            name = c["function"]["name"]
            names.add(name)
            jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[name])
    assert names == set(schemas)
