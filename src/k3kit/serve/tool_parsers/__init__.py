"""Assistant output in the model's chat format -> OpenAI's reasoning_content, content and tool_calls.

`chat_format(template source)` names the format a file's chat template writes, the way llama.cpp
picks its parser (common/chat.cpp): "kimi-k2" when the template has `<|tool_calls_section_begin|>`
and `<|tool_call_begin|>`, "kimi-k3" when it has `<|open|>`, `<|close|>` and `<|end_of_msg|>`,
else None (no tool-call format k3kit knows: the output is plain content, and a request with tools
is refused). `output_parser` makes the incremental parser for one response, starting in the
channel the rendered prompt ends in. `ChatOutput` turns its pieces into the chat API's deltas
(`delta.reasoning_content`, `delta.content`, `delta.tool_calls[i]`: the first with id, type and
function name and `arguments: ""`, then `function.arguments` pieces) and, at the end, into the
non-streamed message; both come from the same pieces, so they agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import OutputParser, Piece, call_id
from .kimi_k2 import KimiK2Parser
from .kimi_k3 import RESPONSE_OPENER, THINK_OPENER, KimiK3Parser, schema_types

__all__ = ["ChatOutput", "OutputParser", "Piece", "call_id", "chat_format", "output_parser"]

KIMI_K2 = "kimi-k2"
KIMI_K3 = "kimi-k3"


def chat_format(source: str | None) -> str | None:
    """The tool-call format of a chat template's source (None: none k3kit knows)."""
    if not source:
        return None
    if "<|tool_calls_section_begin|>" in source and "<|tool_call_begin|>" in source:
        return KIMI_K2
    if "<|open|>" in source and "<|close|>" in source and "<|end_of_msg|>" in source:
        return KIMI_K3
    return None


def output_parser(fmt: str | None, prompt: str, *, tools: Sequence[Mapping[str, Any]] | None = None,
                  call_offset: int = 0) -> OutputParser | None:
    """The parser of one response to `prompt` (the rendered chat prompt); None for no format."""
    if fmt == KIMI_K3:
        tail = prompt.rstrip(" \n")
        start = "think" if tail.endswith(THINK_OPENER) else "response" if tail.endswith(RESPONSE_OPENER) \
            else "message"
        return KimiK3Parser(start=start, types=schema_types(list(tools or [])), call_offset=call_offset)
    if fmt == KIMI_K2:
        start = "think" if prompt.rstrip(" \n").endswith("<think>") else "content"
        return KimiK2Parser(start=start, call_offset=call_offset)
    return None


class ChatOutput:
    """One chat response's text through a parser: stream deltas and the final message."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.ended = False           # finish() ran: the response ended as the model ended it

    def _take(self, pieces: list[Piece]) -> dict[str, Any] | None:
        """Record `pieces` and return them as one chat delta (None when they carry nothing)."""
        reasoning, content = [], []
        calls: dict[int, dict[str, Any]] = {}
        for p in pieces:
            if p.kind == "reasoning":
                reasoning.append(p.text)
                self.reasoning.append(p.text)
            elif p.kind == "content":
                content.append(p.text)
                self.content.append(p.text)
            elif p.kind == "call":
                self.calls.append({"id": p.id, "type": "function",
                                   "function": {"name": p.name, "arguments": ""}})
                calls[p.index] = {"index": p.index, "id": p.id, "type": "function",
                                  "function": {"name": p.name, "arguments": ""}}
            elif p.text:     # arguments
                self.calls[p.index]["function"]["arguments"] += p.text
                entry = calls.setdefault(p.index, {"index": p.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += p.text
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = "".join(reasoning)
        if content:
            delta["content"] = "".join(content)
        if calls:
            delta["tool_calls"] = [calls[i] for i in sorted(calls)]
        return delta or None

    def feed(self, text: str) -> dict[str, Any] | None:
        return self._take(self.parser.feed(text)) if text else None

    def finish(self) -> dict[str, Any] | None:
        self.ended = True
        return self._take(self.parser.finish())

    def message(self) -> dict[str, Any]:
        """The non-streamed `message` (call after `finish`): content null when the message is only
        tool calls, reasoning_content only when there was reasoning."""
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: "tool_calls" when the model stopped after calling tools."""
        return "tool_calls" if self.calls and reason == "stop" else reason
