"""Kimi-K3's assistant messages ("XTML"): channels and tool calls, parsed as they are generated.

The format, as K3's chat template writes it (open_tag / close_tag):

    <|open|>message role="assistant"<|sep|>
      <|open|>think<|sep|>REASONING<|close|>think<|sep|>
      <|open|>response<|sep|>CONTENT<|close|>response<|sep|>
      <|open|>tools<|sep|>
        <|open|>call tool="NAME" index="1"<|sep|>
          <|open|>argument key="K" type="string"<|sep|>VALUE<|close|>argument<|sep|> ...
        <|close|>call<|sep|> ...
      <|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>

A call's arguments may also come as one JSON object: `<|open|>json type="object"<|sep|>{...}
<|close|>json<|sep|>`. An argument's `type` attribute (string, number, boolean, null, object,
array) says how VALUE is read: a string is the text itself, anything else is JSON text. Without
the attribute the type comes from the tool's JSON schema (as llama.cpp's parser reads it), else
string. Attribute values escape `&` and `"` as `&amp;` and `&quot;`.

The generation prompt already opens the first channel (`think`, or `response` when thinking is
off), so the parser starts in the channel the prompt ends in; a message that skips a marker (no
`<|close|>think<|sep|>` before `<|open|>response<|sep|>`, or no channel opener at all) is still
read: text before any response opener is reasoning only when the think channel is open.

Streaming: reasoning and content are released as soon as they cannot be part of a marker; a
call is announced (index, id, name) when its opening tag is complete; a string argument's value
is streamed as JSON string text as it comes; any other value is released whole when its argument
closes (it must be checked as JSON first: text that is not valid JSON for its type becomes a JSON
string, so the arguments are always a valid JSON object).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from .base import Piece, call_id, first_marker, held_prefix

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
THINK_OPENER = f"{OPEN}think{SEP}"
RESPONSE_OPENER = f"{OPEN}response{SEP}"
ARG_CLOSER = f"{CLOSE}argument{SEP}"
JSON_CLOSER = f"{CLOSE}json{SEP}"
MAX_TAG = 4096               # a tag whose <|sep|> does not come within this many characters is text

_ATTR = re.compile(r'\s*([A-Za-z_][\w.-]*)="([^"]*)"')


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def parse_tag(tag: str) -> tuple[str, str, dict[str, str]] | None:
    """`<|open|>NAME a="b"<|sep|>` -> ("open", NAME, {a: b}); `<|close|>NAME<|sep|>` -> ("close",
    NAME, {}); None when `tag` is not a well-formed tag."""
    if tag.startswith(OPEN):
        kind, body = "open", tag[len(OPEN):-len(SEP)]
    elif tag.startswith(CLOSE):
        kind, body = "close", tag[len(CLOSE):-len(SEP)]
    else:
        return None
    name, _, rest = body.partition(" ")
    if not name or not re.fullmatch(r"[A-Za-z][\w-]*", name):
        return None
    attrs: dict[str, str] = {}
    pos = 0
    rest = " " + rest if rest else ""
    while pos < len(rest):
        m = _ATTR.match(rest, pos)
        if m is None:
            return None
        attrs[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    if kind == "close" and attrs:
        return None
    return kind, name, attrs


def schema_types(tools: list[Mapping[str, object]] | None) -> dict[str, dict[str, str]]:
    """{tool name: {argument: JSON-schema type}} from OpenAI tool definitions (types that are
    not one plain string are left out)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        types: dict[str, str] = {}
        if isinstance(props, Mapping):
            for key, prop in props.items():
                if isinstance(prop, Mapping) and isinstance(prop.get("type"), str):
                    types[str(key)] = str(prop["type"])
        out[str(fn["name"])] = types
    return out


