"""The scripts under benchmarks/ as modules, for the tests of their plumbing (they are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py, imported once (registered in sys.modules: dataclasses look their module up)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
