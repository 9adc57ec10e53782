"""Whether a module's forward hooks are in play, for code that calls a module's arithmetic
without calling the module (k3kit.models.kimi_k3.row_step, k3kit.models.dflash.block_step): a
hook expects the module's own call, so where one is set that code runs `forward` instead."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def hooked(modules: Iterable[nn.Module]) -> bool:
    """Whether a forward (pre-)hook is set on any of `modules`, or on every module (torch's
    global hooks)."""
    g = torch.nn.modules.module
    return bool(g._global_forward_hooks or g._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in modules)
