"""`--llama-cpp`: llama.cpp's autoregressive rows on the same GGUF and the same prompts.

Driven through llama-cpp-python (the `interop` extra) exactly as k3kit's own rows are: one
repetition = reset, evaluate the prompt (a `pp` sample), then greedy-decode n_gen tokens one
`eval` at a time (a `tg` sample), after one warm-up run. F32 KV cache (k3kit keeps its MLA
latents in f32 on the CPU), n_batch = k3kit's prefill chunk, and the CPU "extra buffer types"
(AMX/repacked weights) off, as the interop tests run it: this CPU's AMX path crashes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3kit.errors import K3Error


@dataclass
class PeerSamples:
    threads: int
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    n_prompt: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)


@contextlib.contextmanager
def _no_extra_bufts(llama_cpp: Any) -> Iterator[None]:
    original = llama_cpp.llama_cpp.llama_model_default_params

    def params() -> Any:
        p = original()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = original


def run_peer(path: Path, prompts: list[list[int]], n_gen: int, threads: int, n_batch: int,
             tick: Callable[[str], None]) -> PeerSamples:
    try:
        import llama_cpp
    except ImportError:
        raise K3Error("--llama-cpp needs llama-cpp-python (pip install 'k3kit[interop]')") from None
    n_ctx = max(len(p) for p in prompts) + n_gen + 8
    out = PeerSamples(threads)
    with _no_extra_bufts(llama_cpp):
        tick("llama.cpp: loading")
        try:
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                  n_threads=threads, n_threads_batch=threads, type_k=0, type_v=0,
                                  verbose=False)
        except (ValueError, RuntimeError) as e:
            raise K3Error(f"{path}: llama.cpp cannot load it ({str(e).splitlines()[0]})") from None
    try:
        n_vocab = llm.n_vocab()

        def last() -> int:
            """Greedy pick from the last evaluated row (without logits_all, `scores` stays empty)."""
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            return int(np.argmax(row))

        def one(prompt: list[int], n: int) -> tuple[float, float, list[int]]:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            t1 = time.perf_counter()
            toks = [last()]
            for _ in range(n):
                llm.eval([toks[-1]])
                toks.append(last())
            return t1 - t0, time.perf_counter() - t1, toks

        tick("llama.cpp: warm-up")
        one(prompts[0], min(n_gen, 2))
        for i, p in enumerate(prompts):
            tick(f"llama.cpp: prompt {i + 1}/{len(prompts)}")
            pre, dec, toks = one(p, n_gen)
            out.prefill_s.append(pre)
            out.decode_s.append(dec)
            out.n_prompt.append(len(p))
            out.token_ids.append(toks)
    finally:
        llm.close()
    return out
