"""`k3kit serve` with its prompt cache, through the `openai` client: a conversation's later turns
report their restored prompt tokens in `usage.prompt_tokens_details.cached_tokens` and /metrics,
give the tokens a server without the cache gives, and a restart with --prompt-cache-dir finds the
entries the SIGTERM drain wrote."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serving import Server, metrics  # noqa: E402

SYSTEM = "You answer with short Python snippets from the standard library. " * 10


def chat(url: str, turns: list[str]) -> list[tuple[str, int, int]]:
    """Each turn's (reply, prompt tokens, cached tokens), the replies fed back as history."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "system", "content": SYSTEM}]
    out = []
    for user in turns:
        msgs.append({"role": "user", "content": user})
        r = client.chat.completions.create(model="mini-k3", messages=msgs, max_tokens=10, temperature=0)
        reply = r.choices[0].message.content or ""
        details = r.usage.prompt_tokens_details
        out.append((reply, r.usage.prompt_tokens, details.cached_tokens if details else 0))
        msgs.append({"role": "assistant", "content": reply})
    return out


def test_turns_restore_their_history_across_a_restart(tmp_path):
    turns = ["import os", "now read a file", "and print it"]
    plain = Server(["--prompt-cache-mib", "0"]).wait_ready()
    try:
        cold = chat(plain.url, turns)
    finally:
        assert plain.stop() == 0
    assert all(c == 0 for _, _, c in cold)

    first = Server(["--prompt-cache-dir", str(tmp_path)]).wait_ready()
    try:
        warm = chat(first.url, turns)
        page = metrics(first.url, None)
    finally:
        assert first.stop() == 0
    assert [r for r, _, _ in warm] == [r for r, _, _ in cold]
    assert warm[0][2] == 0
    for (_, _, cached), (_, prev_prompt, _) in zip(warm[1:], warm[:-1], strict=False):
        assert cached >= prev_prompt                     # at least the previous turn's whole prompt
    assert page["k3kit_prompt_cache_hits_total"] >= 2
    assert page["k3kit_prompt_cached_tokens_total"] == sum(c for _, _, c in warm)
    assert list(tmp_path.glob("*.k3pc"))                 # the drain flushed the cache
    assert "prompt cache flushed" in first.stderr_text

    again = Server(["--prompt-cache-dir", str(tmp_path)]).wait_ready()
    try:
        after = chat(again.url, turns)
        page = metrics(again.url, None)
    finally:
        assert again.stop() == 0
    assert [r for r, _, _ in after] == [r for r, _, _ in cold]
    assert after[0][2] >= warm[0][1] - 1 and page["k3kit_prompt_cache_disk_hits_total"] >= 1
