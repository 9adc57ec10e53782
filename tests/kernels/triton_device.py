"""The device the Triton kernel tests run on: CUDA where there is one, else the CPU through Triton's
interpreter (TRITON_INTERPRET=1, set before triton is first imported: the same kernel source,
executed by numpy). `device()` skips the calling test module where neither can run."""

from __future__ import annotations

import os
import sys

import pytest
import torch


def device() -> torch.device:
    if not torch.cuda.is_available():
        # read by triton when it defines jit functions, its own (tl.sum's) at import included
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1",
                        allow_module_level=True)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from k3kit.kernels import gpu
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not gpu.available(dev):
        pytest.skip("Triton kernels cannot run here (TRITON_INTERPRET=0 without CUDA)",
                    allow_module_level=True)
    return dev
