"""The `_qmatmul` extension is built from every file of kernels/native, and none grows past a reader.

The extension is optional (setup.py: a failed build installs without it, and the engine falls back
to torch), so a C file left out of setup.py's list would not fail an install: its symbols would be
missing at link time and the kernels would silently vanish. These checks read setup.py's lists
(QMATMUL_SOURCES, QMATMUL_HEADERS) without running it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "src" / "k3kit" / "kernels" / "native"
# the file-size rule of the split (see native/README.md): past this a file is split again
MAX_LINES = 1200


def setup_list(name: str) -> list[str]:
    """The string list assigned to `name` at setup.py's top level."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            assert isinstance(node, ast.Assign)
            value = ast.literal_eval(node.value)
            assert isinstance(value, list) and all(isinstance(v, str) for v in value)
            return value
    raise AssertionError(f"setup.py assigns no {name}")


def test_setup_compiles_every_native_c_file_once():
    listed = setup_list("QMATMUL_SOURCES")
    assert len(listed) == len(set(listed)), "a source listed twice"
    assert sorted(listed) == sorted(p.stem for p in NATIVE.glob("*.c"))


def test_setup_lists_every_native_header_as_a_dependency():
    # depends: editing a header rebuilds the extension in place (build_ext compares timestamps)
    assert sorted(setup_list("QMATMUL_HEADERS")) == sorted(p.stem for p in NATIVE.glob("*.h"))


def test_the_sdist_ships_the_headers():
    manifest = (ROOT / "MANIFEST.in").read_text().split("\n")
    assert "graft src/k3kit/kernels/native" in manifest


def test_no_native_file_outgrows_a_reader():
    sizes = {p.name: len(p.read_text().splitlines()) for p in NATIVE.glob("*.[ch]")}
    assert sizes, "no native sources found"
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}
