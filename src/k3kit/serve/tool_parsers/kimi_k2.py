"""Kimi-K2's assistant messages: `<think>` reasoning and the tool-call section, parsed as generated.

    <think>REASONING</think>CONTENT
    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{JSON}<|tool_call_end|> ...
    <|tool_calls_section_end|>

The call's id text names the function (`functions.NAME:N`; a bare `NAME:N` or `NAME` is read
too). The arguments are JSON text and are streamed as they come. As llama.cpp's parser allows,
a call may start without the section marker, and reasoning ends at a call as well as at
`</think>`. Ids given to the client are `functions.NAME:N` with N counting the calls of the
whole conversation (what K2's own template writes).
"""

from __future__ import annotations

from .base import Piece, call_id, first_marker, held_prefix

THINK = "<think>"
THINK_END = "</think>"
SECTION = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL = "<|tool_call_begin|>"
ARGS = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (THINK, THINK_END, SECTION, SECTION_END, CALL, ARGS, CALL_END)


def function_name(id_text: str) -> str:
    name = id_text.strip()
    if name.startswith("functions."):
        name = name[len("functions."):]
    head, sep, tail = name.rpartition(":")
    return head if sep and tail.isdigit() and head else name


class KimiK2Parser:
    markers: tuple[str, ...] = MARKERS

    def __init__(self, *, start: str = "content", call_offset: int = 0) -> None:
        self.mode = start            # think, content, section, id, arguments
        self.call_offset = call_offset
        self.calls = 0
        self._buf = ""
        self._id = ""
        self._wrote_args = False

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        self._scan(out, final=False)
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        self._scan(out, final=True)
        if self.mode == "id":
            self._open_call(out)
        if self.mode == "arguments":
            self._close_call(out)
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self.mode == "think":
            out.append(Piece("reasoning", text))
        elif self.mode == "content":
            out.append(Piece("content", text))
        elif self.mode == "id":
            self._id += text
        elif self.mode == "arguments":
            self._wrote_args = self._wrote_args or bool(text.strip())
            out.append(Piece("arguments", text, index=self.calls - 1))
        elif text.strip():           # stray text in the section: reported, not dropped
            out.append(Piece("content", text))

    def _open_call(self, out: list[Piece]) -> None:
        name = function_name(self._id)
        self.calls += 1
        self._id, self._wrote_args = "", False
        out.append(Piece("call", index=self.calls - 1, id=call_id(name, self.call_offset + self.calls - 1),
                         name=name))
        self.mode = "arguments"

    def _close_call(self, out: list[Piece]) -> None:
        if not self._wrote_args:
            out.append(Piece("arguments", "{}", index=self.calls - 1))
        self.mode = "section"

    def _marker(self, marker: str, out: list[Piece]) -> bool:
        mode = self.mode
        if marker == THINK and mode == "content":
            self.mode = "think"
        elif marker == THINK_END and mode == "think":
            self.mode = "content"
        elif marker == SECTION and mode in ("think", "content"):
            self.mode = "section"
        elif marker == CALL and mode in ("think", "content", "section"):
            self.mode, self._id = "id", ""
        elif marker == ARGS and mode == "id":
            self._open_call(out)
        elif marker == CALL_END and mode == "arguments":
            self._close_call(out)
        elif marker == CALL_END and mode == "id":
            self._open_call(out)
            self._close_call(out)
        elif marker in (CALL, SECTION_END) and mode == "arguments":   # a call left open
            self._close_call(out)
            return self._marker(marker, out)
        elif marker == SECTION_END and mode == "section":
            self.mode = "content"
        else:
            return False
        return True

    def _scan(self, out: list[Piece], final: bool) -> None:
        while self._buf:
            buf = self._buf
            i, marker = first_marker(buf, MARKERS)
            if i < 0:
                keep = 0 if final else held_prefix(buf, MARKERS)
                self._text(buf[:len(buf) - keep], out)
                self._buf = buf[len(buf) - keep:]
                return
            self._text(buf[:i], out)
            if not self._marker(marker, out):
                self._text(marker, out)
            self._buf = buf[i + len(marker):]
