"""Whether a module's forward hooks are in play, for code that calls a module's arithmetic
without calling the module (k3kit.models.kimi_k3.row_step, k3kit.models.dflash.block_step): a
hook expects the module's own call, so where one is set that code runs `forward` instead."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class HookWatch:
    """Whether a forward (pre-)hook is set on any of some modules, or on every module (torch's
    global hooks), asked every step: the modules' hook dicts are gathered once (torch registers
    and removes a module's hooks in those dicts, in place), so asking is a truth test a dict in C
    (~1 us for a hundred modules, against ~8 us walking them)."""

    def __init__(self, modules: Iterable[nn.Module]):
        self.dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]

    def __call__(self) -> bool:
        g = torch.nn.modules.module
        return bool(g._global_forward_hooks or g._global_forward_pre_hooks) or any(self.dicts)