def _json_value(raw: str, kind: str) -> str:
    """A non-string argument's value as JSON text: the model's JSON when it parses (compacted as
    json.dumps writes it), else the text as a JSON string."""
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower()
        return json.dumps(raw, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


class KimiK3Parser:
    """Incremental parser of one K3 assistant message (see the module docstring)."""

    markers: tuple[str, ...] = MARKERS

    def __init__(self, *, start: str = "think", types: Mapping[str, Mapping[str, str]] | None = None,
                 call_offset: int = 0) -> None:
        if start not in ("think", "response", "message"):
            raise ValueError(f"start channel {start!r}")
        self.mode = start            # think, response, message (before/between channels), tools, call,
        self.types = types or {}     # argument, json, after (the message closed)
        self.call_offset = call_offset
        self.calls = 0
        self._buf = ""
        self._name = ""              # the open call's function name
        self._args = 0               # arguments written in the open call (0: "{" not yet written)
        self._json = False           # the open call's arguments came as a JSON block
        self._arg_type = "string"
        self._arg_raw = ""           # a non-string argument's text, released when it closes

    # --- text routing -------------------------------------------------------------------------

    def _text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self.mode == "think":
            out.append(Piece("reasoning", text))
        elif self.mode in ("tools", "call"):
            if text.strip():         # stray text between calls: not dropped, reported as content
                out.append(Piece("content", text))
        else:
            out.append(Piece("content", text))

    def _arguments(self, text: str, out: list[Piece]) -> None:
        if text:
            out.append(Piece("arguments", text, index=self.calls - 1))

    # --- tags -----------------------------------------------------------------------------------

    def _tag(self, kind: str, name: str, attrs: dict[str, str], out: list[Piece]) -> bool:
        """Apply one tag in the current mode; False when the tag means nothing there (it is text)."""
        mode = self.mode
        if kind == "open" and name == "message" and mode in ("message", "think", "response"):
            return attrs.get("role", "assistant") == "assistant" and not self.calls
        if kind == "open" and name == "think" and mode in ("message", "think"):
            self.mode = "think"
        elif kind == "close" and name == "think" and mode == "think":
            self.mode = "message"
        elif kind == "open" and name == "response" and mode in ("message", "think"):
            self.mode = "response"
        elif kind == "close" and name == "response" and mode == "response":
            self.mode = "message"
        elif kind == "open" and name == "tools" and mode in ("message", "think", "response"):
            self.mode = "tools"
        elif kind == "close" and name == "tools" and mode == "tools":
            self.mode = "message"
        elif kind == "open" and name == "call" and mode == "tools" and attrs.get("tool"):
            self._open_call(attrs["tool"], out)
        elif kind == "close" and name == "call" and mode == "call":
            self._close_call(out)
        elif kind == "open" and name == "argument" and mode == "call" and "key" in attrs and not self._json:
            self._open_argument(attrs, out)
        elif kind == "open" and name == "json" and mode == "call" and not self._args and not self._json:
            self._json = True
            self.mode = "json"
        elif kind == "close" and name == "message" and mode in ("message", "think", "response"):
            self.mode = "after"
        else:
            return False
        return True

    def _open_call(self, name: str, out: list[Piece]) -> None:
        self.calls += 1
        self._name, self._args, self._json = name, 0, False
        self.mode = "call"
        out.append(Piece("call", index=self.calls - 1, id=call_id(name, self.call_offset + self.calls - 1),
                         name=name))

    def _close_call(self, out: list[Piece]) -> None:
        if self._json:
            pass
        elif self._args:
            self._arguments("}", out)
        else:
            self._arguments("{}", out)
        self.mode = "tools"

    def _open_argument(self, attrs: dict[str, str], out: list[Piece]) -> None:
        key = attrs["key"]
        kind = attrs.get("type") or self.types.get(self._name, {}).get(key, "string")
        self._arg_type, self._arg_raw = kind, ""
        lead = ", " if self._args else "{"
        self._args += 1
        quote = '"' if kind == "string" else ""
        self._arguments(f"{lead}{json.dumps(key, ensure_ascii=False)}: {quote}", out)
        self.mode = "argument"

    def _close_argument(self, out: list[Piece]) -> None:
        if self._arg_type == "string":
            self._arguments('"', out)
        else:
            self._arguments(_json_value(self._arg_raw, self._arg_type), out)
        self._arg_raw = ""
        self.mode = "call"

    def _value(self, text: str, out: list[Piece]) -> None:
        if self._arg_type == "string":
            if text:
                self._arguments(json.dumps(text, ensure_ascii=False)[1:-1], out)
        else:
            self._arg_raw += text

    # --- the scanner ----------------------------------------------------------------------------

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        self._scan(out, final=False)
        return out

    def finish(self) -> list[Piece]:
        """Release what was held back and close a call the text ended inside."""
        out: list[Piece] = []
        self._scan(out, final=True)
        if self.mode in ("argument", "json", "call"):
            if self.mode == "argument":
                self._close_argument(out)
            elif self.mode == "json":
                self.mode = "call"
            self._close_call(out)
        return out

    def _scan(self, out: list[Piece], final: bool) -> None:
        while self._buf:
            if self.mode in ("argument", "json"):
                if not self._scan_value(out, final):
                    return
                continue
            buf = self._buf
            i, marker = first_marker(buf, (OPEN, CLOSE, END_OF_MSG))
            if i < 0:
                keep = 0 if final else held_prefix(buf, (OPEN, CLOSE, END_OF_MSG))
                self._text(buf[:len(buf) - keep], out)
                self._buf = buf[len(buf) - keep:]
                return
            self._text(buf[:i], out)
            if marker == END_OF_MSG:
                self._buf = buf[i + len(marker):]
                if self.mode in ("message", "think", "response"):
                    self.mode = "after"
                continue
            j = buf.find(SEP, i + len(marker))
            if j < 0 and not final and len(buf) - i <= MAX_TAG:
                self._buf = buf[i:]          # the tag is not complete yet
                return
            end = j + len(SEP) if j >= 0 else i + len(marker)
            parsed = parse_tag(buf[i:end]) if j >= 0 else None
            if parsed is None or not self._tag(*parsed, out):
                end = i + len(marker) if parsed is None else end
                self._text(buf[i:end], out)
            self._buf = buf[end:]

    def _scan_value(self, out: list[Piece], final: bool) -> bool:
        """Inside an argument's value or a JSON block: everything up to its closer is the value.
        False when the buffer is used up (waiting for more text)."""
        closer = ARG_CLOSER if self.mode == "argument" else JSON_CLOSER
        buf = self._buf
        i = buf.find(closer)
        if i < 0:
            keep = 0 if final else held_prefix(buf, (closer,))
            self._emit_value(buf[:len(buf) - keep], out)
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit_value(buf[:i], out)
        self._buf = buf[i + len(closer):]
        if self.mode == "argument":
            self._close_argument(out)
        else:
            self.mode = "call"
        return True

    def _emit_value(self, text: str, out: list[Piece]) -> None:
        if self.mode == "argument":
            self._value(text, out)
        else:
            self._arguments(text, out)
