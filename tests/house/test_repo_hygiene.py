"""What the tracked files may not hold: how the software was made, and Python modules too long to read.

The repository describes k3kit as it is. Work-period bookkeeping ("session 15", "this turn", "a helper
measured") dates a text to the way it was written and says nothing a reader can use, so it is a failure
wherever it appears: docs, comments, benchmark notes, tests. `Session` alone is the engine's own name for
a loaded target and drafter (`adapters.session.Session`) and is allowed; only a numbered work period or
"this session" counts.

A Python file over `MAX_PY_LINES` lines under src/, tests/ or benchmarks/ is a module holding more than
one thing; split it by what it holds.

A relative link in a tracked Markdown file (and a `figures/NAME.png` that benchmarks/RESULTS.md names)
must lead to a tracked file, and a `#anchor` to a heading of that file: the docs point at one another
and a moved or renamed page must not leave them pointing nowhere.

The checks list every offender in one failure, so one run shows all that is left to fix. They read
`git ls-files`, so an untracked scratch file never fails them; outside a git checkout (an sdist) they skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

MAX_PY_LINES = 700
PY_ROOTS = ("src/", "tests/", "benchmarks/")

# Each pattern with what it catches. Word boundaries keep "return 0" or "Session(" out: "turn" inside
# "return" has no boundary before it, and `Session` needs a number or "this" before it to count.
BOOKKEEPING: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a numbered work period", re.compile(r"\b[Ss]essions? \d+")),
    ("'this session'", re.compile(r"\b[Tt]his session\b")),
    ("'this turn'", re.compile(r"\b[Tt]his turn\b")),
    ("a numbered turn", re.compile(r"\b[Tt]urns? \d+\b")),
    ("who found what", re.compile(r"\b[Hh]elpers? (?:found|said|measured|saw|showed)\b")),
    ("a named helper", re.compile(r"\bhelper[- ](?:[A-Z][0-9]?|[0-9]+)\b")),
)


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the hygiene checks read `git ls-files`")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=True)
    return [p for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def _text(path: str) -> str | None:
    """The file as text, or None for a binary file (a NUL byte, or not UTF-8) or one missing on disk."""
    try:
        with open(ROOT / path, "rb") as f:
            head = f.read(8192)
            if b"\0" in head:      # a GGUF, safetensors, PNG: not read further
                return None
            raw = head + f.read()
    except OSError:   # deleted in the work tree but still in the index
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def bookkeeping_hits(path: str, text: str) -> list[str]:
    """`path:line: what ('the words')` for every bookkeeping phrase in `text`."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in BOOKKEEPING:
            for m in pattern.finditer(line):
                hits.append(f"{path}:{number}: {what} ({m.group(0)!r})")
    return hits


def test_bookkeeping_patterns_catch_what_they_name_and_spare_the_engine_terms():
    # the patterns themselves, so a loosened regex fails here before it lets the repository drift
    caught = ["results of session 15", "Session 14 measured", "sessions 13, 14 and 15", "in this session",
              "This turn's fix", "turn 3 found it", "a helper found", "Helper measured 2x", "(helper H)",
              "helper-4's config", "helper A2's run"]
    spared = ["return 0", "open_session(path)", "Session.close()", "a Session holds target and draft",
              "one user turn of the template", "returns 12 rows", "the shared helpers", "helper function",
              "takes the texts in turn", "session.py"]
    for text in caught:
        assert bookkeeping_hits("x", text), text
    for text in spared:
        assert not bookkeeping_hits("x", text), text


def test_no_tracked_file_holds_work_period_bookkeeping():
    hits: list[str] = []
    for path in _tracked():
        if path == THIS:   # the patterns and their examples live here
            continue
        text = _text(path)
        if text is not None:
            hits += bookkeeping_hits(path, text)
    if hits:
        pytest.fail(f"{len(hits)} line(s) say how the software was made, not what it is "
                    "(describe the software; dates and machine classes are fine):\n" + "\n".join(hits),
                    pytrace=False)


def test_no_tracked_python_file_is_over_the_line_limit():
    long = []
    for path in _tracked():
        if not (path.endswith(".py") and path.startswith(PY_ROOTS)):
            continue
        text = _text(path)
        if text is not None and (n := len(text.splitlines())) > MAX_PY_LINES:
            long.append(f"{path}: {n} lines")
    if long:
        pytest.fail(f"{len(long)} Python file(s) over {MAX_PY_LINES} lines (split each by what it holds):\n"
                    + "\n".join(long), pytrace=False)


LINK = re.compile(r"\]\(([^()\s]+)\)")
FIGURE = re.compile(r"figures/[\w.-]+\.png")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_markdown_links_and_result_figures_resolve():
    tracked = set(_tracked())
    broken = []
    for path in sorted(p for p in tracked if p.endswith(".md")):
        text = _text(path)
        if text is None:
            continue
        base = Path(path).parent
        for number, line in enumerate(text.splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1)
                if "://" in target or target.startswith("mailto:"):
                    continue
                file, _, anchor = target.partition("#")
                dest = (base / file).as_posix() if file else path
                dest = Path(dest).as_posix()
                resolved = (ROOT / dest).resolve()
                try:
                    rel = resolved.relative_to(ROOT).as_posix()
                except ValueError:
                    rel = None
                if rel is None or rel not in tracked:
                    broken.append(f"{path}:{number}: {target} (no tracked file {dest})")
                    continue
                if anchor and rel.endswith(".md"):
                    headings = {_anchor(h.lstrip("#")) for h in (_text(rel) or "").splitlines()
                                if h.startswith("#")}
                    if anchor not in headings:
                        broken.append(f"{path}:{number}: {target} (no heading #{anchor} in {rel})")
    results = "benchmarks/RESULTS.md"
    if results in tracked:
        for number, line in enumerate((_text(results) or "").splitlines(), 1):
            for m in FIGURE.finditer(line):
                if f"benchmarks/{m.group(0)}" not in tracked:
                    broken.append(f"{results}:{number}: {m.group(0)} is not a tracked file")
    if broken:
        pytest.fail(f"{len(broken)} link(s) lead nowhere:\n" + "\n".join(broken), pytrace=False)
