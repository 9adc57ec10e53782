"""Tools and reasoning through the chat route, in-process (no model): a stub scheduler emits a
scripted Kimi-K3-format answer in odd-sized pieces, and the `openai` client reads
`reasoning_content`, `content` and `tool_calls` from it, streamed and not; the request checks
(400 naming the parameter) and what reaches the chat template."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402

from k3kit.gguf.shards import Model  # noqa: E402
from k3kit.serve.app import ServerState, build_app  # noqa: E402
from k3kit.serve.scheduler import FinishEvent, GenerationRequest, RequestStream, SchedulerStats, TokenEvent  # noqa: E402
from k3kit.tokenizer.chat import KIMI_TEMPLATE, ChatTemplate  # noqa: E402
from k3kit.tokenizer.codec import TextCodec  # noqa: E402

MINI = Path(__file__).resolve().parents[2] / "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"

# A small template in K3's message format that shows what it was given.
TEMPLATE = (
    "{%- if tools -%}<|open|>message role=\"system\" type=\"tool-declare\"<|sep|>{{ tools|tojson }}"
    "<|close|>message<|sep|><|end_of_msg|>{%- endif -%}"
    "{%- for m in messages -%}<|open|>message role=\"{{ m.role }}\"<|sep|>{{ m.content }}"
    "{%- if m.tool_calls -%}CALLS{{ m.tool_calls|tojson }}{%- endif -%}"
    "{%- if m.tool_call_id -%}ID={{ m.tool_call_id }}{%- endif -%}"
    "<|close|>message<|sep|><|end_of_msg|>{%- endfor -%}"
    "{%- if tool_choice is defined -%}CHOICE={{ tool_choice }}{%- endif -%}"
    "{%- if thinking_effort is defined -%}EFFORT={{ thinking_effort }}{%- endif -%}"
    "{%- if add_generation_prompt -%}<|open|>message role=\"assistant\"<|sep|>"
    "{{- '<|open|>think<|sep|>' if thinking is not defined or thinking else '<|open|>response<|sep|>' -}}"
    "{%- endif -%}")

ANSWER = ('I should check the weather.<|close|>think<|sep|><|open|>response<|sep|>Let me check.'
          '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
          '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
          '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
          '<|open|>call tool="get_time" index="2"<|sep|><|open|>argument key="utc" type="boolean"<|sep|>true'
          '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>')

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


class Scripted:
    """A Scheduler that answers every request with `text`, in pieces of 1, 2, 3... characters."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.requests: list[GenerationRequest] = []
        self.ahead: list[tuple[int, ...]] = []

    def submit(self, request: GenerationRequest) -> RequestStream:
        self.requests.append(request)
        stream = RequestStream(request, lambda _id: None)
        pos, size = 0, 1
        while pos < len(self.text):
            stream.post(TokenEvent(self.text[pos:pos + size], (5,)))
            pos, size = pos + size, size % 7 + 1
        stream.post(FinishEvent("stop", len(request.prompt_ids), len(self.text)))
        return stream

    def cancel(self, request_id: str) -> None:
        pass

    def prefill_ahead(self, prompt_ids, like: GenerationRequest) -> bool:
        self.ahead.append(tuple(prompt_ids))
        return True

    def stats(self) -> SchedulerStats:
        return SchedulerStats()

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def codec():
    model = Model.open(MINI)
    try:
        codec = TextCodec(model.kv)
    finally:
        model.close()
    codec.chat = ChatTemplate(TEMPLATE, where="test", vocab=codec.vocab_tokens)
    return codec


@pytest.fixture
def served(codec):
    stub = Scripted(ANSWER)
    state = ServerState(model_id="k3")
    state.ready(stub, codec, 4096)
    with TestClient(build_app(state)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                               max_retries=0)
        yield client, stub, http, codec


def prompt_of(stub: Scripted, codec: TextCodec) -> str:
    """The prompt's text, K3's marker tokens (control tokens of the mini) shown."""
    ids = stub.requests[-1].prompt_ids
    stream = codec.streamer(codec.control_ids([codec.vocab_tokens[i] for i in set(ids)
                                               if not codec.token_bytes[i]]))
    return "".join(stream.push(i) for i in ids) + stream.flush()


