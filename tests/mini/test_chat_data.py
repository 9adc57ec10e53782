"""The mini's chat training data: generated conversations rendered as `k3kit serve` renders them,
whose assistant messages k3kit's own Kimi-K3 parser reads back into the calls they were made of."""

from __future__ import annotations

import json

import pytest

from k3kit.mini import chat_data
from k3kit.mini.corpus import build_corpus
from k3kit.mini.tokenizer import CHAT_TEMPLATE
from k3kit.serve.tool_parsers import KIMI_K3, ChatOutput, output_parser
from k3kit.tokenizer.chat import ChatTemplate

OPENER = '<|open|>message role="assistant"<|sep|>'
CLOSER = "<|close|>message<|sep|><|end_of_msg|>"


@pytest.fixture(scope="module")
def facts():
    c = build_corpus(max_bytes=400_000)
    return chat_data.Facts.from_sources(c.train_paths, c.train_docs)


@pytest.fixture(scope="module")
def template():
    return ChatTemplate(CHAT_TEMPLATE, where="test")


def calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", [])]


def test_conversations_are_deterministic_and_varied(facts):
    bodies = [chat_data.conversation(i, facts) for i in range(300)]
    assert bodies[:20] == [chat_data.conversation(i, facts) for i in range(20)]
    assert len({json.dumps(b, sort_keys=True) for b in bodies}) >= 295     # a greeting may repeat
    calls = [c for b in bodies for m in b["messages"] for c in m.get("tool_calls", [])]
    names = {c["function"]["name"] for c in calls}
    assert names == set(chat_data.TOOLS)
    assert sum(b.get("tool_choice") == "required" for b in bodies) > 5
    assert sum(b.get("tool_choice") == "none" for b in bodies) > 2
    assert sum("response_format" in b for b in bodies) > 10
    assert sum(b.get("chat_template_kwargs", {}).get("thinking") is False for b in bodies) > 20
    for b in bodies:                      # every call is one of the conversation's declared tools
        declared = {t["function"]["name"] for t in b.get("tools", [])}
        for m in b["messages"]:
            for c in m.get("tool_calls", []):
                assert c["function"]["name"] in declared
        if b.get("tool_choice") == "required":
            assert b["messages"][-1].get("tool_calls")


def test_rendered_replies_parse_back_into_their_calls(facts, template):
    for i in range(120):
        body = chat_data.conversation(i, facts)
        text = chat_data.render(body, template)
        last = body["messages"][-1]
        if last["role"] != "assistant":
            assert text.endswith(CLOSER)
            continue
        # the reply follows the served prompt: instructions (tool choice, response format) precede it
        cut = text.rindex(OPENER) + len(OPENER)
        prompt, reply = text[:cut], text[cut:]
        thinking = body.get("chat_template_kwargs", {}).get("thinking", True)
        opener = "<|open|>think<|sep|>" if thinking else "<|open|>response<|sep|>"
        assert reply.startswith(opener) and reply.endswith(CLOSER)
        if body.get("tool_choice") in ("required", "none"):
            assert f"`tool_choice={body['tool_choice']}`" in prompt
        if "response_format" in body:
            assert "`response_format=json_object`" in prompt
        parser = output_parser(KIMI_K3, prompt + opener, tools=body.get("tools"))
        assert parser is not None
        out = ChatOutput(parser)
        out.feed(reply[len(opener):].removesuffix("<|end_of_msg|>"))
        out.finish()
        msg = out.message()
        assert calls(msg) == calls(last), (i, reply)
        assert (msg["content"] or "") == last["content"]
        if thinking:
            assert msg.get("reasoning_content") == last["reasoning_content"]
