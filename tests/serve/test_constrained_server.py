"""Structured output through the HTTP API with the real `openai` client, in process: the app over
a batching scheduler on the shipped mini K3. Chat `response_format` json_schema and json_object,
streamed and not; /v1/completions with `response_format`, llama-server's `json_schema` and
`grammar` (GBNF) and k3kit's `lark_grammar`; schemas and grammars that do not compile are 400s
naming the field, and the server keeps serving; `tool_choice` "required" and a named function
under a Kimi-K3-format template give calls whose arguments validate against the tools' schemas."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from fastapi.testclient import TestClient  # noqa: E402

from k3kit.serve.app import ServerState, build_app  # noqa: E402
from k3kit.serve.batch import BatchScheduler  # noqa: E402
from k3kit.tokenizer.chat import ChatTemplate  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]},
    "address": {"type": "object",
                "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                "required": ["zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "address"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a user as JSON."}]
# Kimi-K3's message format, small: what the parser and the tool grammar key on
K3_TEMPLATE = (
    "{%- for m in messages -%}<|open|>message role=\"{{ m.role }}\"<|sep|>{{ m.content }}"
    "<|close|>message<|sep|><|end_of_msg|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|open|>message role=\"assistant\"<|sep|>"
    "{{- '<|open|>think<|sep|>' if thinking is not defined or thinking else '<|open|>response<|sep|>' -}}"
    "{%- endif -%}")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "hourly": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 100,
                                                    "multipleOf": 0.5},
                                         "to": {"type": "string", "enum": ["EUR", "USD"]}},
        "required": ["amount", "to"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def served(spec_session):
    codec = spec_session.codec
    k3 = copy.copy(codec)
    k3.chat = ChatTemplate(K3_TEMPLATE, where="test", vocab=codec.vocab_tokens)
    clients = {}
    scheds = []
    https = []
    try:
        for name, c in (("mini", codec), ("k3", k3)):
            sched = BatchScheduler(spec_session.model, c, loaded=spec_session.target, max_batch=64,
                                   max_queue=16)
            scheds.append(sched)
            state = ServerState(model_id="mini")
            state.ready(sched, c, 4096)
            http = TestClient(build_app(state))
            http.__enter__()
            https.append(http)
            clients[name] = (openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                                           max_retries=0), http)
        yield clients
    finally:
        for http in https:
            http.__exit__(None, None, None)
        for sched in scheds:
            sched.close()


def closing_bias(codec) -> dict[str, float]:
    return {str(i): 3.0 for i, b in enumerate(codec.token_bytes) if b in (b'"', b"}")}


def test_chat_json_schema_streamed_and_not(served):
    client, _ = served["mini"]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = []
    for seed in range(2):
        kw: dict[str, Any] = {"model": "mini", "messages": ASK, "response_format": rf, "max_tokens": 160,
                              "temperature": 0.7, "seed": seed}
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        texts.append(r.choices[0].message.content)
        chunks = client.chat.completions.create(**kw, stream=True)
        streamed, finish = "", None
        for ch in chunks:
            if ch.choices:
                streamed += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        assert streamed == texts[-1] and finish == "stop"
    assert len(set(texts)) > 1
    # llama-server's schema-constrained json_object
    r = client.chat.completions.create(model="mini", messages=ASK, max_tokens=160, temperature=0,
                                       response_format={"type": "json_object", "schema": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_chat_json_object(served, spec_session):
    client, _ = served["mini"]
    for seed in range(4):
        r = client.chat.completions.create(model="mini", messages=ASK, max_tokens=160, temperature=1.0,
                                           response_format={"type": "json_object"}, seed=seed,
                                           logit_bias=closing_bias(spec_session.codec))
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_with_schema_and_grammars(served):
    client, _ = served["mini"]
    r = client.completions.create(model="mini", prompt="user = ", max_tokens=160, temperature=0,
                                  extra_body={"json_schema": PERSON})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    r = client.completions.create(model="mini", prompt="user = ", max_tokens=160, temperature=0,
                                  extra_body={"response_format": rf})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model="mini", prompt="answer = ", max_tokens=16, temperature=0,
                                  extra_body={"grammar": 'root ::= ("yes" | "no") "." [0-9]'})
    assert r.choices[0].text[:-1] in ("yes.", "no.") and r.choices[0].text[-1].isdigit()
    r = client.completions.create(model="mini", prompt="x = ", max_tokens=24, temperature=0.5, seed=3,
                                  extra_body={"lark_grammar": 'start: "f(" NUM ("," NUM){0,2} ")"\n'
                                                              'NUM: /[1-9][0-9]?/'})
    text = r.choices[0].text
    assert text.startswith("f(") and text.endswith(")") and all(n.isdigit() for n in text[2:-1].split(","))
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "p", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "letters"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "json_object", "schema": 5}}, "response_format.schema", "schema"),
    ({"json_schema": {"type": "number", "minimum": "x"}}, "json_schema", "minimum"),
    ({"grammar": "root ::= missing"}, "grammar", "missing"),
    ({"grammar": "root ::= \"a"}, "grammar", ""),
    ({"lark_grammar": "start: nope"}, "lark_grammar", "nope"),
    ({"lark_grammar": "  "}, "lark_grammar", "empty"),
    ({"json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}, "grammar", "one of"),
])
def test_bad_schemas_and_grammars_are_400_naming_the_field(served, body, param, words):
    client, http = served["mini"]
    for route, base in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        resp = http.post(route, json={"model": "mini", "max_tokens": 8, **base, **body})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error"
        assert words in err["message"] and "\n" not in err["message"] and "Traceback" not in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="mini", messages=ASK, max_tokens=8, extra_body=body)
    assert e.value.body["param"] == param
    ok = client.chat.completions.create(model="mini", messages=ASK, max_tokens=4, temperature=0)   # still up
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls(served, stream):
    """A K3-format template (markers as text in the mini's vocabulary), thinking off: the answer is
    calls of the declared tools with arguments that follow their schemas."""
    client, _ = served["k3"]
    names = set()
    runs = [(0, "required", None), (3, {"type": "function", "function": {"name": "convert"}}, None)]
    if not stream:
        runs += [(1, "required", False), (2, "required", None)]
    for seed, choice, parallel in runs:
        kw: dict[str, Any] = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = client.chat.completions.create(
            model="mini", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
            tool_choice=choice, max_tokens=400, temperature=0.8, seed=seed, stream=stream,
            extra_body={"chat_template_kwargs": {"thinking": False}}, **kw)
        if stream:
            calls: dict[int, dict[str, str]] = {}
            finish = None
            for ch in r:
                if not ch.choices:
                    continue
                for tc in ch.choices[0].delta.tool_calls or ():
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
                finish = ch.choices[0].finish_reason or finish
            got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        else:
            finish = r.choices[0].finish_reason
            assert r.choices[0].message.content is None
            got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert finish == "tool_calls" and got
        if parallel is False:
            assert len(got) == 1
        if isinstance(choice, dict):
            assert {n for n, _ in got} == {"convert"}
        for name, arguments in got:
            names.add(name)
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if not stream:
        assert names == set(SCHEMAS)
