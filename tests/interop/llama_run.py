"""Greedy decoding with llama-cpp-python, shared by the interop tests that compare against it."""

from __future__ import annotations

import numpy as np


def llama_greedy(llm, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy continuation of `prompt` (n tokens), from a reset context. With
    `logits_all`, llm.scores[:llm.n_tokens - 1] afterwards holds the rows that predicted them."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out
