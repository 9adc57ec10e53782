"""The device's memory bandwidth as a large copy sees it, measured once per `k3kit bench`: the yardstick
for the bytes a decoded token reads (the trunk's weights once, each routed expert it touches once).
A decode step that reads B bytes a token at T tok/s moves B*T bytes a second; against the copy rate
that says how close the step is to the memory's bound, per device."""

from __future__ import annotations

import time

import torch

COPY_BYTES = 256 << 20


def copy_gbps(device: str | torch.device = "cpu", nbytes: int = COPY_BYTES, reps: int = 3) -> float:
    """GB/s read by torch's copy of one `nbytes` buffer into another on `device` (best of `reps`,
    after one warm-up copy), with torch's threads as they are set."""
    dev = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(reps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
