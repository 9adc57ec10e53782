"""`n` choices per request through the HTTP API with the real `openai` client, in process: the app
over a batching scheduler on the shipped mini K3. Choice i is the request alone with seed + i (so
greedy choices are the same text and seeded ones differ), streamed choices carry their index and
end with their own finish_reason, usage counts the prompt once and every choice's tokens, and n
outside [1, 8] is a 400 naming `n`. With a prompt cache the prompt runs once: the later choices
restore it whole from the first's state, and the tokens are the same as without the cache."""

from __future__ import annotations

from collections import defaultdict

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402

from k3kit.serve.app import ServerState, build_app  # noqa: E402
from k3kit.serve.batch import BatchScheduler  # noqa: E402
from k3kit.serve.prompt_cache import PromptCache, default_interval  # noqa: E402

ASK = [{"role": "user", "content": "Write a function that reverses a list."}]
PROMPT = "def merge_sorted(a, b):\n"


def _served(session, cache: PromptCache | None, step_factory=None):
    sched = BatchScheduler(session.model, session.codec, loaded=session.target, max_batch=64, max_queue=16,
                           prompt_cache=cache, step_factory=step_factory)
    state = ServerState(model_id="mini")
    state.ready(sched, session.codec, 4096)
    http = TestClient(build_app(state))
    http.__enter__()
    return sched, http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                                      max_retries=0)


@pytest.fixture(scope="module")
def client(spec_session):
    sched, http, c = _served(spec_session, None)
    try:
        yield c
    finally:
        http.__exit__(None, None, None)
        sched.close()


def test_greedy_choices_are_the_single_answer(client):
    one = client.chat.completions.create(model="mini", messages=ASK, max_tokens=24, temperature=0)
    three = client.chat.completions.create(model="mini", messages=ASK, max_tokens=24, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    for c in three.choices:
        assert c.message.content == one.choices[0].message.content
        assert c.finish_reason == one.choices[0].finish_reason
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_seeded_choice_i_is_the_request_with_seed_plus_i(client):
    kw = {"model": "mini", "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0,
          "extra_body": {"draft": False}}
    four = client.completions.create(**kw, n=4, seed=11)
    texts = [c.text for c in four.choices]
    assert len(set(texts)) > 1                    # the choices are draws, not copies
    for i, text in enumerate(texts):
        alone = client.completions.create(**kw, seed=11 + i)
        assert alone.choices[0].text == text
    again = client.completions.create(**kw, n=4, seed=11)
    assert [c.text for c in again.choices] == texts


def test_streamed_choices_equal_the_non_streamed_ones(client):
    kw = {"model": "mini", "messages": ASK, "max_tokens": 20, "temperature": 0.8, "seed": 5}
    whole = client.chat.completions.create(**kw, n=3)
    parts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    roles: list[int] = []
    usage = None
    for ch in client.chat.completions.create(**kw, n=3, stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.role:
                roles.append(c.index)
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert sorted(roles) == [0, 1, 2]
    for c in whole.choices:
        assert parts[c.index] == c.message.content
        assert finishes[c.index] == [c.finish_reason]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_completions_stream_indexes(client):
    chunks = list(client.completions.create(model="mini", prompt=PROMPT, max_tokens=8, temperature=0, n=2,
                                            stream=True))
    texts: dict[int, str] = defaultdict(str)
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    alone = client.completions.create(model="mini", prompt=PROMPT, max_tokens=8, temperature=0)
    assert texts == {0: alone.choices[0].text, 1: alone.choices[0].text}


@pytest.mark.parametrize("n", [0, 9, -1])
def test_n_outside_one_to_eight_is_a_400(client, n):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="mini", prompt=PROMPT, max_tokens=2, n=n)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    # the server goes on serving
    assert client.completions.create(model="mini", prompt=PROMPT, max_tokens=1).choices[0].text is not None


@pytest.mark.parametrize("draft", [False, True], ids=["ar", "dspark"])
def test_with_a_prompt_cache_the_prompt_runs_once(spec_session, spec_factory, client, draft):
    m = spec_session.model
    cache = PromptCache(256 << 20, default_interval(m.recurrent_bytes, m.positional_row_bytes))
    sched, http, cached = _served(spec_session, cache, spec_factory if draft else None)
    try:
        ask = [{"role": "user", "content": "Explain what a context manager does, with an example."}]
        for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 21}):
            before = sched.stats()
            r = cached.chat.completions.create(model="mini", messages=ask, max_tokens=16, n=4, **kw)
            after = sched.stats()
            prompt = r.usage.prompt_tokens
            ran = (after.prompt_tokens - before.prompt_tokens) - (after.prompt_cached_tokens
                                                                  - before.prompt_cached_tokens)
            # the first run of this prompt computes it once; the second, nothing new
            assert ran <= prompt
            assert after.prompt_cached_tokens - before.prompt_cached_tokens >= 3 * prompt
            if draft and kw["temperature"]:
                continue      # seeded DSpark draws differ from AR's (the same distribution, other draws)
            plain = client.chat.completions.create(model="mini", messages=ask, max_tokens=16, n=4, **kw)
            assert [c.message.content for c in r.choices] == [c.message.content for c in plain.choices]
    finally:
        http.__exit__(None, None, None)
        sched.close()
