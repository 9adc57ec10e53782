"""The warm-up run `k3kit generate` makes before the prompt (runtime.engine.warm_up): every expert
read in where all fit the cache, a throwaway generation through the run's own decode step, and
nothing of it left in the run: the same tokens, a fresh sequence, the replay counters at zero; a
model whose experts do not fit is not touched."""

from __future__ import annotations

import json

import pytest
import torch

from k3kit.adapters.session import open_session
from k3kit.cli import main
from k3kit.mini.paths import shipped_draft, shipped_gguf
from k3kit.runtime.engine import WARMUP_ROWS, generate, warm_up
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import make_sampling
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder

PROMPT = "def parse(line):\n    "
TOKENS = 24


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """2 shared cores (tests/conftest.py)."""


def _spec(draft):
    def build(model, sampler):
        return SpeculativeDecoder(model, draft, sampler.sampling, sampler.generator,
                                  schedule=ScheduleConfig(draft_cost=None))
    return build


def _run(session, step=None):
    ids = session.codec.encode(PROMPT)
    with torch.no_grad():
        return generate(session.model, ids, max_tokens=TOKENS, sampling=make_sampling(0.0, seed=0), step=step)


def test_warm_up_reads_every_expert_and_leaves_the_run_as_it_was():
    with open_session(shipped_gguf(), LoadOptions(), draft=shipped_draft()) as cold:
        want_ar, want_spec = _run(cold).token_ids, _run(cold, _spec(cold.draft_model)).token_ids
    with open_session(shipped_gguf(), LoadOptions(), draft=shipped_draft()) as s:
        target = s.model
        store = target.store
        n_experts = sum(store.n_experts(il) for il in store.layers)
        step = _spec(s.draft_model)
        with torch.no_grad():
            assert warm_up(s.model, step=step, token=5)
        st = store.stats()
        assert st.resident_experts == n_experts and st.misses == n_experts      # each read once
        assert s.model.position == 0                                          # a fresh sequence
        assert all(v == 0 for k, v in target.counters().items() if k.startswith("replay_"))
        spec = _run(s, step)
        assert spec.token_ids == want_spec
        assert spec.stats.expert_misses == 0 and spec.stats.payload_bytes == 0
        assert spec.stats.speculative is not None and spec.stats.speculative["draft_steps"] >= 1
        assert _run(s).token_ids == want_ar


def test_no_warm_up_where_the_experts_do_not_fit():
    with open_session(shipped_gguf(), LoadOptions(expert_cache_mib=0.05)) as s:
        with torch.no_grad():
            assert not warm_up(s.model)
        st = s.model.store.stats()
        assert st.misses == 0 and st.bytes_read == 0 and st.resident_experts == 0
        assert s.model.position == 0
    with open_session(shipped_gguf(), LoadOptions()) as s:       # a context shorter than a warm-up
        s.model.context_length = WARMUP_ROWS
        with torch.no_grad():
            assert not warm_up(s.model)
        assert s.model.store.stats().misses == 0


def test_cli_reports_the_warm_up_and_skips_it_when_asked(capsys):
    args = ["generate", "--prompt", PROMPT, "--max-tokens", "8", "--threads", "1", "--json"]
    assert main(args) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["stats"]["warmup_seconds"] > 0 and warm["stats"]["expert_misses"] == 0
    assert main([*args, "--no-warmup"]) == 0
    cold = json.loads(capsys.readouterr().out)
    assert cold["stats"]["warmup_seconds"] is None and cold["stats"]["expert_misses"] > 0
    assert cold["token_ids"] == warm["token_ids"]
    assert main([*args[:-1], "--stats"]) == 0
    assert f"{WARMUP_ROWS} + " in capsys.readouterr().err
