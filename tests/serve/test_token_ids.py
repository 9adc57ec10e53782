"""vLLM's `return_token_ids` through the HTTP API with the real `openai` client, in process (the app
over a batching scheduler on the shipped mini K3): the prompt's ids and each choice's generated ids
come back, streamed or not, chat or completions; the streamed pieces join into the non-streamed
ids; the ids decode to the text; a request without the field gets none; a non-bool is a 400."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402

from k3kit.serve.app import ServerState, build_app  # noqa: E402
from k3kit.serve.batch import BatchScheduler  # noqa: E402

PROMPT = "def merge_sorted(a, b):\n"
ASK = [{"role": "user", "content": "Write a function that reverses a list."}]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def served(spec_session):
    sched = BatchScheduler(spec_session.model, spec_session.codec, loaded=spec_session.target, max_batch=16,
                           max_queue=8)
    state = ServerState(model_id="mini")
    state.ready(sched, spec_session.codec, 4096)
    http = TestClient(build_app(state))
    http.__enter__()
    try:
        yield spec_session.codec, http, openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                                                      http_client=http, max_retries=0)
    finally:
        http.__exit__(None, None, None)
        sched.close()


def test_completion_ids_streamed_or_not(served):
    codec, _, client = served
    kw = {"model": "mini", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kw, extra_body=IDS).to_dict()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == codec.encode(PROMPT)
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 12
    assert codec.decode_bytes(choice["token_ids"]).decode("utf-8", errors="replace") == choice["text"]

    chunks = [c.to_dict() for c in client.completions.create(**kw, stream=True, extra_body=IDS)]
    firsts = [c for c in chunks if "prompt_token_ids" in c["choices"][0]]
    assert len(firsts) == 1 and firsts[0] is chunks[0]
    assert firsts[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]

    plain = client.completions.create(**kw).to_dict()
    assert plain["choices"][0]["text"] == choice["text"]
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_chat_ids_per_choice(served):
    codec, _, client = served
    kw = {"model": "mini", "messages": ASK, "max_tokens": 10, "temperature": 0, "n": 2}
    whole = client.chat.completions.create(**kw, extra_body=IDS).to_dict()
    prompt = whole["prompt_token_ids"]
    assert len(prompt) == whole["usage"]["prompt_tokens"] and prompt[:1] == codec.encode("", add_bos=True)[:1]
    assert [len(c["token_ids"]) for c in whole["choices"]] == [10, 10]
    assert whole["choices"][0]["token_ids"] == whole["choices"][1]["token_ids"]      # greedy: the same

    got: dict[int, list[int]] = {0: [], 1: []}
    openings = 0
    for c in client.chat.completions.create(**kw, stream=True, extra_body=IDS):
        d = c.to_dict()
        openings += "prompt_token_ids" in d
        assert d.get("prompt_token_ids", prompt) == prompt
        for ch in d["choices"]:
            got[ch["index"]] += ch["token_ids"]
    assert openings == 2                      # each choice's first chunk
    assert got == {i: c["token_ids"] for i, c in enumerate(whole["choices"])}


def test_ids_sent_back_continue_the_same_tokens(served):
    """An agent's way: the ids it got, sent back as the next prompt, continue exactly where the
    first answer stopped (greedy), with no text round trip."""
    codec, _, client = served
    first = client.completions.create(model="mini", prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body=IDS).choices[0].to_dict()
    half = first["prompt_token_ids"] + first["token_ids"][:8]
    rest = client.completions.create(model="mini", prompt=half, max_tokens=8, temperature=0,
                                     extra_body=IDS).choices[0].to_dict()
    assert rest["prompt_token_ids"] == half
    assert rest["token_ids"] == first["token_ids"][8:]


def test_return_token_ids_must_be_a_bool(served):
    _, http, _ = served
    r = http.post("/v1/completions", json={"model": "mini", "prompt": PROMPT, "max_tokens": 2,
                                           "return_token_ids": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids"
