"""The prompt cache in the batching scheduler: multi-turn conversations on the shipped mini give the
same tokens with the cache as without it (greedy and seeded sampling, AR and DSpark, one
conversation at a time and twenty together), while later turns restore most of their prompt."""

from __future__ import annotations

import pytest
import torch
from scheduling import serve_and_close, serve_together

from k3kit.runtime.sampling import Sampling
from k3kit.serve.batch import BatchScheduler
from k3kit.serve.prompt_cache import PromptCache, default_interval
from k3kit.serve.scheduler import GenerationRequest

SYSTEM = ("You are a careful Python assistant. Answer with code from the standard library only, "
          "explain nothing, keep every answer short. ") * 6
ASKS = ["import os", "def read_config(path):", "class Cache:", "for line in open(path):",
        "try:\n    import json", "with open(path) as f:", "def main():", "import sys",
        "if __name__ == '__main__':", "def walk(top):"]


def _prompt(codec, messages):
    return codec.encode(codec.chat.render(messages, add_generation_prompt=True))


def _sampling(i: int, sampled: bool) -> Sampling:
    return Sampling(temperature=0.8, top_p=0.95, seed=1000 + i) if sampled else Sampling()


def converse(session, make_sched, n_conv: int, turns: int, *, sampled: bool, together: bool,
             max_tokens: int = 12):
    """Run `n_conv` conversations of `turns` turns; -> (tokens per conversation per turn, the
    cached prompt tokens per turn, the prompt lengths per turn, the scheduler). One scheduler
    serves every turn."""
    codec = session.codec
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASKS[i % len(ASKS)]}]
             for i in range(n_conv)]
    out: list[list[list[int]]] = [[] for _ in range(n_conv)]
    cached: list[list[int]] = []
    lengths: list[list[int]] = []
    sched = make_sched()
    try:
        for t in range(turns):
            reqs = [GenerationRequest(tuple(_prompt(codec, c)), max_tokens, _sampling(i * 10 + t, sampled))
                    for i, c in enumerate(convs)]
            if together:
                got = serve_together(sched, reqs)
            else:
                got = [serve_together(sched, [r])[0] for r in reqs]
            cached.append([sched.last_cached.get(r.id, 0) for r in reqs])
            lengths.append([len(r.prompt_ids) for r in reqs])
            for i, toks in enumerate(got):
                out[i].append(toks)
                kept = [x for x in toks if x not in codec.stop_ids()]
                reply = codec.decode_bytes(kept).decode(errors="replace")
                convs[i] += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": ASKS[(i + t + 1) % len(ASKS)]}]
    finally:
        sched.close()
    return out, cached, lengths, sched