def test_openai_client_gets_tool_calls_and_reasoning(served):
    client, stub, _, codec = served
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="k3", messages=ask,
                                       tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me check."
    assert msg.model_extra["reasoning_content"] == "I should check the weather."
    calls = msg.tool_calls
    assert [(c.id, c.type, c.function.name) for c in calls] == [
        ("functions.get_weather:0", "function", "get_weather"),
        ("functions.get_time:1", "function", "get_time")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1].function.arguments) == {"utc": True}
    prompt = prompt_of(stub, codec)
    assert '"name": "get_weather"' in prompt and '"description": ""' in prompt     # llama.cpp's tool shape
    assert prompt.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')

    # streamed: the same calls, built from deltas
    reasoning, content, built = "", "", {}
    finish = None
    for chunk in client.chat.completions.create(model="k3", messages=ask,
                                                tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or ():
            entry = built.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert entry["id"] is None and tc.function.name
                entry["id"], entry["name"] = tc.id, tc.function.name
            else:
                assert tc.function.arguments, "an empty tool-call delta"
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert reasoning == msg.model_extra["reasoning_content"] and content == msg.content
    assert [(e["id"], e["name"], e["arguments"]) for _, e in sorted(built.items())] == [
        (c.id, c.function.name, c.function.arguments) for c in calls]


def test_history_with_calls_and_results_reaches_the_template(served):
    client, stub, _, codec = served
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "functions.get_weather:0", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    r = client.chat.completions.create(model="k3", messages=history, tools=TOOLS, tool_choice="required",
                                       reasoning_effort="medium")
    prompt = prompt_of(stub, codec)
    assert 'CALLS[{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", ' \
           '"days": 3}}, "id": "functions.get_weather:0"}]' in prompt
    assert "ID=functions.get_weather:0" in prompt and "sunny" in prompt
    assert "CHOICE=required" in prompt and "EFFORT=high" in prompt
    assert r.choices[0].message.tool_calls[0].id == "functions.get_weather:1"     # ids go on counting


def test_thinking_off_starts_in_the_response_channel(codec):
    stub = Scripted('Hello.<|close|>response<|sep|><|close|>message<|sep|>')
    state = ServerState(model_id="k3")
    state.ready(stub, codec, 4096)
    with TestClient(build_app(state)) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "chat_template_kwargs": {"thinking": False}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("patch, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].id"),
    ({"messages": [{"role": "assistant", "tool_calls": {"id": "x"}}]}, "messages[0].tool_calls"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"thinking_effort": "medium"}}, "chat_template_kwargs"),
])
def test_bad_requests_are_400_naming_the_parameter(served, patch, param):
    _, _, http, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], **patch}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert http.get("/health").status_code == 200


def test_tools_refused_where_the_template_has_no_tool_format():
    model = Model.open(MINI)
    try:
        codec = TextCodec(model.kv)
    finally:
        model.close()
    codec.chat = ChatTemplate(KIMI_TEMPLATE, where="test", vocab=codec.vocab_tokens)   # K2's plain format
    state = ServerState(model_id="k3")
    state.ready(Scripted("hi"), codec, 4096)
    with TestClient(build_app(state)) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_shown_control_tokens_decode_as_their_text(codec):
    control = next(i for i, b in enumerate(codec.token_bytes) if not b)
    text = codec.vocab_tokens[control]
    assert codec.control_ids([text]) == frozenset({control})
    plain, shown = codec.streamer(), codec.streamer(codec.control_ids([text]))
    assert plain.push(control) == "" and shown.push(control) == text


def _aheads(stub: Scripted, n: int) -> list[tuple[int, ...]]:
    """The prefills ahead queued, once there are `n` (the chat route queues them from a task)."""
    end = time.monotonic() + 10
    while len(stub.ahead) < n and time.monotonic() < end:
        time.sleep(0.01)
    return stub.ahead


def test_the_next_turn_is_prefilled_as_the_client_sends_it_back(served):
    """Once a chat response ended (streamed or not), the server queues for prefill the tokens the
    conversation's next request starts with: the reply rendered as the assistant message the
    client got back (reasoning, content and calls), whatever message comes next."""
    client, stub, _, codec = served
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="k3", messages=ask, tools=TOOLS)
    prompt = stub.requests[-1].prompt_ids
    ahead = _aheads(stub, 1)[0]
    assert len(ahead) > len(prompt)      # (this template renders no think opener in history)
    msg = r.choices[0].message.model_dump(exclude_none=True)      # as the SDK's users send it back
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in msg["tool_calls"]]
    for then in (results, [{"role": "user", "content": "Never mind."}]):
        client.chat.completions.create(model="k3", messages=[*ask, msg, *then], tools=TOOLS)
        assert stub.requests[-1].prompt_ids[:len(ahead)] == ahead
        assert len(stub.requests[-1].prompt_ids) > len(ahead)
    n = len(_aheads(stub, 3))
    list(client.chat.completions.create(model="k3", messages=ask, tools=TOOLS, stream=True))
    assert _aheads(stub, n + 1)[n] == ahead                  # streamed: the same message, the same start
    client.chat.completions.create(model="k3", messages=ask, tools=TOOLS, n=2)
    client.chat.completions.create(model="k3", messages=ask, tools=TOOLS, extra_body={"cache_prompt": False})
    time.sleep(0.2)
    assert len(stub.ahead) == n + 1                          # n > 1 or no cache: nothing ahead
