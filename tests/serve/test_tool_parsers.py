"""The chat-format output parsers on hand-written Kimi-K3 (XTML) and Kimi-K2 messages: channels to
reasoning_content / content, calls to tool_calls with typed JSON arguments, and the same result
however the text is split into pieces (every byte boundary, one character at a time)."""

from __future__ import annotations

import json

import pytest

from k3kit.serve.tool_parsers import ChatOutput, chat_format, output_parser
from k3kit.serve.tool_parsers.kimi_k2 import KimiK2Parser
from k3kit.serve.tool_parsers.kimi_k3 import KimiK3Parser, parse_tag


def k3_call(name: str, index: int, *args: tuple[str, str, str]) -> str:
    body = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>'
                   for k, t, v in args)
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}<|close|>call<|sep|>'


def k3_message(think: str | None, response: str, calls: list[str] = (), opener: bool = False) -> str:
    out = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>' if opener else ""
    if think is not None:
        out += f"{think}<|close|>think<|sep|>"
    out += f"<|open|>response<|sep|>{response}<|close|>response<|sep|>"
    if calls:
        out += "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"
    return out + "<|close|>message<|sep|>"


WEATHER = k3_call("get_weather", 1, ("city", "string", 'Paris "FR" ünï\n'), ("days", "number", "3"))
SEARCH = k3_call("search", 2, ("q", "string", "a<b & c"), ("exact", "boolean", "true"),
                 ("filters", "object", '{"lang": "en", "n": [1, 2]}'), ("tags", "array", '["x"]'),
                 ("none", "null", "null"), ("score", "number", "-1.5e3"))
FULL = k3_message("Let me look that up.", "Checking.", [WEATHER, SEARCH])


def run(parser, pieces: list[str]) -> dict:
    out = ChatOutput(parser)
    deltas = [out.feed(p) for p in pieces] + [out.finish()]
    for d in deltas:
        assert d != {}, "an empty delta"
        for call in (d or {}).get("tool_calls", []):
            assert call["function"].get("name") or call["function"]["arguments"], "an empty tool-call delta"
    return {"message": out.message(), "deltas": [d for d in deltas if d]}


def k3(**kw) -> KimiK3Parser:
    return KimiK3Parser(**kw)


