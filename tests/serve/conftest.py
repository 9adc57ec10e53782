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
