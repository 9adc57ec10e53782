"""The OpenAI request bodies `k3kit serve` accepts, and their checks.

Bodies are parsed by pydantic in STRICT mode: a field of the wrong JSON type is an error (no
"5" for 5, no true for 1), which the app answers with HTTP 400 in OpenAI's error shape
(FastAPI's default would be 422). Unknown fields are ignored, as OpenAI-compatible servers do:
clients send `user`, `metadata`, `store`... Fields k3kit cannot honour are refused when they ask
for something (several prompts in one request, the legacy `functions`, echo) rather than silently
ignored; `n` (1-8 choices) is served as sibling sequences (k3kit.serve.responses); tools, tool
calls in the history and the chat template's switches are checked by k3kit.serve.tools. Sampling
fields: OpenAI's `temperature`, `top_p`, `seed`, `presence_penalty` and `frequency_penalty`
([-2, 2], over the tokens generated so far), `logit_bias` ({"token id": bias in [-100, 100]},
added to the logits), and vLLM's `top_k`, `min_p` ([0, 1]) and `repetition_penalty` (> 0, 1 = off;
over the prompt and the generated tokens): k3kit.runtime.sampling says how each applies. One
field is k3kit's own: `draft: false` asks for no speculative decoding (the server's `--draft`
stays unused for that request); two are llama-server's: `cache_prompt` (default true; false: the
scheduler's prompt cache neither serves nor keeps this prompt) and `ignore_eos` (vLLM's too: the
model's end tokens get a -100 logit bias, so the output runs on); one is vLLM's: `return_token_ids`
(the prompt's and the output's token ids in the response). Structured output, on both routes:
OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict"}}; llama-server's {"type": "json_object", "schema": ...} too),
llama-server's `json_schema` (a schema) and `grammar` (GBNF), and k3kit's `lark_grammar`
(llguidance's Lark): at most one per request, its shape checked here (`output_spec`), compiled by
k3kit.serve.grammar. Values are then checked here (`APIError`, 400, with the offending `param`), and
`generation_request` builds the scheduler's GenerationRequest, checking the context length.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from k3kit.runtime.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, make_sampling
from k3kit.serve.scheduler import GenerationRequest, next_request_id

MAX_STOP = 16                # stop strings per request
MAX_TOP_LOGPROBS = 20        # chat top_logprobs (OpenAI's limit)
MAX_LEGACY_LOGPROBS = 5      # completions logprobs (OpenAI's limit)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None          # assistant: checked by k3kit.serve.tools
    tool_call_id: str | None = None              # tool: the call it answers
    reasoning_content: str | None = None         # assistant: its reasoning (vLLM's / llama-server's)
    reasoning: str | None = None


class _Sampled(_Body):
    """Fields shared by chat and completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None     # vLLM's and llama-server's extension
    min_p: float | None = None                  # vLLM's and llama-server's extension
    logit_bias: dict[str, float] | None = None
    # k3kit's extension: false serves the request without the server's draft (--draft), as the
    # server without one would; absent or true lets the scheduler speculate where it pays
    draft: bool | None = None
    # llama-server's: false keeps this request out of the prompt cache (neither reused nor stored)
    cache_prompt: bool | None = None
    # llama-server's and vLLM's: true never ends the output at the model's end tokens (their
    # logits get the lowest logit_bias, -100), so it runs to max_tokens, a stop string or a grammar's end
    ignore_eos: bool | None = None
    # vLLM's: true adds the prompt's token ids and each choice's generated ids to the response (in a
    # stream, the prompt's in the first chunk and each chunk's own), so an agent can send back the
    # exact ids it got instead of text that may tokenize differently
    return_token_ids: bool | None = None
    # structured output (output_spec): OpenAI's response_format, llama-server's json_schema and
    # grammar (GBNF), k3kit's lark_grammar (llguidance's Lark)
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    lark_grammar: str | None = None


class ChatRequest(_Sampled):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None    # vLLM's and llama-server's: template variables
    reasoning_effort: str | None = None
    functions: list[Any] | None = None          # legacy: refused (k3kit.serve.tools)
    function_call: Any = None                   # legacy: refused


class CompletionRequest(_Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]


Kind = Literal["chat", "completion"]


_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class OutputSpec:
    """What a request's output must be: `kind` json_schema (`source` the schema), json_object, gbnf
    or lark (`source` the text); `param` names the field a compile error is reported against."""

    kind: Literal["json_schema", "json_object", "gbnf", "lark"]
    source: Any
    param: str


def _schema(value: object, param: str) -> dict[str, Any] | bool:
    if not isinstance(value, dict | bool):
        raise bad(f"{param} must be a JSON schema (an object)", param)
    return value


def _grammar_text(text: str, param: str) -> str:
    if not text.strip():
        raise bad(f"{param} must not be empty", param)
    return text


