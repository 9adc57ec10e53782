"""Structured output for `k3kit serve`: a request's output spec (k3kit.serve.api.output_spec) or its
required tool call, compiled by llguidance into the Grammar its sequence follows.

* completions: the spec's grammar applies to the whole completion;
* chat, a template whose output format k3kit knows (k3kit.serve.tool_parsers): the JSON of
  `response_format` / `json_schema` is the answer's content, so the grammar first lets the model
  finish the channel the prompt opened: Kimi-K3 (XTML) allows the think channel's text (when the
  prompt ends in its opener; any text, ended by `<|close|>think<|sep|>`), then opens the response
  channel and takes the JSON; Kimi-K2 allows the text up to `</think>` when the prompt ends in
  `<think>`. With tools declared (tool_choice absent or auto), a K3 answer may call tools instead. A
  `grammar` / `lark_grammar` applies to the whole answer as the model writes it, markers included;
* `tool_choice` "required" or a named function, on a Kimi-K3 template: the answer must be the
  think text (where the prompt opened think), an empty response channel (K3's template writes one
  before every tools block), then the tools block with one call (or, unless
  `parallel_tool_calls` is false, up to MAX_CALLS) of the declared function(s), each argument
  tag's key one of the function's properties (the required ones all present, in the schema's
  order), its `type` attribute the property's JSON type and its value that type's text: a string
  as it is (one of the enum's, when it has one), anything else JSON that follows the property's
  schema (llguidance's `%json`). A function without properties takes any arguments. The call
  grammar takes the place of a `response_format` (which still reaches the template). On a Kimi-K2
  template a required call is left to the template's instruction (no grammar).

The markers (<|open|>, <|sep|>, <|close|>, </think>) are special tokens in the grammar when the
vocabulary has them as such (real K3 files), text otherwise. The grammar ends where the content
or the tools block ends (a JSON answer that may also be calls: its closing tags may follow): the
sequence then stops (reason "stop"; a call: "tool_calls") without the closing tags, which the
output parser does not need.

A grammar llguidance cannot compile is a 400 naming the field it came from, with llguidance's
message on one line. Compiling runs off the event loop (a large schema can take a while); the
vocabulary is built once per codec.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from k3kit.errors import K3Error
from k3kit.runtime.constraint import JSON_OBJECT, JSON_WHITESPACE, Grammar, GrammarError, Vocabulary
from k3kit.serve.api import OutputSpec, bad
from k3kit.serve.tool_parsers import KIMI_K2, KIMI_K3
from k3kit.serve.tool_parsers.kimi_k3 import CLOSE, OPEN, RESPONSE_OPENER, SEP, THINK_OPENER
from k3kit.serve.tools import ChatInputs
from k3kit.tokenizer.codec import TextCodec

MAX_CALLS = 8                # tool calls one constrained answer may hold (parallel_tool_calls)
_TYPE_ATTR = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
              "null": "null", "object": "object", "array": "array"}

_vocabs: weakref.WeakKeyDictionary[TextCodec, Vocabulary] = weakref.WeakKeyDictionary()
_vocab_lock = threading.Lock()


def vocabulary(codec: TextCodec) -> Vocabulary:
    """The codec's vocabulary as llguidance sees it (built once, then shared)."""
    with _vocab_lock:
        v = _vocabs.get(codec)
        if v is None:
            v = _vocabs[codec] = Vocabulary(codec.tokenizer.to_str(), codec.n_vocab, codec.stop_ids())
        return v


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json_schema(schema: Mapping[str, Any] | bool) -> str:
    """`%json {...}` for a schema, with the bounded whitespace JSON schemas compile with."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    body = dict(schema)
    body["x-guidance"] = {**dict(body.get("x-guidance") or {}), "whitespace_pattern": JSON_WHITESPACE}
    return "%json " + json.dumps(body, ensure_ascii=False)


class _Lark:
    """Builds a Lark grammar over one vocabulary: markers as special tokens where it has them."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.rules: list[str] = []
        self._n = 0
        self._special: dict[str, bool] = {}

    def special(self, marker: str) -> bool:
        if not (marker.startswith("<") and marker.endswith(">")):
            return False
        if marker not in self._special:
            self._special[marker] = self.vocab.special(marker)
        return self._special[marker]

    def seq(self, *pieces: str) -> str:
        """Pieces of output text (markers among them) as a Lark expansion: special markers as
        `<|name|>`, runs of text merged into one literal."""
        out: list[str] = []
        run = ""
        for p in pieces:
            if self.special(p):
                if run:
                    out.append(_lit(run))
                    run = ""
                out.append(p)
            else:
                run += p
        if run:
            out.append(_lit(run))
        return " ".join(out)

    def rule(self, body: str, prefix: str = "r", options: str = "") -> str:
        self._n += 1
        name = f"{prefix}_{self._n}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def text_until(self, *closer: str) -> str:
        """Any text, then `closer`: a special token ends the text where it comes (no text holds
        one); a text closer ends it at its first occurrence (a lazy lexeme)."""
        if self.special(closer[0]):
            return f"/(?s:.*)/ {self.seq(*closer)}"
        return self.rule("/(?s:.*)" + re.escape("".join(closer)).replace("/", "\\/") + "/", "text", "[lazy]")

    def grammar(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.rules]) + "\n"


