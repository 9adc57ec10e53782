"""What the package promises outside its code: `python -m k3kit`, one version, a licence, a changelog."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import k3kit
from k3kit import cli

ROOT = Path(__file__).resolve().parents[2]


def test_python_dash_m_prints_the_version():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "k3kit", "--version"], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    assert out.stdout == f"k3kit {k3kit.__version__}\n"


def test_cli_entry_point_prints_the_version(capsys):
    # the `k3kit` script is `k3kit.cli:main`; argparse's version action exits 0
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"k3kit {k3kit.__version__}\n"


@pytest.mark.parametrize("given, torch_first, seen", [
    ({}, False, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, False, "ACTIVE"),
    ({"GOMP_SPINCOUNT": "300000"}, False, None), ({}, True, None)])
def test_the_command_line_lets_openmp_threads_sleep_unless_told(given, torch_first, seen):
    """`k3kit` sets OMP_WAIT_POLICY=PASSIVE for its process before torch loads libgomp (spinning
    threads lose their time slices to anything else on the cores), keeps a user's own choice of
    policy or spin count, and leaves it alone where torch is loaded already (read too late to hold)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env.update(given)
    code = ("import os, sys, atexit\n"
            + ("import torch\n" if torch_first else "")
            + "atexit.register(lambda: print(os.environ.get('OMP_WAIT_POLICY')))\n"
            "from k3kit import cli\ncli.main(['--version'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == str(seen)


def test_one_version_source():
    """pyproject.toml reads k3kit.__version__; no second literal to forget when releasing."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"]
    assert "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "k3kit.__version__"}
    assert f"## {k3kit.__version__}" in (ROOT / "CHANGELOG.md").read_text(), "CHANGELOG has no entry"


def test_licence_matches_the_metadata():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == {"text": "MIT"}
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")
