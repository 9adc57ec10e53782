"""Fixtures shared across the test tree."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_thread():
    """Run torch on one thread: results that compare to a peer stay independent of core count."""
    import torch  # here, not at module level: the gguf tests must not pay for torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
