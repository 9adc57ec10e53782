"""Chat-formatted conversations for teaching the mini K3 its chat format, tools and thinking.

The mini is k3kit's stand-in for K3 in agent tests, so it must emit K3's structure by itself:
a `think` channel, a `response` channel, tool calls in the XTML call syntax with each argument
typed, answers that use a tool's result, JSON when `response_format` asks for it, and the
`<|end_of_msg|>` that ends a message. A model of 8 M parameters learns structure, not knowledge,
so the conversations are generated from templates filled with facts from the same CPython
standard library the mini was trained on (module names and docstrings, file paths and lines,
function sources) and from small fixed lists (cities, time zones, names). Nothing is downloaded.

Every conversation is an OpenAI chat request body (messages with `tool_calls` as JSON strings
and `role: "tool"` results, `tools`, `tool_choice`, `response_format`, `chat_template_kwargs`),
rendered through the same path `k3kit serve` uses (`serve.tools.chat_inputs` and the file's
template), so training text and served prompts cannot drift apart. `conversation(i, facts)` is a
pure function of `i`: the split between training and the held-out check is by index.
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Berlin", "Madrid", "Seoul", "Nairobi", "Quito",
          "Dublin", "Hanoi", "Perth", "Lagos", "Zurich", "Boston", "Delhi", "Rome", "Lisbon", "Austin")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear")
ZONES = ("UTC", "Europe/Paris", "Asia/Tokyo", "America/Lima", "Africa/Cairo", "Australia/Perth",
         "America/New_York", "Asia/Seoul")
NAMES = ("Ada", "Linus", "Grace", "Guido", "Alan", "Barbara", "Ken", "Margaret", "Dennis", "Radia")
NOTES = ("the build is green", "the meeting moved to 3 pm", "lunch is ready", "the tests pass now",
         "the server is back up", "I will be late", "the report is done", "the release is out")
SYSTEMS = ("You are a helpful assistant.", "You are terse.", "Answer in one sentence.",
           "You are a careful coding assistant.", "Be precise.")
GREETINGS = (("Hello!", "Hello! How can I help you today?"),
             ("Hi, who are you?", "I am a small assistant. I can answer questions and use tools."),
             ("Thanks!", "You are welcome."),
             ("Good morning.", "Good morning! What can I do for you?"))


def _fn(name: str, description: str, props: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": list(required)}}}


S = {"type": "string"}
N = {"type": "number"}
TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _fn("get_weather", "Current weather in a city", {"city": S}, ["city"]),
    "search_docs": _fn("search_docs", "Search the Python documentation", {"query": S}, ["query"]),
    "read_file": _fn("read_file", "Read a text file", {"path": S}, ["path"]),
    "run_python": _fn("run_python", "Evaluate a Python expression", {"code": S}, ["code"]),
    "add": _fn("add", "Add two numbers", {"a": N, "b": N}, ["a", "b"]),
    "get_time": _fn("get_time", "Current time in a time zone", {"timezone": S}, ["timezone"]),
    "send_message": _fn("send_message", "Send a short message to a person", {"to": S, "text": S},
                        ["to", "text"]),
}


@dataclass
class Facts:
    """What the stdlib offers the templates: modules with a one-line docstring, files with their
    first lines, short functions with their source. Built once from the corpus's train split."""

    modules: list[tuple[str, str]] = field(default_factory=list)
    files: list[tuple[str, str]] = field(default_factory=list)
    functions: list[tuple[str, str, str]] = field(default_factory=list)

    @classmethod
    def from_sources(cls, paths: Sequence[str], docs: Sequence[str]) -> Facts:
        f = cls()
        for rel, text in zip(paths, docs, strict=True):
            module = rel[:-3].replace("/", ".").removesuffix(".__init__")
            lines = [ln for ln in text.splitlines() if ln.strip()][:3]
            if lines and all(len(ln) <= 80 for ln in lines) and len(f.files) < 400:
                f.files.append((rel, "\n".join(lines)))
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                continue
            doc = ast.get_docstring(tree)
            first = doc.strip().split("\n\n")[0].replace("\n", " ").strip() if doc else ""
            if 12 <= len(first) <= 160 and not module.startswith("_"):
                f.modules.append((module, first))
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                    src = ast.get_source_segment(text, node) or ""
                    if 2 <= src.count("\n") <= 12 and len(src) <= 500:
                        f.functions.append((module, node.name, src))
        if not (f.modules and f.files and f.functions):
            raise ValueError("the corpus gave no modules, files or functions to build chats from")
        return f


