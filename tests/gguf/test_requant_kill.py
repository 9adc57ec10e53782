"""SIGKILL `k3kit requant --delete-source` at named points, then --resume: nothing lost, same bytes.

K3KIT_TEST_KILL_AT=phase:shard makes the process (and its worker group) SIGKILL itself at
that point, so every crash window is hit deterministically, without timing:
write (mid-write, a tensor already in the partial file), written (partial complete, not
verified), verify (mid-verify), renamed (final name, journal not updated), journaled
(journal says verified, source not yet deleted), deleted (source gone, journal not updated).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from requant_helpers import copy_source, make_source, run_sub, sha

from k3kit.gguf.requant import JOURNAL_NAME, Options, requantize


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> list[Path]:
    return make_source(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("ref") / "out"
    requantize(source[0], out, Options(), jobs=1, progress=False)
    return {p.name: sha(out / p.name) for p in source}


def _check_nothing_lost(src: list[Path], out: Path, reference: dict[str, str]) -> dict:
    """Each source shard is present or replaced by a verified output; final names hold verified bytes only."""
    journal = json.loads((out / JOURNAL_NAME).read_text())
    states = {s["name"]: s for s in journal["shards"]}
    for p in out.iterdir():
        if p.name.endswith(".gguf") and not p.name.startswith("."):
            assert sha(p) == reference[p.name], f"{p.name} under its final name but not the verified bytes"
    for p in src:
        if not p.exists():
            rec = states[p.name]
            assert rec["state"] in ("verified", "source-deleted"), f"{p.name} deleted before it was journaled"
            assert (out / p.name).exists() and rec["output"]["sha256"] == reference[p.name]
    return states


KILLS = [
    ("write:2", 1), ("written:1", 1), ("verify:2", 1), ("renamed:1", 1), ("journaled:2", 1),
    ("deleted:1", 1), ("deleted:3", 1), ("verify:3", 2), ("write:1", 2),
]


@pytest.mark.parametrize(("kill_at", "jobs"), KILLS)
def test_kill_then_resume(source, reference, tmp_path, kill_at, jobs):
    src = copy_source(source, tmp_path / "src")
    out = tmp_path / "out"
    args = ["requant", src[0], "-o", out, "--delete-source", "--jobs", jobs]
    r = run_sub(args, kill_at=kill_at)
    assert r.returncode == -signal.SIGKILL, r.stderr
    states = _check_nothing_lost(src, out, reference)
    phase, no = kill_at.split(":")
    name = src[int(no) - 1].name
    if phase in ("write", "written", "verify"):
        assert not (out / name).exists() and src[int(no) - 1].exists()
        assert states[name]["state"] in ("pending", "written")
    if phase == "written":
        assert states[name]["state"] == "written"
        assert (out / f".{name}.partial").exists()  # hidden, and removed by the resume
    if phase == "renamed":
        assert (out / name).exists() and states[name]["state"] == "written"
    if phase == "journaled":
        assert states[name]["state"] == "verified" and src[int(no) - 1].exists()
    if phase == "deleted":
        assert states[name]["state"] == "verified" and not src[int(no) - 1].exists()

    r = run_sub([*args, "--resume", "--json"])
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert {s["status"] for s in result["shards"]} <= {"verified", "resumed (verified earlier)"}
    assert not any(p.exists() for p in src)
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([*reference, JOURNAL_NAME])  # no partials or temps left behind
    assert {n: sha(out / n) for n in reference} == reference  # same bytes as an uninterrupted run
    journal = json.loads((out / JOURNAL_NAME).read_text())
    assert [s["state"] for s in journal["shards"]] == ["source-deleted"] * 3


def test_resume_refuses_a_changed_source(source, tmp_path):
    src = copy_source(source, tmp_path / "src")
    out = tmp_path / "out"
    r = run_sub(["requant", src[0], "-o", out, "--jobs", 1], kill_at="write:2")
    assert r.returncode == -signal.SIGKILL
    with open(src[1], "r+b") as f:  # the header of shard 2 changes (a KV value byte)
        f.seek(40)
        b = f.read(1)[0]
        f.seek(40)
        f.write(bytes([b ^ 1]))
    r = run_sub(["requant", src[0], "-o", out, "--resume"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert src[1].name in r.stderr and "changed since the journal was written" in r.stderr
    r = run_sub(["requant", src[0], "-o", out])
    assert r.returncode == 2 and "pass --resume" in r.stderr