def test_thinking_response_and_calls():
    msg = run(k3(), [FULL])["message"]
    assert msg["reasoning_content"] == "Let me look that up."
    assert msg["content"] == "Checking."
    calls = msg["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "search"]
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.search:1"]
    assert all(c["type"] == "function" for c in calls)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Paris "FR" ünï\n', "days": 3}
    assert json.loads(calls[1]["function"]["arguments"]) == {
        "q": "a<b & c", "exact": True, "filters": {"lang": "en", "n": [1, 2]}, "tags": ["x"], "none": None,
        "score": -1500.0}


def test_one_call_without_content_has_null_content():
    out = ChatOutput(k3())
    out.feed(k3_message("hm", "", [WEATHER]))
    out.finish()
    msg = out.message()
    assert msg["content"] is None and len(msg["tool_calls"]) == 1
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


def test_plain_answer_has_no_tool_calls():
    out = ChatOutput(k3(start="response"))
    out.feed("Just text.<|close|>response<|sep|><|close|>message<|sep|>")
    out.finish()
    assert out.message() == {"role": "assistant", "content": "Just text."}
    assert out.finish_reason("stop") == "stop"


@pytest.mark.parametrize("text", [FULL, k3_message(None, "x", [WEATHER], opener=True),
                                  k3_message("t", "a <|b|> c <|open|>x", [SEARCH, WEATHER, WEATHER])])
def test_every_split_gives_the_same_result(text):
    whole = run(k3(), [text])["message"]
    data = text.encode()
    for cut in range(1, len(data)):
        a, b = data[:cut].decode(errors="ignore"), data[cut:].decode(errors="ignore")
        if (a + b).encode() != data:          # a cut inside a character: the decoder releases it whole
            continue
        assert run(k3(), [a, b])["message"] == whole, cut
    assert run(k3(), list(text))["message"] == whole


def test_arguments_are_streamed_as_they_come():
    text = k3_message("t", "", [k3_call("f", 1, ("s", "string", "abcdefgh"), ("n", "number", "12"))])
    deltas = run(k3(), list(text))["deltas"]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    first = calls[0]
    assert first["id"] == "functions.f:0" and first["type"] == "function"
    assert first["function"] == {"name": "f", "arguments": ""}
    pieces = [c["function"]["arguments"] for c in calls[1:]]
    assert all(pieces) and all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert len([p for p in pieces if p in "abcdefgh"]) == 8          # the string, character by character
    assert json.loads("".join(pieces)) == {"s": "abcdefgh", "n": 12}


def test_type_from_the_schema_when_the_attribute_is_missing():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}}]
    parser = output_parser("kimi-k3", "<|open|>think<|sep|>", tools=tools)
    text = ('<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
            '<|open|>argument key="n"<|sep|>7<|close|>argument<|sep|><|open|>argument key="s"<|sep|>7'
            '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    msg = run(parser, [text])["message"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"n": 7, "s": "7"}


def test_json_block_arguments_and_bad_typed_values():
    text = ('x<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
            '<|open|>json type="object"<|sep|>{"a": [1, "<|x"]}<|close|>json<|sep|><|close|>call<|sep|>'
            + k3_call("g", 2, ("n", "number", "not a number"), ("b", "boolean", "True"))
            + "<|close|>tools<|sep|>")
    calls = run(k3(), [text])["message"]["tool_calls"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": [1, "<|x"]}
    assert json.loads(calls[1]["function"]["arguments"]) == {"n": "not a number", "b": True}


def test_missing_think_marker():
    # the prompt opened think, the model went straight to the response and a call
    msg = run(k3(), ['<|open|>response<|sep|>Hi<|close|>response<|sep|><|open|>tools<|sep|>' + WEATHER
                     + "<|close|>tools<|sep|>"])["message"]
    assert "reasoning_content" not in msg and msg["content"] == "Hi" and len(msg["tool_calls"]) == 1
    # reasoning never closed: the tools section still ends it, the call is whole
    msg = run(k3(), ["thinking... <|open|>tools<|sep|>" + WEATHER])["message"]
    assert msg["reasoning_content"] == "thinking... "
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"])["days"] == 3
    # thinking off: the prompt opened the response channel
    msg = run(output_parser("kimi-k3", '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'),
              ["Hello<|close|>response<|sep|>"])["message"]
    assert msg == {"role": "assistant", "content": "Hello"}


def test_generation_cut_inside_a_call_still_gives_a_json_object():
    text = FULL[:FULL.index("Paris") + 3]
    msg = run(k3(), [text])["message"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Par"}
    msg = run(k3(), [FULL[:FULL.index('<|open|>argument key="days"') + 10]])["message"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"])["city"].startswith("Paris")


def test_call_offset_and_attribute_escapes():
    text = '<|open|>tools<|sep|><|open|>call tool="a&amp;b" index="1"<|sep|><|open|>argument key="k&quot;" ' \
           'type="string"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    msg = run(k3(start="response", call_offset=4), [text])["message"]
    call = msg["tool_calls"][0]
    assert call["id"] == "functions.a&b:4" and json.loads(call["function"]["arguments"]) == {'k"': "v"}
    tag = parse_tag('<|open|>call tool="x" index="1"<|sep|>')
    assert tag == ("open", "call", {"tool": "x", "index": "1"})
    assert parse_tag("<|open|>not a tag<|sep|>") is None


def test_chat_format_detection():
    assert chat_format(None) is None and chat_format("{{ messages }}") is None
    assert chat_format("<|open|> <|close|> <|end_of_msg|>") == "kimi-k3"
    both = "<|tool_calls_section_begin|><|tool_call_begin|><|open|><|close|><|end_of_msg|>"
    assert chat_format(both) == "kimi-k2"


K2 = ("<think>plan</think>Sure.<|tool_calls_section_begin|>"
      '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
      "<|tool_call_end|>"
      "<|tool_call_begin|>functions.noop:1<|tool_call_argument_begin|><|tool_call_end|>"
      "<|tool_calls_section_end|>")


def test_kimi_k2_format():
    whole = run(KimiK2Parser(call_offset=2), [K2])["message"]
    assert whole["reasoning_content"] == "plan" and whole["content"] == "Sure."
    calls = whole["tool_calls"]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("functions.get_weather:2", "get_weather", {"city": "Paris"}), ("functions.noop:3", "noop", {})]
    for cut in range(1, len(K2)):
        assert run(KimiK2Parser(call_offset=2), [K2[:cut], K2[cut:]])["message"] == whole, cut