def _k3_head(lark: _Lark, prompt: str) -> str:
    """What comes before the answer's content in K3's format, after the prompt's channel opener:
    the think text and its closer (when the prompt opened think; optional when it opened none)."""
    tail = prompt.rstrip(" \n")
    if tail.endswith(THINK_OPENER):
        return lark.text_until(CLOSE, "think", SEP)
    if tail.endswith(RESPONSE_OPENER):
        return ""
    think = lark.rule(f"{lark.seq(OPEN, 'think', SEP)} {lark.text_until(CLOSE, 'think', SEP)}")
    return f"{think}?"


def _content(lark: _Lark, fmt: str | None, prompt: str, value: str) -> str:
    """The answer's content `value` (a Lark expansion), after what the format puts before it."""
    tail = prompt.rstrip(" \n")
    if fmt == KIMI_K3:
        head = _k3_head(lark, prompt)
        opener = "" if tail.endswith(RESPONSE_OPENER) else lark.seq(OPEN, "response", SEP)
        return " ".join(p for p in (head, opener, value) if p)
    if fmt == KIMI_K2 and tail.endswith("<think>"):
        return f"{lark.text_until('</think>')} {value}"
    return value


# --- K3 tool calls ---------------------------------------------------------------------------------

def q(value: str) -> str:
    """An attribute value in double quotes."""
    return f'"{value}"'


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _value(lark: _Lark, schema: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(type attribute, value expansion ending with the argument's closer) for one property."""
    closer = (CLOSE, "argument", SEP)
    typ = schema.get("type")
    if typ == "string":
        choices = schema.get("enum") if "const" not in schema else [schema["const"]]
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            alts = " | ".join(_lit(c) for c in choices)
            return [("string", f"({alts}) {lark.seq(*closer)}")]
        return [("string", lark.text_until(*closer))]
    if isinstance(typ, str) and typ in _TYPE_ATTR:
        return [(_TYPE_ATTR[typ], f"{_json_schema(schema)} {lark.seq(*closer)}")]
    # no single type: a string as text, or any other JSON the schema allows
    json_value = lark.rule(_json_schema(schema), "json")
    return [("string", lark.text_until(*closer))] + [
        (t, f"{json_value} {lark.seq(*closer)}") for t in ("number", "boolean", "null", "object", "array")]


def _argument(lark: _Lark, key: str | None, schema: Mapping[str, Any]) -> str:
    """One argument tag (key None: any key) as a rule."""
    alts = []
    for attr, value in _value(lark, schema):
        if key is None:
            any_key = '/"[A-Za-z0-9_.-]{1,64}"/'
            head = f'{lark.seq(OPEN, "argument key=")} {any_key} {lark.seq(f" type={q(attr)}", SEP)}'
        else:
            head = lark.seq(OPEN, f"argument key={q(_attr(key))} type={q(attr)}", SEP)
        alts.append(f"{head} {value}")
    return lark.rule(" | ".join(alts), "arg")


def _arguments(lark: _Lark, parameters: Mapping[str, Any]) -> str:
    """A call's argument tags for a function's parameters schema (an expansion, may be empty)."""
    props = parameters.get("properties")
    if not isinstance(props, Mapping) or not props:
        if parameters.get("additionalProperties") is False:
            return ""
        return f"{_argument(lark, None, {})}*"
    required = parameters.get("required")
    needed = set(required) if isinstance(required, list) else set()
    parts = []
    for key, schema in props.items():
        rule = _argument(lark, str(key), schema if isinstance(schema, Mapping) else {})
        parts.append(rule if key in needed else f"{rule}?")
    return " ".join(parts)


def _calls(lark: _Lark, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """The tools block: one call, or 1..MAX_CALLS with `parallel`, indexes counted from 1."""
    bodies = {}
    for tool in tools:
        fn = tool["function"]
        args = _arguments(lark, fn.get("parameters") or {})
        bodies[fn["name"]] = lark.rule(f"{args} {lark.seq(CLOSE, 'call', SEP)}".strip(), "call_body")
    calls = []
    for i in range(1, (MAX_CALLS if parallel else 1) + 1):
        alts = " | ".join(f"{lark.seq(OPEN, f'call tool={q(name)} index={q(str(i))}', SEP)} {body}"
                          for name, body in bodies.items())
        calls.append(lark.rule(alts, f"call{i}"))
    chain = calls[-1]
    for c in reversed(calls[:-1]):
        chain = f"{c} ({chain})?"
    return f"{lark.seq(OPEN, 'tools', SEP)} {chain} {lark.seq(CLOSE, 'tools', SEP)}"


def _tools_answer(lark: _Lark, inputs: ChatInputs, prompt: str, parallel: bool) -> str:
    """Think text (as the prompt allows it), the response channel left empty (K3's template writes
    it before every tools block; a required call answers with calls, not prose), then the tools
    block."""
    tail = prompt.rstrip(" \n")
    block = _calls(lark, inputs.tools or [], parallel)
    if tail.endswith(RESPONSE_OPENER):
        return f"{lark.seq(CLOSE, 'response', SEP)} {block}"
    response = lark.rule(lark.seq(OPEN, "response", SEP, CLOSE, "response", SEP))
    return " ".join(p for p in (_k3_head(lark, prompt), f"{response}?", block) if p)


# --- requests ---------------------------------------------------------------------------------------

def _compile(vocab: Vocabulary, spec: OutputSpec | None, chat: ChatInputs | None, prompt: str,
             parallel: bool) -> Grammar | None:
    fmt = chat.format if chat is not None else None
    if chat is not None and chat.required and fmt == KIMI_K3:
        lark = _Lark(vocab)
        answer = _tools_answer(lark, chat, prompt, parallel)
        try:
            return vocab.lark(lark.grammar(answer))
        except GrammarError as e:
            raise bad(f"the tool call grammar of these tools does not compile: {e}", "tools") from None
    if spec is None:
        return None
    try:
        if spec.kind in ("gbnf", "lark") or fmt is None:
            if spec.kind == "gbnf":
                return vocab.gbnf(str(spec.source))
            if spec.kind == "lark":
                return vocab.lark(str(spec.source))
            return vocab.json_schema(JSON_OBJECT if spec.kind == "json_object" else spec.source)
        lark = _Lark(vocab)
        value = lark.rule(_json_schema(JSON_OBJECT if spec.kind == "json_object" else spec.source), "json")
        if fmt == KIMI_K3 and chat is not None and chat.tools and chat.tool_choice != "none":
            # tool_choice auto: the JSON answer (its closing tags may follow), or tool calls
            close = lark.seq(CLOSE, "response", SEP)
            value = f"{value} ({close} {lark.seq(CLOSE, 'message', SEP)}?)?"
            start = f"{_content(lark, fmt, prompt, value)} | {_tools_answer(lark, chat, prompt, parallel)}"
        else:
            start = _content(lark, fmt, prompt, value)
        return vocab.lark(lark.grammar(start))
    except GrammarError as e:
        raise bad(f"{spec.param}: {e}", spec.param) from None


async def request_grammar(codec: TextCodec, spec: OutputSpec | None, *, chat: ChatInputs | None = None,
                          prompt: str = "", parallel_tool_calls: bool | None = None) -> Grammar | None:
    """The Grammar a request's output follows (None: free text), compiled off the event loop;
    APIError 400 naming the field when it does not compile."""
    required = chat is not None and chat.required and chat.format == KIMI_K3
    if spec is None and not required:
        return None

    def build() -> Grammar | None:
        try:
            vocab = vocabulary(codec)
        except K3Error as e:
            raise bad(str(e), spec.param if spec is not None else "tool_choice") from None
        return _compile(vocab, spec, chat, prompt, parallel_tool_calls is not False)

    return await asyncio.to_thread(build)
