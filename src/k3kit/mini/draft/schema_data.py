"""Structured-output sequences for the drafter: the target's answers under JSON schemas.

Why: under `response_format: json_schema` the target writes what its grammar-masked logits
pick, JSON it would not write free (its spacing, its strings and numbers), and a drafter that
only saw free text guesses those blocks badly (most accept nothing). So a share of the
training rounds are chat requests rendered as `k3kit serve` renders them (the mini's Kimi-K3
template, the schema in its system message, thinking off) and answered by the frozen target
greedily under the schema's grammar (k3kit.runtime.constraint, llguidance): the labels are the
tokens the masked target picked, which is what a verify pass under the same grammar accepts.

Schemas and asks are drawn at random (property names, types, bounds, nesting, wording) from
pools that leave out `benchmarks/bench_grammar.py`'s schema and asks, so the benchmark measures
schemas the drafter never saw.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from k3kit.models.kimi_k3.model import K3Model
from k3kit.runtime.constraint import Vocabulary, apply_bitmask
from k3kit.tokenizer.codec import TextCodec

NAMES = ("title", "label", "kind", "color", "city", "owner", "author", "count", "size", "price",
         "score", "level", "rank", "year", "age", "width", "height", "depth", "weight", "speed",
         "active", "done", "valid", "public", "items", "words", "flags", "notes", "path", "lang",
         "mode", "state", "code", "key", "value", "total", "limit", "offset", "user", "email",
         "version", "status", "group", "start", "end", "origin", "target", "unit", "step", "ratio")
WORDS = ("red", "blue", "green", "small", "large", "fast", "slow", "alpha", "beta", "main", "test",
         "draft", "open", "closed", "north", "south", "left", "right", "cat", "dog", "tree", "river",
         "stone", "paper", "file", "lamp", "chair", "book", "road", "cloud")
THINGS = ("a book", "a city", "a task", "an order", "a file", "a user", "a color", "a car", "a tree",
          "a server", "a song", "a recipe", "an event", "a planet", "a tool")
ASKS = ("Tell me about {thing} as JSON.", "Write {thing} called {word} in JSON.",
        "Make up {thing}. Answer with JSON only.", "I need {thing} named {word}, JSON please.",
        "Fill in the fields for {thing}.", "Output {thing} with the {name} set to {word}.",
        "Create a JSON object for {thing}.", "What would {thing} look like as data?")


def _leaf(r: random.Random) -> dict[str, Any]:
    kind = r.choice(("string", "string", "integer", "integer", "number", "boolean", "enum", "array"))
    if kind == "string":
        return {"type": "string", "maxLength": r.choice((4, 6, 8, 10, 12, 16, 20))}
    if kind == "integer":
        lo = r.choice((0, 0, 1, -10, -100))
        return {"type": "integer", "minimum": lo, "maximum": lo + r.choice((9, 99, 999, 9999))}
    if kind == "number":
        out: dict[str, Any] = {"type": "number", "minimum": -r.choice((1, 10, 100)),
                               "maximum": r.choice((1, 10, 100))}
        if r.random() < 0.75:
            out["multipleOf"] = r.choice((0.5, 0.25, 0.1))
        return out
    if kind == "boolean":
        return {"type": "boolean"}
    values = r.sample(WORDS, r.randint(2, 4))
    if kind == "enum":
        return {"enum": values}
    items = {"enum": values} if r.random() < 0.6 else {"type": "string", "maxLength": 8}
    return {"type": "array", "items": items, "maxItems": r.randint(1, 4)}


def random_schema(r: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema object of 2-6 properties (leaves, now and then one nested object)."""
    names = r.sample(NAMES, r.randint(2, 6 if depth == 0 else 3))
    props: dict[str, Any] = {}
    for n in names:
        props[n] = random_schema(r, depth + 1) if depth == 0 and r.random() < 0.15 else _leaf(r)
    required = [n for n in names if r.random() < 0.9] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_ask(r: random.Random, schema: dict[str, Any]) -> str:
    return r.choice(ASKS).format(thing=r.choice(THINGS), word=r.choice(WORDS),
                                 name=r.choice(list(schema["properties"])))


def chat_prompt(codec: TextCodec, ask: str, schema: dict[str, Any] | None, name: str = "answer") -> str:
    """The prompt `k3kit serve` renders for a chat request of `ask` under `schema` (json_object
    when None; `name`: the json_schema's), thinking off."""
    from k3kit.serve.api import ChatRequest
    from k3kit.serve.tools import chat_inputs

    fmt: dict[str, Any] = ({"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
                           if schema is not None else {"type": "json_object"})
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": ask}],
                                       "chat_template_kwargs": {"thinking": False}, "response_format": fmt})
    inputs = chat_inputs(body, codec.chat.source)
    return codec.chat.render(inputs.messages, add_generation_prompt=True, tools=inputs.tools,
                             **inputs.variables)


@dataclass
class SchemaSequence:
    ids: list[int]          # prompt then the constrained answer (up to where its grammar ended)
    prompt_len: int
    allowed: Tensor         # [answer tokens, words] int32: the grammar's bitmask each pick was made under


@torch.no_grad()
def constrained_answer(target: K3Model, vocab: Vocabulary, prompt: Sequence[int],
                       schema: dict[str, Any] | None, max_new: int) -> tuple[list[int], Tensor]:
    """The target's greedy answer to `prompt` under the schema's grammar (json_object when None),
    up to where the grammar ends or `max_new` tokens, and the bitmask of each pick."""
    grammar = vocab.json_schema(schema) if schema is not None else vocab.json_object()
    c = grammar.constraint()
    state = target.new_state(1)
    logits = target(torch.tensor([list(prompt)]), state, logits="last").logits[0, -1:].float()
    out: list[int] = []
    masks: list[Tensor] = []
    while len(out) < max_new:
        bits = c.bitmasks()[:1].clone()
        t = int(apply_bitmask(logits, bits)[0].argmax())
        out.append(t)
        masks.append(bits)
        if t in vocab.stop_ids or not c.consume([t]) or c.stopped:
            break
        logits = target(torch.tensor([[t]]), state, logits="last").logits[0, -1:].float()
    return out, torch.cat(masks)


def allowed_rows(bits: Tensor, n_vocab: int) -> Tensor:
    """Bitmasks [..., words] int32 (token t allowed where bit t & 31 of word t >> 5 is set) ->
    bool [..., n_vocab]."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :n_vocab]


def schema_sequences(target: K3Model, codec: TextCodec, vocab: Vocabulary, n: int, max_new: int,
                     seed: int) -> list[SchemaSequence]:
    """n random requests (one in eight json_object, the rest json_schema) and the target's answers."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        schema = random_schema(r) if r.random() >= 0.125 else None
        ask = random_ask(r, schema or {"properties": {"id": {}}})
        prompt = codec.encode(chat_prompt(codec, ask, schema))
        answer, allowed = constrained_answer(target, vocab, prompt, schema, max_new)
        out.append(SchemaSequence(prompt + answer, len(prompt), allowed))
    return out


def pad_rows(rows: Sequence[Tensor], value: float = 0) -> Tensor:
    """Rows [T_i, ...] -> [S, max T_i, ...], the tail of each filled with `value`."""
    T = max(x.shape[0] for x in rows)
    out = rows[0].new_full((len(rows), T, *rows[0].shape[1:]), value)
    for i, x in enumerate(rows):
        out[i, :x.shape[0]] = x
    return out
