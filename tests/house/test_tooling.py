"""The linter and the type checker, run by the test suite so CI's one command (`python -m pytest`) runs them.

Both read their configuration from pyproject.toml ([tool.ruff], [tool.mypy]) and are pinned in the
`dev` extra. mypy keeps its cache in .mypy_cache (git-ignored): a warm run takes seconds, a cold one
(a fresh CI clone) analyses numpy and torch's stubs first.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed: pip install -e '.[dev]'", pytrace=False)
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_ruff_is_clean():
    out = _run("ruff", "check", "--output-format=concise", "src", "tests", "benchmarks", timeout=300)
    if out.returncode != 0:
        pytest.fail(f"ruff check src tests benchmarks:\n{out.stdout}{out.stderr}", pytrace=False)


def test_mypy_is_clean():
    out = _run("mypy", timeout=1800)  # files, strictness and cache location come from [tool.mypy]
    if out.returncode != 0:
        pytest.fail(f"mypy:\n{out.stdout}{out.stderr}", pytrace=False)
