"""The start of a chat conversation's next request, as its client will send it: what the server
prefills while the client is away.

Chat and agent clients send each reply back as an assistant message: its content, its tool calls
and (OpenAI's SDK keeps the fields it does not know) its reasoning_content. A chat template renders
that message as other tokens than the model generated: K3's drops the reasoning of earlier turns
and closes its channels in its own way. So the state the prompt cache keeps at the end of a
request, whose tokens are the generated ones, serves the next turn only up to where the reply
began, and every turn would prefill the reply again before the new message. The tokens the next
request will start with are known when the reply ends: the conversation rendered with the reply
as that message, as far as a rendering that stops there and one that goes on with a further
message agree (`next_turn_ids`; the rendering and the message checks are the chat route's own,
k3kit.serve.tools). The chat route hands them to the scheduler (`Scheduler.prefill_ahead`) once
the response ended; they run while the client is busy (a tool runs, a person reads) and
when no request waits, so the next turn prefills only its new message.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from k3kit.errors import K3Error
from k3kit.serve.api import APIError, ChatMessage, ChatRequest
from k3kit.serve.prompt_cache import common_prefix
from k3kit.serve.scheduler import GenerationRequest, Scheduler
from k3kit.serve.tool_parsers import ChatOutput
from k3kit.serve.tools import chat_inputs
from k3kit.tokenizer.codec import TextCodec

FURTHER = ChatMessage(role="user", content=".")     # any message after the reply (the shared part counts)


def _rendered(codec: TextCodec, body: ChatRequest, messages: list[ChatMessage],
              generation: bool) -> list[int]:
    inputs = chat_inputs(body.model_copy(update={"messages": messages}), codec.chat.source)
    return list(codec.encode(codec.chat.render(inputs.messages, add_generation_prompt=generation,
                                               tools=inputs.tools, **inputs.variables)))


def next_turn_ids(codec: TextCodec, body: ChatRequest, message: dict[str, Any]) -> list[int]:
    """The tokens every next request of `body`'s conversation starts with when the client sends
    `message` (the reply, as the response gave it) back; [] when the template cannot render it."""
    try:
        with_reply = [*body.messages, ChatMessage.model_validate(message)]
        ends = _rendered(codec, body, with_reply, False)
        goes_on = _rendered(codec, body, [*with_reply, FURTHER], True)
    except (K3Error, APIError, ValueError):
        return []
    return ends[:common_prefix(np.asarray(ends, dtype=np.int64), np.asarray(goes_on, dtype=np.int64))]


async def prefill_next_turn(scheduler: Scheduler, codec: TextCodec, body: ChatRequest, gen: GenerationRequest,
                            output: ChatOutput) -> None:
    """After a chat response ended: queue its conversation's next start for prefill. An async
    task, so it renders on the event loop thread (the tokenizer's only thread)."""
    if not output.ended:
        return
    ids = next_turn_ids(codec, body, output.message())
    if len(ids) > len(gen.prompt_ids):
        scheduler.prefill_ahead(ids, gen)
