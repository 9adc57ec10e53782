"""A chat request's tools, tool choice, tool-call history and template switches, checked and put
the way the chat template receives them.

What reaches the template is what llama.cpp's server passes to the same Jinja template
(common/chat.cpp), so the prompt text is the same:

* `tools`: each as {"type": "function", "function": {"name", "description" (default ""),
  "parameters" (default {})}} (other keys dropped, as llama.cpp re-serialises them);
* messages: {"role", "content"} (text parts joined; "" when absent), plus `reasoning_content`,
  `name`, `tool_call_id` and `tool_calls` when given; a call's `arguments` (a JSON object string
  on the wire) is passed as the object, as llama.cpp does for templates that take objects (K3's
  writes one argument tag per key);
* `chat_template_kwargs` as template variables (K3's: `thinking` (bool), `thinking_effort`
  (low, high, max)); `reasoning_effort` as llama.cpp passes it, and for K3 also as
  `thinking_effort` when the kwargs do not set it (none: thinking off; minimal/low: low;
  medium/high: high; max/xhigh: max);
* `tool_choice` ("auto", "none", "required"; a named function is "required" with only that
  function declared) and `response_format`, which K3's template renders as system messages.

Refused with 400 naming the parameter: tools when the template has no tool-call format k3kit
knows, a tool that is not a function or has no valid name, duplicate names, a tool_choice naming
a function not in tools (or any tool_choice other than auto/none without tools), malformed
`tool_calls` in the history, a tool message whose `tool_call_id` matches no earlier call, and the
legacy `functions` / `function_call` fields (send `tools` / `tool_choice`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from k3kit.serve.api import ChatRequest, bad, message_text
from k3kit.serve.tool_parsers import chat_format

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
EFFORT = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "max": "max", "xhigh": "max"}


@dataclass
class ChatInputs:
    """What the chat route renders: messages, tools and template variables; and what the output
    parser needs (the format, the declared tools, the calls already in the conversation)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    variables: dict[str, Any] = field(default_factory=dict)
    format: str | None = None
    call_offset: int = 0
    tool_choice: str | None = None   # auto, none, required (a named function: required, only it declared)

    @property
    def required(self) -> bool:
        """Whether the answer must call one of the declared tools."""
        return self.tool_choice == "required" and bool(self.tools)


