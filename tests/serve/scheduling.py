"""Helpers for the tests that drive a BatchScheduler in process (no HTTP): serve requests together
and collect each one's tokens, and the AR server's tokens for the same requests."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from k3kit.serve.batch import BatchScheduler
from k3kit.serve.scheduler import GenerationRequest, TokenEvent


def serve_together(sched: BatchScheduler, reqs: Sequence[GenerationRequest]) -> list[list[int]]:
    """Submit every request before the worker's next pass (so passes hold the same sequences
    whenever this runs), -> each one's tokens."""
    async def collect(stream: Any) -> list[int]:
        out: list[int] = []
        async for ev in stream:
            if isinstance(ev, TokenEvent):
                out += ev.tokens
        return out

    async def main() -> list[list[int]]:
        with sched._cv:                     # all admitted at the same pass
            streams = [sched.submit(r) for r in reqs]
        return await asyncio.gather(*[collect(s) for s in streams])
    return asyncio.run(main())


def serve_and_close(sched: BatchScheduler, reqs: Sequence[GenerationRequest]) -> tuple[list[list[int]], Any]:
    """serve_together, then the scheduler's stats; the scheduler is closed either way."""
    try:
        return serve_together(sched, reqs), sched.stats()
    finally:
        sched.close()


def ar_tokens(session: Any, reqs: Sequence[GenerationRequest]) -> list[list[int]]:
    """The tokens the AR server (no drafting) gives `reqs` served together on session's model."""
    return serve_and_close(BatchScheduler(session.model, session.codec, max_batch=64, max_queue=16), reqs)[0]
