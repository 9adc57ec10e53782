"""Chat prompts rendered from the model file's own `tokenizer.chat_template`, as transformers does.

A GGUF carries its chat format as the Jinja source HF models ship (tokenizer_config.json's
`chat_template`, copied by converters into `tokenizer.chat_template`). It is rendered the way
transformers' `apply_chat_template` renders it, so a prompt built here is the one the model was
trained on:

* environment: `jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`
  with the `loopcontrols` extension and transformers' `{% generation %}` tag (rendered as its body);
  the template comes from a file, so it runs sandboxed: no attribute access to Python internals, no
  mutation of the messages;
* variables: `messages`, `add_generation_prompt`, `tools` and `documents` (None unless given),
  `bos_token`/`eos_token` (the texts of the file's bos/eos tokens, omitted when it has none) and any
  extra variables the caller passes (e.g. a server's `chat_template_kwargs`);
* functions: `raise_exception(msg)` (the template refusing a conversation) and `strftime_now(fmt)`;
  the `tojson` filter is transformers' (json.dumps without HTML escaping, ensure_ascii=False).

A template that does not compile, calls raise_exception, or fails while rendering is a K3Error of
one line naming the file: the template is the file's, not k3kit's.

Files without a template get the built-in Kimi-K2 format (`<|im_user|>user<|im_middle|>...<|im_end|>`,
without K2's default "You are Kimi" system message), which is exactly what llama.cpp's built-in
`kimi-k2` template renders; KIMI_TEMPLATE is the same format as Jinja, which the mini K3 ships.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3kit.errors import K3Error

IM_END = "<|im_end|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"

ROLE_HEADERS = {
    "system": f"{IM_SYSTEM}system{IM_MIDDLE}",
    "user": f"{IM_USER}user{IM_MIDDLE}",
    "assistant": f"{IM_ASSISTANT}assistant{IM_MIDDLE}",
    "tool": f"{IM_SYSTEM}tool{IM_MIDDLE}",
}

KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}" + ROLE_HEADERS["system"] +
    "{%- elif message['role'] == 'user' -%}" + ROLE_HEADERS["user"] +
    "{%- elif message['role'] == 'assistant' -%}" + ROLE_HEADERS["assistant"] +
    "{%- elif message['role'] == 'tool' -%}" + ROLE_HEADERS["tool"] +
    "{%- else -%}{{- raise_exception('unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- message['content'] -}}" + IM_END +
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ROLE_HEADERS["assistant"] + "{%- endif -%}"
)


def render_kimi(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render `messages` exactly as KIMI_TEMPLATE (and llama.cpp's `kimi-k2` built-in) does."""
    parts = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLE_HEADERS:
            raise K3Error(f"chat message {i}: unknown role {role!r} (expected one of {sorted(ROLE_HEADERS)})")
        if not isinstance(content, str):
            raise K3Error(f"chat message {i}: content must be a string, got {type(content).__name__}")
        parts += [ROLE_HEADERS[role], content, IM_END]
    if add_generation_prompt:
        parts.append(ROLE_HEADERS["assistant"])
    return "".join(parts)


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: marks the assistant's text for
    training masks; a prompt only needs the body, so it renders just that."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: object) -> None:
    raise jinja2.TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: Jinja's own escapes <, >, & and ' for HTML, which a prompt must not get."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip()) or "(no message)"


class ChatTemplate:
    """How one model file turns a conversation into prompt text.

    `source` is the file's `tokenizer.chat_template` (None: the built-in Kimi format, which needs
    the Kimi chat tokens in `vocab`). `bos_token`/`eos_token` are passed to the template when given.
    The template is compiled on first use, so a file with a broken template still loads and
    generates from plain prompts.
    """

    def __init__(self, source: str | None, *, where: str = "gguf", vocab: Collection[str] = (),
                 bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self.where = where
        self.vocab = vocab
        self.tokens = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
        self._template: jinja2.Template | None = None

    def _compiled(self) -> jinja2.Template:
        if self._template is None:
            assert self.source is not None
            try:
                self._template = _environment().from_string(self.source)
            except jinja2.TemplateSyntaxError as e:
                raise K3Error(f"{self.where}: tokenizer.chat_template does not compile "
                              f"(line {e.lineno}: {_one_line(e.message or '')})") from None
        return self._template

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]), ending with the
        assistant's header when `add_generation_prompt`. Extra `variables` reach the template."""
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping) for m in messages):
            raise K3Error("chat messages must be a list of {role, content} objects")
        if self.source is None:
            return self._render_builtin(messages, add_generation_prompt, tools, documents, variables)
        template = self._compiled()
        context = {**self.tokens, **variables, "messages": [dict(m) for m in messages],
                   "add_generation_prompt": bool(add_generation_prompt), "tools": tools,
                   "documents": documents}
        try:
            return template.render(**context)
        except jinja2.TemplateError as e:   # raise_exception, undefined, the sandbox refusing
            msg = _one_line(e.message or str(e))
            raise K3Error(f"{self.where}: tokenizer.chat_template: {msg}") from None
        except Exception as e:              # the template's own code failing (1/0, a bad index...)
            raise K3Error(f"{self.where}: tokenizer.chat_template failed: "
                          f"{type(e).__name__}: {_one_line(str(e))}") from None

    def _render_builtin(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                        tools: object, documents: object, variables: Mapping[str, Any]) -> str:
        missing = [t for t in (IM_USER, IM_ASSISTANT, IM_END) if t not in self.vocab]
        if missing:
            raise K3Error(f"{self.where}: has no tokenizer.chat_template, and the built-in Kimi chat format "
                          f"needs {missing[0]}, which the vocab lacks")
        if tools or documents:
            raise K3Error(f"{self.where}: has no tokenizer.chat_template; the built-in Kimi chat format "
                          "renders no tools or documents")
        return render_kimi(messages, add_generation_prompt)
