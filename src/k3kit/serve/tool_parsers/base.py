"""What a chat-format parser gives back, and the marker scanning every format shares.

A parser is fed the decoded text of one assistant message as it is generated (in pieces of any
size: a marker may be split over several pieces, or over a UTF-8 character boundary) and returns
`Piece`s in order: reasoning text, content text, the start of a tool call (its index, id and
name), and pieces of a call's arguments (a JSON object, streamed as it is written). `finish`
flushes what was held back (text that could have been the start of a marker) and closes a call
that the generation ended inside, so the arguments are always a complete JSON object.

Feeding the whole text at once and feeding it piece by piece give the same pieces once joined:
a streamed response and a non-streamed one report the same tool calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

PieceKind = Literal["reasoning", "content", "call", "arguments"]


@dataclass(frozen=True)
class Piece:
    kind: PieceKind
    text: str = ""              # reasoning / content / arguments text
    index: int = 0              # the call (0-based, within this message) for "call" and "arguments"
    id: str = ""                # "call": the call's id
    name: str = ""              # "call": the function's name


class OutputParser(Protocol):
    """An incremental parser of one assistant message in one chat format."""

    markers: tuple[str, ...]    # marker texts the parser must see (special tokens rendered as text)

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


def held_prefix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def first_marker(text: str, markers: Iterable[str], start: int = 0) -> tuple[int, str]:
    """(position, marker) of the earliest marker in text[start:], (-1, "") when none."""
    best, found = -1, ""
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best or (i == best and len(m) > len(found))):
            best, found = i, m
    return best, found


def call_id(name: str, n: int) -> str:
    """A call's id: Kimi's `functions.NAME:N`, N counting the calls of the whole conversation."""
    return f"functions.{name}:{n}"
