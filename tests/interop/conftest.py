"""Shared set-up for tests that run llama.cpp (through llama-cpp-python) as the external peer.

Weight repacking into llama.cpp's "extra" buffer types is switched off for every test here: on
CPUs that advertise AMX (this workplace's Xeons do), llama.cpp places Q8_0 weights in the AMX
buffer and then aborts (GGML_ASSERT cur_backend_id != -1) or dies with SIGILL in the AMX
kernels for any kimi-k3 file, whatever k3kit wrote. The numbers are the CPU backend's either way.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def no_extra_bufts():
    """Session-wide, so module- and session-scoped fixtures that create a Llama are covered too."""
    llama_cpp = pytest.importorskip("llama_cpp")
    original = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = False
        return p

    mp = pytest.MonkeyPatch()
    mp.setattr(llama_cpp.llama_cpp, "llama_model_default_params", params)
    yield
    mp.undo()