def _response_format(rf: dict[str, Any]) -> OutputSpec | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        if rf.get("schema") is not None:         # llama-server's schema-constrained json_object
            return OutputSpec("json_schema", _schema(rf["schema"], "response_format.schema"),
                              "response_format.schema")
        return OutputSpec("json_object", None, "response_format")
    if kind != "json_schema":
        raise bad(f"response_format.type {kind!r} is not one of text, json_object, json_schema",
                  "response_format.type")
    js = rf.get("json_schema")
    if js is None and rf.get("schema") is not None:     # llama-server's shorthand
        return OutputSpec("json_schema", _schema(rf["schema"], "response_format.schema"),
                          "response_format.schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema must be an object: {\"name\", \"schema\", \"strict\"}",
                  "response_format.json_schema")
    name = js.get("name")
    if name is not None and (not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name)):
        raise bad("response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                  "response_format.json_schema.name")
    if not isinstance(js.get("strict", False), bool | None):
        raise bad("response_format.json_schema.strict must be true or false",
                  "response_format.json_schema.strict")
    if "schema" not in js:
        raise bad("response_format.json_schema.schema is required", "response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    return OutputSpec("json_schema", _schema(js["schema"], param), param)


def output_spec(body: _Sampled) -> OutputSpec | None:
    """The request's structured-output field, checked for shape (None: free text); 400 naming the
    field for a malformed one or for more than one."""
    specs: list[OutputSpec] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            specs.append(spec)
    if body.json_schema is not None:
        specs.append(OutputSpec("json_schema", _schema(body.json_schema, "json_schema"), "json_schema"))
    if body.grammar is not None:
        specs.append(OutputSpec("gbnf", _grammar_text(body.grammar, "grammar"), "grammar"))
    if body.lark_grammar is not None:
        specs.append(OutputSpec("lark", _grammar_text(body.lark_grammar, "lark_grammar"), "lark_grammar"))
    if len(specs) > 1:
        raise bad(f"{specs[0].param.split('.')[0]} and {specs[1].param.split('.')[0]}: a request takes one "
                  "of response_format, json_schema, grammar, lark_grammar", specs[1].param.split(".")[0])
    return specs[0] if specs else None


def _unsupported(body: _Sampled) -> None:
    output_spec(body)
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise bad("echo is not supported by k3kit", "echo")
        if body.best_of not in (None, 1):
            raise bad("best_of must be 1", "best_of")
        if body.suffix:
            raise bad("suffix is not supported by k3kit", "suffix")


def message_text(m: ChatMessage, i: int) -> str:
    """A message's text content (text parts joined); 400 for an unknown role or a non-text part."""
    if m.role not in ("system", "developer", "user", "assistant", "tool"):
        raise bad(f"messages[{i}].role {m.role!r} is not one of system, developer, user, assistant, tool",
                  f"messages[{i}].role")
    if isinstance(m.content, list):
        parts = []
        for j, p in enumerate(m.content):
            if p.type != "text" or p.text is None:
                raise bad(f"messages[{i}].content[{j}]: only text parts are supported",
                          f"messages[{i}].content[{j}]")
            parts.append(p.text)
        return "".join(parts)
    return m.content or ""


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions request: text, or token ids."""
    p = body.prompt
    if isinstance(p, str):
        return p
    if not p:
        raise bad("prompt must not be empty", "prompt")
    ids = [x for x in p if isinstance(x, int)]
    if len(ids) == len(p):
        return ids
    if len(p) != 1:
        raise bad("one prompt per request (a list of several prompts is n > 1)", "prompt")
    first = p[0]
    if isinstance(first, str):
        return first
    assert isinstance(first, list)
    return [int(x) for x in first]


def _check_sampling(body: _Sampled) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise bad(f"n = {body.n} is not in [1, {MAX_CHOICES}]", "n")
    t = body.temperature
    if t is not None and not 0.0 <= t <= 2.0:
        raise bad(f"temperature {t} is not in [0, 2]", "temperature")
    if body.top_p is not None and not 0.0 < body.top_p <= 1.0:
        raise bad(f"top_p {body.top_p} is not in (0, 1]", "top_p")
    if body.top_k is not None and body.top_k < 0:
        raise bad(f"top_k {body.top_k} must be >= 0 (0 = off)", "top_k")
    if body.seed is not None and not 0 <= body.seed < (1 << 63):
        raise bad(f"seed {body.seed} is not in [0, 2**63)", "seed")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise bad(f"{name} {value} is not in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", name)
    r = body.repetition_penalty
    if r is not None and not 0 < r < float("inf"):
        raise bad(f"repetition_penalty {r} must be > 0 (1 = off)", "repetition_penalty")
    if body.min_p is not None and not 0.0 <= body.min_p <= 1.0:
        raise bad(f"min_p {body.min_p} is not in [0, 1]", "min_p")
    _logit_bias(body)


def _end_bias(body: _Sampled, bias: dict[int, float], end_ids: Iterable[int]) -> dict[int, float]:
    """`ignore_eos`: the end tokens at the lowest bias (llama-server masks them), over any asked."""
    if not body.ignore_eos:
        return bias
    return bias | {int(t): -MAX_LOGIT_BIAS for t in end_ids}


def _logit_bias(body: _Sampled, n_vocab: int | None = None) -> dict[int, float]:
    """{token id: bias}; 400 naming logit_bias for a key that is not a token id (of the vocabulary,
    when `n_vocab` is given) or a bias outside [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        k = key.strip()
        if not k.isascii() or not k.isdigit():
            raise bad(f"logit_bias key {key!r} is not a token id", "logit_bias")
        token = int(k)
        if n_vocab is not None and token >= n_vocab:
            raise bad(f"logit_bias token {token} is not in the vocabulary [0, {n_vocab})", "logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad(f"logit_bias {key}: {value} is not in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                      "logit_bias")
        if token in out:
            raise bad(f"logit_bias names token {token} twice", "logit_bias")
        out[token] = float(value)
    return out


def _stops(body: _Sampled) -> tuple[str, ...]:
    stop = body.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise bad(f"at most {MAX_STOP} stop strings", "stop")
    if any(not s for s in stops):
        raise bad("stop strings must not be empty", "stop")
    return tuple(stops)


def _max_tokens(body: _Sampled) -> tuple[int | None, str]:
    value, param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        value, param = body.max_completion_tokens, "max_completion_tokens"
    if value is not None and value < 1:
        raise bad(f"{param} {value} must be >= 1", param)
    return value, param


def _logprobs(body: _Sampled) -> int | None:
    if isinstance(body, ChatRequest):
        if body.top_logprobs is not None:
            if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad(f"top_logprobs {body.top_logprobs} is not in [0, {MAX_TOP_LOGPROBS}]",
                          "top_logprobs")
            if not body.logprobs:
                raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if isinstance(body, CompletionRequest) and body.logprobs is not None:
        if not 0 <= body.logprobs <= MAX_LEGACY_LOGPROBS:
            raise bad(f"logprobs {body.logprobs} is not in [0, {MAX_LEGACY_LOGPROBS}]", "logprobs")
        return body.logprobs
    return None


def check_body(body: _Sampled) -> None:
    """Every value check that needs no model (run before the prompt is rendered/tokenized)."""
    _unsupported(body)
    _check_sampling(body)
    _stops(body)
    _max_tokens(body)
    _logprobs(body)


def generation_request(body: _Sampled, prompt_ids: list[int], context_length: int,
                       n_vocab: int | None = None, end_ids: Iterable[int] = ()) -> GenerationRequest:
    """The scheduler's request; 400 context_length_exceeded when prompt + max_tokens does not fit,
    400 logit_bias for a token id outside the vocabulary (`n_vocab`: its size; None: unchecked).
    `end_ids`: the model's end tokens, biased by -100 when the body asks to `ignore_eos`."""
    check_body(body)
    prompt_param = "messages" if isinstance(body, ChatRequest) else "prompt"
    if not prompt_ids:
        raise bad("the prompt encodes to no tokens", prompt_param)
    max_tokens, param = _max_tokens(body)
    n = len(prompt_ids)
    if max_tokens is None:
        if n >= context_length:
            raise bad(f"the prompt has {n} tokens; the context holds {context_length}", prompt_param,
                      "context_length_exceeded")
        max_tokens = context_length - n
    elif n + max_tokens > context_length:
        raise bad(f"the prompt has {n} tokens and {param} is {max_tokens}: {n + max_tokens} > the "
                  f"context of {context_length} tokens", param, "context_length_exceeded")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    sampling = make_sampling(temperature, 1.0 if body.top_p is None else float(body.top_p),
                             body.top_k or 0, seed, min_p=body.min_p or 0.0,
                             presence_penalty=body.presence_penalty or 0.0,
                             frequency_penalty=body.frequency_penalty or 0.0,
                             repetition_penalty=1.0 if body.repetition_penalty is None
                             else float(body.repetition_penalty),
                             logit_bias=_end_bias(body, _logit_bias(body, n_vocab), end_ids))
    return GenerationRequest(prompt_ids=tuple(prompt_ids), max_tokens=max_tokens, sampling=sampling,
                             stop=_stops(body), logprobs=_logprobs(body), draft=body.draft is not False,
                             cache_prompt=body.cache_prompt is not False)


MAX_CHOICES = 8     # n: choices of one request, run together as sibling sequences


def siblings(gen: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The `n` choices of one request: `gen` and n - 1 copies under new ids, copy i drawing with seed
    + i (mod 2**63), so seeded choices differ from each other and repeat from request to request
    (greedy choices are the same text, as vLLM's are)."""
    seed = gen.sampling.seed
    return [gen] + [replace(gen, id=next_request_id(),
                            sampling=replace(gen.sampling, seed=(seed + i) % (1 << 63)))
                    for i in range(1, n)]
