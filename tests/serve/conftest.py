"""Fixtures shared by the server tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def spec_session():
    from k3kit.adapters.session import open_session
    from k3kit.mini.paths import shipped_draft, shipped_gguf
    from k3kit.runtime.loader import LoadOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    session = open_session(shipped_gguf(), LoadOptions(), draft=shipped_draft())
    yield session
    session.close()
    torch.set_num_threads(threads)


@pytest.fixture
def spec_factory(spec_session):
    """A BatchScheduler step_factory: each sequence's SpeculativeDecoder over the shipped drafter
    (verification budget 4, no fitted draft cost)."""
    from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder

    def build(target, sampler):
        return SpeculativeDecoder(target, spec_session.draft_model, sampler.sampling, sampler.generator,
                                  schedule=ScheduleConfig(budget=4, draft_cost=None),
                                  stop_ids=spec_session.codec.stop_ids(), history=sampler.history,
                                  constraint=sampler.constraint)
    return build