class _Recording(BatchScheduler):
    """A BatchScheduler that remembers each request's cached prompt tokens (from its FinishEvent)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.last_cached: dict[str, int] = {}

    def _retire(self, done):
        for seq in done:
            self.last_cached[seq.request.id] = seq.out.cached_tokens
        super()._retire(done)


def _cache(session, mib: float = 256) -> PromptCache:
    m = session.model
    return PromptCache(int(mib * (1 << 20)), default_interval(m.recurrent_bytes, m.positional_row_bytes))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
def test_ar_cache_changes_no_token(spec_session, sampled, together):
    n = 20 if together else 4
    kw = dict(max_batch=64, max_queue=32)
    model, codec = spec_session.model, spec_session.codec
    model, codec = model, codec
    cold, cold_cached, _, _ = converse(spec_session, lambda: _Recording(model, codec, **kw),
                                       n, 3, sampled=sampled, together=together)
    warm, warm_cached, lengths, sched = converse(
        spec_session, lambda: _Recording(model, codec, prompt_cache=_cache(spec_session), **kw),
        n, 3, sampled=sampled, together=together)
    assert warm == cold
    assert all(c == 0 for turn in cold_cached for c in turn)
    assert all(c == 0 for c in warm_cached[0]) or together is False   # first turn: nothing to reuse yet
    for t in range(1, len(warm_cached)):         # later turns restore at least the previous prompt
        assert all(c >= prev for c, prev in zip(warm_cached[t], lengths[t - 1], strict=True)), \
            (warm_cached[t], lengths[t - 1])
    st = sched.prompt_cache.stats()
    assert st["hits"] >= 2 * n and st["cached_tokens"] == sum(map(sum, warm_cached))


@pytest.mark.parametrize(("sampled", "together"), [(False, True), (True, False)],
                         ids=["greedy-batched", "seeded-alone"])
def test_dspark_cache_changes_no_token(spec_session, spec_factory, sampled, together):
    """Seeded DSpark in shared passes is left out: its proposals come from one draft forward over
    the sequences drafting together, whose last bits depend on who drafts with whom, and the
    speculative draws follow them; a restored sequence starts drafting passes earlier than a cold
    one. That holds without any cache: the first conversation here, seeded, served alone and with
    five others, differs from its sixth token. Greedy tokens do not move (the argmax survives)."""
    kw = dict(max_batch=64, max_queue=32, step_factory=spec_factory)
    model, codec = spec_session.model, spec_session.codec
    n = 6 if together else 3
    model, codec = model, codec
    cold, _, _, _ = converse(spec_session, lambda: _Recording(model, codec, **kw),
                             n, 3, sampled=sampled, together=together)
    warm, cached, lengths, _ = converse(
        spec_session, lambda: _Recording(model, codec, prompt_cache=_cache(spec_session), **kw),
        n, 3, sampled=sampled, together=together)
    assert warm == cold
    for t in range(1, len(cached)):
        assert all(c >= prev for c, prev in zip(cached[t], lengths[t - 1], strict=True)), \
            (cached[t], lengths[t - 1])


def test_resent_prompt_runs_no_row_and_cache_prompt_false_opts_out(spec_session):
    codec, model = spec_session.codec, spec_session.model
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "import os"}]
    prompt = tuple(_prompt(codec, msgs))
    sched = _Recording(model, codec, max_batch=64, prompt_cache=_cache(spec_session))
    a = GenerationRequest(prompt, 8, Sampling())
    b = GenerationRequest(prompt, 8, Sampling())
    c = GenerationRequest(prompt, 8, Sampling(), cache_prompt=False)
    first = serve_together(sched, [a])[0]
    before = sched.stats().prompt_tokens
    second = serve_together(sched, [b])[0]
    assert second == first
    assert sched.last_cached[b.id] == len(prompt)
    assert sched.stats().prompt_tokens == before          # no prompt row ran
    third, _ = serve_and_close(sched, [c])
    assert third[0] == first and sched.last_cached[c.id] == 0


def test_budget_evicts_least_recently_used(spec_session):
    codec, model = spec_session.codec, spec_session.model
    prompts = [tuple(codec.encode(ASKS[i] * 20)) for i in range(4)]
    one = model.positional_row_bytes * len(prompts[0]) + 3 * model.recurrent_bytes
    pc = PromptCache(int(2.5 * one), 256)
    sched = _Recording(model, codec, max_batch=64, prompt_cache=pc)
    try:
        for p in prompts:
            serve_together(sched, [GenerationRequest(p, 2, Sampling())])
    finally:
        sched.close()
    st = pc.stats()
    assert st["evictions"] >= 1 and st["ram_bytes"] <= pc.budget
    assert 1 <= st["entries"] <= 3


def _chunk_ends(start: int, length: int, chunk: int, interval: int) -> list[int]:
    """Where the scheduler's prompt chunks should end: on a point while two intervals or more
    are left, else after `chunk` rows or at the prompt's end."""
    ends, fed = [], start
    while fed < length:
        end = fed + chunk
        if length - fed >= 2 * interval:
            end = min(end, (fed // interval + 1) * interval)
        fed = min(end, length)
        ends.append(fed)
    return ends


def test_points_every_interval_and_a_short_tail_in_one_pass(spec_session, monkeypatch):
    """A long prompt's chunks end on the cache's points; a later request's short new tail after
    its hit runs in one pass (not cut at the point inside it), and gives the cold tokens."""
    codec, model = spec_session.codec, spec_session.model
    interval, chunk = 16, 64
    first = tuple(codec.encode(SYSTEM))
    second = first + tuple(codec.encode(" ".join(ASKS), add_bos=False))[:25]
    assert len(first) > 4 * interval and len(second) - len(first) >= 17
    assert (len(first) // interval + 1) * interval < len(second)       # a point falls inside the tail
    passes: list[list[int]] = []
    for name in ("verify_batch", "forward_batch"):
        orig = getattr(model, name)
        monkeypatch.setattr(model, name, lambda rows, *a, _orig=orig, **kw: (
            passes.append([len(r) for _, r in rows]), _orig(rows, *a, **kw))[1])
    pc = PromptCache(256 << 20, interval)
    sched = _Recording(model, codec, max_batch=chunk, prompt_cache=pc)
    try:
        serve_together(sched, [GenerationRequest(first, 2, Sampling())])
        fed = [0]
        for p in passes:                       # the prompt's passes, then one row per decode step
            if fed[-1] < len(first):
                fed.append(fed[-1] + p[0])
        assert fed[1:] == _chunk_ends(0, len(first), chunk, interval)
        passes.clear()
        req = GenerationRequest(second, 3, Sampling())
        got = serve_together(sched, [req])[0]
    finally:
        sched.close()
    assert sched.last_cached[req.id] == len(first)
    assert passes[0] == [len(second) - len(first)]                      # the whole tail at once
    cold = _Recording(model, codec, max_batch=chunk)
    try:
        assert serve_together(cold, [GenerationRequest(second, 3, Sampling())])[0] == got
    finally:
        cold.close()


def test_warm_up_leaves_no_state_and_changes_no_logit(spec_session):
    """The server's start-up pass runs on a throwaway sequence: none stays open, and a prompt's
    logits after it are the bits they were before it."""
    from k3kit.serve.server import warm_up
    model = spec_session.model
    prompt = list(spec_session.codec.encode(SYSTEM))[:40]

    def logits():
        seq = model.open_sequence()
        try:
            return model.forward_batch([(seq, prompt)])
        finally:
            model.close_sequence(seq)
    before, open_before = logits(), model.sequences
    warm_up(model)
    assert model.sequences == open_before
    assert torch.equal(logits(), before)