def _tools(body: ChatRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(body.tools):
        param = f"tools[{i}]"
        if tool.get("type") != "function":
            raise bad(f"{param}.type must be \"function\" (the only kind of tool k3kit serves)",
                      f"{param}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{param}.function must be an object", f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"{param}.function.name must be 1-64 letters, digits, _ . or -",
                      f"{param}.function.name")
        if name in seen:
            raise bad(f"{param}.function.name {name!r} is declared twice", f"{param}.function.name")
        seen.add(name)
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise bad(f"{param}.function.description must be a string", f"{param}.function.description")
        parameters = fn.get("parameters", {})
        if parameters is None:
            parameters = {}
        if not isinstance(parameters, dict):
            raise bad(f"{param}.function.parameters must be a JSON schema object",
                      f"{param}.function.parameters")
        out.append({"type": "function", "function": {"name": name, "description": description,
                                                     "parameters": parameters}})
    return out


def _tool_choice(body: ChatRequest, tools: list[dict[str, Any]] | None
                 ) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(the template's tool_choice, the tools to declare)."""
    choice = body.tool_choice
    if choice is None:
        return None, tools
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad(f"tool_choice {choice!r} is not one of auto, none, required or a function",
                      "tool_choice")
        if choice == "required" and not tools:
            raise bad("tool_choice \"required\" needs tools", "tool_choice")
        return choice, tools
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad("tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}", "tool_choice")
    named = [t for t in tools or () if t["function"]["name"] == name]
    if not named:
        raise bad(f"tool_choice names the function {name!r}, which tools does not declare", "tool_choice")
    return "required", named


def _arguments(value: object, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as e:
            raise bad(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise bad(f"{param} must be a JSON object", param)
    return value


def _calls(raw: object, i: int) -> list[dict[str, Any]]:
    param = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise bad(f"{param} must be a list", param)
    out = []
    for j, call in enumerate(raw):
        p = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise bad(f"{p} must be an object", p)
        if call.get("type", "function") != "function":
            raise bad(f"{p}.type must be \"function\"", f"{p}.type")
        cid = call.get("id")
        if not isinstance(cid, str) or not cid:
            raise bad(f"{p}.id must be a non-empty string", f"{p}.id")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{p}.function must be an object", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{p}.function.name must be a non-empty string", f"{p}.function.name")
        args = _arguments(fn.get("arguments", {}), f"{p}.function.arguments")
        out.append({"type": "function", "function": {"name": name, "arguments": args}, "id": cid})
    return out


def _messages(body: ChatRequest) -> tuple[list[dict[str, Any]], int]:
    """The messages as the template gets them, and how many tool calls the history holds."""
    if not body.messages:
        raise bad("messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    ids: set[str] = set()
    n_calls = 0
    for i, m in enumerate(body.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": message_text(m, i)}
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning:
            if m.role != "assistant":
                raise bad(f"messages[{i}].reasoning_content is for assistant messages", f"messages[{i}]")
            msg["reasoning_content"] = reasoning
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise bad(f"messages[{i}].tool_calls is for assistant messages", f"messages[{i}].tool_calls")
            calls = _calls(m.tool_calls, i)
            for j, c in enumerate(calls):
                if c["id"] in ids:
                    raise bad(f"messages[{i}].tool_calls[{j}].id {c['id']!r} is used by an earlier call",
                              f"messages[{i}].tool_calls[{j}].id")
                ids.add(c["id"])
            n_calls += len(calls)
            if calls:
                msg["tool_calls"] = calls
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad(f"messages[{i}].tool_call_id is required for a tool message",
                          f"messages[{i}].tool_call_id")
            if m.tool_call_id not in ids:
                raise bad(f"messages[{i}].tool_call_id {m.tool_call_id!r} matches no tool call of an earlier "
                          "assistant message", f"messages[{i}].tool_call_id")
        if m.tool_call_id is not None:
            if m.role != "tool":
                raise bad(f"messages[{i}].tool_call_id is for tool messages", f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out, n_calls


def _variables(body: ChatRequest, fmt: str | None) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED or not key.isidentifier():
            raise bad(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
    if "thinking" in kwargs and not isinstance(kwargs["thinking"], bool):
        raise bad("chat_template_kwargs.thinking must be true or false", "chat_template_kwargs")
    effort = body.reasoning_effort
    if effort is not None:
        if effort != "none" and effort not in EFFORT:
            raise bad(f"reasoning_effort {effort!r} is not one of none, {', '.join(EFFORT)}",
                      "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
        if fmt == "kimi-k3" and "thinking_effort" not in kwargs:
            if effort == "none":
                kwargs.setdefault("thinking", False)
            else:
                kwargs["thinking_effort"] = EFFORT[effort]
    if fmt == "kimi-k3" and kwargs.get("thinking_effort") not in (None, "low", "high", "max") \
            and kwargs.get("thinking", True):
        raise bad(f"chat_template_kwargs.thinking_effort {kwargs['thinking_effort']!r} is not one of low, "
                  "high, max", "chat_template_kwargs")
    return kwargs


def chat_inputs(body: ChatRequest, template_source: str | None) -> ChatInputs:
    """Check the request's tool fields against the template and gather what it renders."""
    if body.functions is not None:
        raise bad("functions is the deprecated form of tools; send tools: [{\"type\": \"function\", "
                  "\"function\": {...}}]", "functions")
    if body.function_call is not None:
        raise bad("function_call is the deprecated form of tool_choice; send tool_choice", "function_call")
    fmt = chat_format(template_source)
    tools = _tools(body)
    if tools and fmt is None:
        raise bad("tools: this model's chat template has no tool-call format k3kit can parse "
                  "(known: Kimi-K3, Kimi-K2)", "tools")
    choice, declared = _tool_choice(body, tools)
    messages, n_calls = _messages(body)
    variables = _variables(body, fmt)
    if choice is not None and choice != "auto" and tools:
        variables["tool_choice"] = choice
    if body.response_format is not None:
        variables["response_format"] = body.response_format
    return ChatInputs(messages, declared, variables, fmt, n_calls, tool_choice=choice)