def _call(name: str, args: dict[str, Any], idx: int) -> dict[str, Any]:
    return {"id": f"functions.{name}:{idx}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _task(r: random.Random, tool: str, facts: Facts) -> tuple[str, dict[str, Any], str, str]:
    """(user request, call arguments, tool result, final answer) for one use of `tool`."""
    if tool == "get_weather":
        city, cond, temp = r.choice(CITIES), r.choice(CONDITIONS), r.randint(-5, 35)
        ask = r.choice(("What is the weather in {c}?", "Is it raining in {c}?", "Weather for {c}, please.",
                        "How warm is it in {c} today?")).format(c=city)
        return ask, {"city": city}, f"{cond}, {temp} C", f"It is {cond} in {city}, {temp} C."
    if tool == "search_docs":
        module, doc = r.choice(facts.modules)
        ask = r.choice(("Find the documentation for {m}.", "How do I use the {m} module?",
                        "Look up {m} in the docs.")).format(m=module)
        return ask, {"query": module}, doc, f"{module}: {doc}"
    if tool == "read_file":
        path, head = r.choice(facts.files)
        ask = r.choice((
            "Show me the start of {p}.", "Open {p}.", "What is at the top of {p}?")).format(p=path)
        return ask, {"path": path}, head, f"{path} starts with:\n```python\n{head}\n```"
    if tool == "run_python":
        a, b = r.randint(2, 99), r.randint(2, 99)
        op = r.choice("+-*")
        expr = f"{a} {op} {b}"
        value = str(eval(expr))  # noqa: S307 - two generated integers and one operator
        ask = r.choice((
            "Run this: {e}", "What does {e} evaluate to in Python?", "Compute {e}.")).format(e=expr)
        return ask, {"code": expr}, value, f"{expr} = {value}"
    if tool == "add":
        a, b = r.randint(1, 999), r.randint(1, 999)
        ask = r.choice((
            "What is {a} plus {b}?", "Add {a} and {b}.", "Sum {a} and {b} for me.")).format(a=a, b=b)
        return ask, {"a": a, "b": b}, str(a + b), f"{a} + {b} = {a + b}."
    if tool == "get_time":
        zone, hh, mm = r.choice(ZONES), r.randint(0, 23), r.randint(0, 59)
        ask = r.choice((
            "What time is it in {z}?", "Current time in {z}?", "Tell me the time in {z}.")).format(z=zone)
        return ask, {"timezone": zone}, f"{hh:02d}:{mm:02d}", f"It is {hh:02d}:{mm:02d} in {zone}."
    if tool == "send_message":
        name, note = r.choice(NAMES), r.choice(NOTES)
        ask = r.choice((
            "Tell {n} that {t}.", "Send {n} a message: {t}.", "Let {n} know {t}.")).format(n=name, t=note)
        return ask, {"to": name, "text": note}, "sent", f"Done: I told {name} that {note}."
    raise ValueError(tool)


def _thought(r: random.Random, tool: str, args: dict[str, Any]) -> str:
    shown = ", ".join(f"{k} {v}" for k, v in args.items())
    return r.choice(("The user asks something {t} can answer. I call it with {a}.",
                     "I need {t} for this, with {a}.",
                     "{t} gives this directly; arguments: {a}.")).format(t=tool, a=shown)


def _direct(r: random.Random, facts: Facts, tools: list[str]) -> tuple[str, str, str]:
    """(user message, thinking, answer) for a turn that needs no tool."""
    kind = r.randrange(4)
    if kind == 0:
        ask, reply = r.choice(GREETINGS)
        return ask, "A greeting; no tool is needed.", reply
    if kind == 1 or "search_docs" in tools:
        module, name, src = r.choice(facts.functions)
        ask = r.choice(("Write a Python function like {m}.{n}.", "Show me the code of {n} from {m}.",
                        "How is {m}.{n} written?")).format(m=module, n=name)
        return ask, f"I can write {name} from memory.", f"```python\n{src}\n```"
    if kind == 2:
        module, doc = r.choice(facts.modules)
        ask = r.choice(("What does the {m} module do?", "Explain {m} briefly.")).format(m=module)
        return ask, f"I know {module}; no tool is needed.", doc
    module, name, src = r.choice(facts.functions)
    line = src.splitlines()[0].strip()
    return (f"What is the signature of {module}.{name}?", "It is the first line of its definition.",
            f"`{line.removesuffix(':')}`")


def conversation(i: int, facts: Facts) -> dict[str, Any]:
    """The i-th training conversation: an OpenAI chat request body whose last message is the
    assistant's (what the model learns to write)."""
    r = random.Random(f"k3kit-mini-chat:{i}")
    body: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []
    if r.random() < 0.4:
        messages.append({"role": "system", "content": r.choice(SYSTEMS)})
    kwargs: dict[str, Any] = {}
    thinking = r.random() >= 0.15
    if not thinking:
        kwargs["thinking"] = False
    elif r.random() < 0.3:
        kwargs["thinking_effort"] = r.choice(("low", "high"))
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    mode = r.random()
    if mode < 0.1:                                     # JSON answer, no tools
        module, name, _ = r.choice(facts.functions)
        messages.append({"role": "user", "content": f"Give the module and name of {module}.{name} as JSON."})
        answer = json.dumps({"module": module, "name": name})
        body["response_format"] = {"type": "json_object"}
        messages.append({"role": "assistant", "content": answer,
                         "reasoning_content": "Two fields, module and name."})
        body["messages"] = messages
        return body
    if mode < 0.22:                                    # no tools declared: answered directly
        for _ in range(1 + (r.random() < 0.3)):
            ask, think, reply = _direct(r, facts, [])
            messages.append({"role": "user", "content": ask})
            messages.append({"role": "assistant", "content": reply, "reasoning_content": think})
        body["messages"] = messages
        return body
    names = r.sample(sorted(TOOLS), r.randint(2, 4))
    body["tools"] = [TOOLS[n] for n in names]
    turns = 1 + (r.random() < 0.35)
    calls_made = 0
    for turn in range(turns):
        last = turn == turns - 1
        choice = r.random()
        if choice < 0.25:                              # a turn that needs no tool
            ask, think, reply = _direct(r, facts, names)
            if r.random() < 0.3 and last:
                body["tool_choice"] = "none"
            messages.append({"role": "user", "content": ask})
            messages.append({"role": "assistant", "content": reply, "reasoning_content": think})
            continue
        tool = r.choice(names)
        uses = [_task(r, tool, facts)]
        if tool in ("get_weather", "get_time") and r.random() < 0.3:
            uses.append(_task(r, tool, facts))         # two places: two calls in one message
        ask = uses[0][0] if len(uses) == 1 else f"{uses[0][0]} And {uses[1][0][0].lower()}{uses[1][0][1:]}"
        required = last and r.random() < 0.2
        if required:
            body["tool_choice"] = "required"
        messages.append({"role": "user", "content": ask})
        calls = [_call(tool, args, calls_made + k) for k, (_, args, _, _) in enumerate(uses)]
        calls_made += len(calls)
        lead = r.choice(("", "", "Let me check.", "One moment."))
        messages.append({"role": "assistant", "content": lead,
                         "reasoning_content": _thought(r, tool, uses[0][1]), "tool_calls": calls})
        if required:
            break                                      # the forced call is the message to learn
        for call, (_, _, result, _) in zip(calls, uses, strict=True):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if last and r.random() < 0.35:
            break                                      # ends on the results: the answer is another example's
        reply = " ".join(u[3] for u in uses)
        messages.append({"role": "assistant", "content": reply,
                         "reasoning_content": "The tool answered; I report it."})
    body["messages"] = messages
    return body


def render(body: dict[str, Any], template: Any) -> str:
    """The training text of one conversation, as `k3kit serve` would show it to the model.

    A request's `tool_choice` and `response_format` are system messages the template puts after
    the history, right before the generation prompt; so when the last message is the assistant's
    reply, the text is the served prompt for the messages before it followed by that reply, not
    the whole conversation rendered at once (which would put the instruction after the answer).
    """
    from k3kit.serve.api import ChatRequest
    from k3kit.serve.tools import chat_inputs

    inputs = chat_inputs(ChatRequest.model_validate(body), template.source)
    msgs, tools, variables = inputs.messages, inputs.tools, inputs.variables
    plain = {k: v for k, v in variables.items() if k not in ("tool_choice", "response_format")}
    if msgs[-1]["role"] != "assistant":
        return template.render(msgs, add_generation_prompt=False, tools=tools, **plain)
    before = template.render(msgs[:-1], add_generation_prompt=False, tools=tools, **plain)
    whole = template.render(msgs, add_generation_prompt=False, tools=tools, **plain)
    opener = template.render(msgs[:-1], add_generation_prompt=True, tools=tools, **plain)[len(before):]
    reply = whole[len(before):]
    if not whole.startswith(before) or not reply.startswith(opener):
        raise ValueError("the chat template does not render a reply as the generation prompt's continuation")
    prompt = template.render(msgs[:-1], add_generation_prompt=True, tools=tools, **variables)
    return prompt + reply[len(opener):]
