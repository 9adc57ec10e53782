"""The stdlib corpus: selection rules, a split that never shares a file, a manifest that pins the text."""

from __future__ import annotations

import hashlib
import os
import platform

import pytest

from k3kit.errors import K3Error
from k3kit.mini.corpus import MAX_FILE_BYTES, build_corpus, is_heldout, stdlib_dir, text_sha256


@pytest.fixture(scope="module")
def full():
    return build_corpus()


def test_full_stdlib_selection(full):
    paths = full.train_paths + full.heldout_paths
    assert not set(full.train_paths) & set(full.heldout_paths)
    assert full.train_paths == sorted(full.train_paths)
    assert full.heldout_paths == sorted(full.heldout_paths)
    for rel in paths:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(parts), rel
        assert not parts[-1].startswith("_sysconfigdata"), rel
        assert not parts[0].startswith("config-"), rel
        assert (stdlib_dir() / rel).stat().st_size <= MAX_FILE_BYTES
    # Real library modules made it in; a few hundred files whatever the exact Python version.
    for must in ("os.py", "json/decoder.py", "collections/__init__.py"):
        assert must in paths
    assert len(paths) > 300
    # The held-out share follows the hash, about 5% of files.
    assert 0.02 < len(full.heldout_paths) / len(paths) < 0.09


def test_docs_are_the_files_text(full):
    for rel, doc in list(zip(full.train_paths, full.train_docs, strict=True))[::50]:
        assert doc == (stdlib_dir() / rel).read_bytes().decode("utf-8")
    for rel, doc in zip(full.heldout_paths, full.heldout_docs, strict=True):
        assert doc == (stdlib_dir() / rel).read_text(encoding="utf-8")


def test_manifest_pins_the_text(full):
    m = full.manifest
    assert m["python_version"] == platform.python_version()
    for split, docs, paths in (("train", full.train_docs, full.train_paths),
                               ("heldout", full.heldout_docs, full.heldout_paths)):
        assert m[split]["files"] == len(docs) == len(paths)
        assert m[split]["bytes"] == sum(len(d.encode()) for d in docs)
        assert m[split]["sha256"] == hashlib.sha256("".join(docs).encode()).hexdigest()
        assert m[split]["paths_sha256"] == hashlib.sha256("\n".join(paths).encode()).hexdigest()
    assert text_sha256(["ab", "c"]) == hashlib.sha256(b"abc").hexdigest()


def test_capped_corpus_is_deterministic_and_keeps_the_split(full):
    a = build_corpus(max_bytes=400_000)
    b = build_corpus(max_bytes=400_000)
    assert a.manifest == b.manifest and a.train_docs == b.train_docs and a.heldout_docs == b.heldout_docs
    total = a.manifest["train"]["bytes"] + a.manifest["heldout"]["bytes"]
    assert 300_000 < total <= 400_000
    # The cap samples across the library rather than taking the alphabetically first files.
    assert len({p.split("/")[0] for p in a.train_paths}) > 10
    # A file's split does not depend on the cap.
    assert set(a.train_paths) <= set(full.train_paths)
    assert set(a.heldout_paths) <= set(full.heldout_paths)


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_rules_on_a_synthetic_stdlib(tmp_path):
    root = tmp_path / "lib"
    keep = {
        "a.py": b"import os\n",
        "pkg/__init__.py": b'"""Doc."""\n',
        "pkg/mod.py": "caf\u00e9 = 1\n".encode(),
        "idlelib/editor.py": b"x = 1\n",
    }
    for rel, data in keep.items():
        _write(root / rel, data)
    skipped = {
        "site-packages/numpy/core.py": b"x = 1\n",
        "dist-packages/y.py": b"x = 1\n",
        "test/test_os.py": b"x = 1\n",
        "unittest/test/test_case.py": b"x = 1\n",
        "lib2to3/tests/data.py": b"x = 1\n",
        "idlelib/idle_test/test_x.py": b"x = 1\n",
        "__pycache__/a.py": b"x = 1\n",
        "config-3.11-x86_64-linux-gnu/python-config.py": b"x = 1\n",
        "_sysconfigdata__linux.py": b"x = 1\n",
        "big.py": b"#" * (MAX_FILE_BYTES + 1),
        "latin1.py": "caf\u00e9 = 1\n".encode("latin-1"),
        "notes.txt": b"not python\n",
    }
    for rel, data in skipped.items():
        _write(root / rel, data)
    os.symlink(root / "a.py", root / "link.py")

    c = build_corpus(root=root, heldout_fraction=0.5)
    assert sorted(c.train_paths + c.heldout_paths) == sorted(keep)
    for rel in keep:
        assert (rel in c.heldout_paths) == is_heldout(rel, 0.5)
    assert c.manifest["skipped_files"] == 2  # big.py and latin1.py: read, then rejected
    docs = dict(zip(c.train_paths + c.heldout_paths, c.train_docs + c.heldout_docs, strict=True))
    assert docs["pkg/mod.py"] == "caf\u00e9 = 1\n"

    none_held = build_corpus(root=root, heldout_fraction=0.0)
    assert none_held.heldout_paths == [] and sorted(none_held.train_paths) == sorted(keep)


def test_bad_inputs(tmp_path):
    with pytest.raises(K3Error, match="not found"):
        build_corpus(root=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(K3Error, match="no usable"):
        build_corpus(root=tmp_path / "empty")
    with pytest.raises(K3Error, match="max_bytes"):
        build_corpus(max_bytes=0)
    with pytest.raises(K3Error, match="heldout_fraction"):
        build_corpus(heldout_fraction=1.0)
    # A budget smaller than every file leaves nothing: an error, not an empty model.
    _write(tmp_path / "one" / "a.py", b"x = 1\n" * 100)
    with pytest.raises(K3Error, match="no usable"):
        build_corpus(root=tmp_path / "one", max_bytes=10)
