"""Kimi-K3's own chat template with tools, calls, results and thinking: k3kit's chat route inputs
rendered by k3kit against the same messages rendered the way llama.cpp passes them.

The shipped mini carries Kimi-K3's template (src/k3kit/mini/assets/kimi-k3.jinja), which must be
llama.cpp's models/templates/Kimi-K3.jinja byte for byte (from the llama-cpp-python 0.3.36 sdist
that tests/interop unpacks; those checks skip when it is not there). The reference render is
llama-cpp-python's Jinja2ChatFormatter (the jinja2 formatter its server uses for a GGUF's
template) over messages and tools shaped as llama.cpp's common/chat.cpp shapes them (tools
re-serialised to {type, function: {name, description, parameters}}, call arguments parsed to
objects, empty content ""). llama.cpp's own C++ Jinja engine is not exposed by the package's
libraries, so that engine itself is not the oracle. The mini's vocabulary has K3's markers
(<|open|>, <|sep|>, ...) as control tokens, so the rendered texts are compared, then their token
ids through k3kit's tokenizer and through llama.cpp's (llama_cpp vocab-only), which must agree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from k3kit.gguf.shards import Model
from k3kit.serve.api import ChatRequest
from k3kit.serve.tools import chat_inputs
from k3kit.tokenizer.codec import TextCodec

MINI = Path(__file__).resolve().parents[2] / "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"
SDIST = "llama_cpp_python-0.3.36"
NAME = "models/templates/Kimi-K3.jinja"


def k3_template() -> str:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k3kit" / SDIST / "llama.cpp"
    for root in (Path("/tmp/sdist") / SDIST / "vendor" / "llama.cpp", cache):
        if (root / NAME).is_file():
            return (root / NAME).read_text()
    pytest.skip(f"llama.cpp's {NAME} is not unpacked (tests/interop/test_convert_vs_llama.py fetches it)")


def test_the_shipped_template_is_llama_cpps():
    from k3kit.mini.tokenizer import CHAT_TEMPLATE

    assert CHAT_TEMPLATE == k3_template()
    model = Model.open(MINI)
    try:
        assert TextCodec(model.kv).chat.source == CHAT_TEMPLATE
    finally:
        model.close()


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    model = Model.open(MINI)
    try:
        return TextCodec(model.kv)
    finally:
        model.close()


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "required": ["city"], "properties": {
                                          "city": {"type": "string", "description": "the city"},
                                          "days": {"type": "integer"}}}, "strict": True}},
    {"type": "function", "function": {"name": "now"}},
]
CALLS = [{"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris \\"FR\\"", "days": 3}'}},
         {"id": "functions.now:1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two tools.",
     "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "functions.now:1", "content": "12:00"},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    {"role": "assistant", "content": "Sunny, and it is noon."},
    {"role": "user", "content": [{"type": "text", "text": "Tomorrow?"}]},
]


def llama_cpp_shape(messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """Messages and tools as llama.cpp's common/chat.cpp hands them to a template that takes
    object arguments (to_json_oaicompat, requires_non_null_content, func_args_not_string)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content)
        j = {"role": "system" if m["role"] == "developer" else m["role"], "content": content or ""}
        if m.get("reasoning_content"):
            j["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_call_id"):
            j["tool_call_id"] = m["tool_call_id"]
        if m.get("tool_calls"):
            j["tool_calls"] = [{"type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": json.loads(c["function"]["arguments"])},
                                "id": c["id"]} for c in m["tool_calls"]]
        out.append(j)
    shaped = None if not tools else [
        {"type": "function", "function": {"name": t["function"]["name"],
                                          "description": t["function"].get("description", ""),
                                          "parameters": t["function"].get("parameters", {})}} for t in tools]
    return out, shaped


def reference(template: str, messages: list[dict], tools: list[dict] | None, **variables) -> str:
    fmt = pytest.importorskip("llama_cpp.llama_chat_format")
    msgs, shaped = llama_cpp_shape(messages, tools)
    return fmt.Jinja2ChatFormatter(template, eos_token="", bos_token="")(
        messages=msgs, tools=shaped, **variables).prompt


def ours(codec: TextCodec, body: dict) -> str:
    inputs = chat_inputs(ChatRequest.model_validate(body), codec.chat.source)
    return codec.chat.render(inputs.messages, add_generation_prompt=True, tools=inputs.tools,
                             **inputs.variables)


CASES = {
    "tools, calls, results, thinking": ({"messages": HISTORY, "tools": TOOLS}, {}),
    "thinking off": ({"messages": HISTORY, "tools": TOOLS, "chat_template_kwargs": {"thinking": False}},
                     {"thinking": False}),
    "effort low": ({"messages": HISTORY[:2], "tools": TOOLS, "reasoning_effort": "low"},
                   {"thinking_effort": "low", "reasoning_effort": "low"}),
    "tool_choice required": ({"messages": HISTORY[:2], "tools": TOOLS, "tool_choice": "required"},
                             {"tool_choice": "required"}),
    "tool_choice none": ({"messages": HISTORY[:2], "tools": TOOLS, "tool_choice": "none"},
                         {"tool_choice": "none"}),
    "no tools": ({"messages": [{"role": "user", "content": "hi"}]}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_k3_template_renders_as_llama_cpp(codec, case):
    body, variables = CASES[case]
    text = ours(codec, body)
    assert text == reference(codec.chat.source, body["messages"], body.get("tools"), **variables)
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(MINI), vocab_only=True, verbose=False)
    try:
        assert codec.encode(text, add_bos=False) == ref.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        ref.close()


def test_k3_rendering_details(codec):
    text = ours(codec, {"messages": HISTORY, "tools": TOOLS})
    assert text.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools')
    assert '"strict"' not in text                          # llama.cpp's tool shape drops other keys
    assert ('<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>'
            'Paris "FR"<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3'
            '<|close|>argument<|sep|><|close|>call<|sep|>') in text
    assert "<|open|>think<|sep|>Two tools.<|close|>think<|sep|>" in text
    # results in the order of the calls, each named by its call
    weather = text.index('role="tool" tool="get_weather" index="1"')
    now = text.index('role="tool" tool="now" index="2"')
    assert weather < now
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
