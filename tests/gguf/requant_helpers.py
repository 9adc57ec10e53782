"""Shared pieces of the requant tests: a synthetic sharded kimi-k3 and CLI runners."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from k3kit.cli import main
from k3kit.gguf import synth

NAME = "kimi-k3-synth-mini-4L-8E"
SHARDS = 3


def make_source(out: Path, seed: int = 7) -> list[Path]:
    """The mini geometry, 4 layers (KDA x3 + MLA, a dense layer 0), 8 experts, 3 shards."""
    r = synth.synthesize(out, "mini", 4, 8, shards=SHARDS, seed=seed, progress=False)
    return [Path(p) for p in r.paths]


def copy_source(src: list[Path], dst: Path) -> list[Path]:
    dst.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(p, dst / p.name)) for p in src]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def run_sub(args: list[str], kill_at: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`k3kit ARGS` in a fresh session (so the kill hook can take the whole process group)."""
    env = dict(os.environ)
    env.pop("K3KIT_TEST_KILL_AT", None)
    if kill_at:
        env["K3KIT_TEST_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "k3kit.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, start_new_session=True)
