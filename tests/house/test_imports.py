"""The layer rules of the house, stated as data and checked on every module under src/k3kit.

A package may import only the k3kit packages its row names (and itself); some packages may never
import certain third-party modules, because what sits below them must stay cheap: inspecting or
rewriting a 1.4 TB GGUF must not pay for torch. Imports are read with `ast`, never executed, so
a lazy import inside a function counts as much as one at the top of a module, relative imports
are resolved, and `importlib.import_module("k3kit.x...")` with a constant (prefix) counts too.

When this test fails, either the import is wrong (move the code to the layer it belongs to, or
pass the dependency in) or the rule is: then change the table below in the same commit, where a
reviewer sees it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# package (top-level name under k3kit) -> the k3kit packages it may import besides itself.
# `import k3kit` alone (the root package holds only __version__) is allowed everywhere.
_BASE = ("errors", "_io", "progress")
_LIBRARY = ("gguf", "tokenizer", "convert", "kernels", "layers", "models", "runtime", "adapters", "mini",
            "serve", "plan", "bench")
MAY_IMPORT: dict[str, frozenset[str]] = {
    name: frozenset(deps)
    for name, deps in {
        "errors": (),
        "_io": ("errors",),
        "progress": ("errors",),
        "gguf": ("errors", "_io", "progress"),
        "tokenizer": ("gguf", "errors", "_io"),
        "convert": ("gguf", "tokenizer", "errors", "_io", "progress"),
        "kernels": ("gguf", "errors"),
        "layers": ("kernels", "errors"),
        # pure networks: never runtime, adapters, mini or commands
        "models": ("layers", "kernels", "convert", "gguf", "errors"),
        # model-neutral: never models, layers, adapters, mini, tokenizer or commands
        "runtime": ("kernels", "gguf", "errors", "_io", "progress"),
        # the only glue between runtime and the architectures
        "adapters": ("runtime", "models", "layers", "kernels", "tokenizer", "convert", "gguf",
                     "errors", "_io"),
        # training and shipping the mini; its chat data is rendered the way the server renders a
        # request (serve.tools), so training text and served prompts cannot drift apart
        "mini": ("adapters", "models", "layers", "kernels", "runtime", "tokenizer", "convert", "gguf",
                 "serve", "errors", "_io", "progress"),
        # the HTTP server over a loaded model: never commands or mini (the CLI resolves paths)
        "serve": ("adapters", "runtime", "tokenizer", "gguf", "errors", "_io", "progress"),
        # `k3kit plan`: placement and speed from GGUF headers alone, so it runs anywhere in < 1 s
        "plan": ("gguf", "errors", "_io", "progress"),
        # `k3kit bench`: measures loaded models (adapters, runtime); `k3kit serve` only through its HTTP
        # API (a child process), so never serve; never commands or mini (the CLI hands workloads in)
        "bench": ("adapters", "runtime", "plan", "tokenizer", "gguf", "errors", "_io", "progress"),
        # one module per CLI command: anything below the command line
        "commands": _BASE + _LIBRARY,
        "cli": ("commands", "errors"),
        "__main__": ("cli",),
    }.items()
}

# package -> third-party top-level modules it never imports. A package also inherits the
# bans of every package allowed to import it (gguf may import progress, so progress is torch-free).
NEVER_IMPORTS: dict[str, frozenset[str]] = {
    "gguf": frozenset({"torch", "tokenizers", "jinja2"}),
    "tokenizer": frozenset({"torch"}),
    "convert": frozenset({"torch"}),
    "plan": frozenset({"torch"}),
}


@dataclass(frozen=True)
class Import:
    """One import statement (or constant `import_module` call) found in a source file."""

    path: Path
    line: int
    module: str  # the dotted module imported, e.g. "k3kit.models.kimi_k3" or "torch.nn"


def effective_bans(may_import: Mapping[str, frozenset[str]],
                   never: Mapping[str, frozenset[str]]) -> dict[str, dict[str, str]]:
    """package -> {banned third-party module: the package whose rule bans it}, bans inherited downwards."""
    bans: dict[str, dict[str, str]] = {p: {m: p for m in never.get(p, ())} for p in may_import}
    changed = True
    while changed:
        changed = False
        for importer, deps in may_import.items():
            for dep in deps:
                for mod, origin in bans[importer].items():
                    if dep in bans and mod not in bans[dep]:
                        bans[dep][mod] = origin
                        changed = True
    return bans


def _module_name(src: Path, path: Path) -> tuple[str, bool]:
    """The dotted name of a source file and whether it is a package's __init__."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _dynamic_target(call: ast.Call) -> str | None:
    """The module named by `importlib.import_module("...")` / `__import__("...")` with a constant (prefix)."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text = arg.value
    elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        text = str(arg.values[0].value).rsplit(".", 1)[0]  # "k3kit.commands.{name}" -> "k3kit.commands"
    else:
        return None
    return text if text and not text.startswith(".") else None


def imports_of(src: Path, path: Path) -> Iterator[Import]:
    """Every module `path` imports, wherever the statement sits (module level, function, TYPE_CHECKING)."""
    modname, is_pkg = _module_name(src, path)
    package = modname.split(".") if is_pkg else modname.split(".")[:-1]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
                base = package[: len(package) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin == "k3kit":  # `from k3kit import commands` imports the package k3kit.commands
                for alias in node.names:
                    yield Import(path, node.lineno, f"{origin}.{alias.name}")
            else:
                yield Import(path, node.lineno, origin)
        elif isinstance(node, ast.Call):
            target = _dynamic_target(node)
            if target:
                yield Import(path, node.lineno, target)


def check_tree(src: Path, may_import: Mapping[str, frozenset[str]] = MAY_IMPORT,
               never: Mapping[str, frozenset[str]] = NEVER_IMPORTS) -> list[str]:
    """Every violation of the rules under `src`/k3kit, as 'path:line: message' (paths from src's parent)."""
    pkg_root = src / "k3kit"
    # the top-level names under k3kit: modules (cli, errors...) and packages (gguf, runtime...)
    modules = {p.stem for p in pkg_root.glob("*.py") if p.name != "__init__.py"}
    tops = modules | {p.parent.name for p in pkg_root.glob("*/__init__.py")}
    bans = effective_bans(may_import, never)
    problems: list[str] = []
    for top in sorted(tops - set(may_import)):
        problems.append(f"{(pkg_root / top).relative_to(src.parent)}: package `{top}` has no layer rule: "
                        "add its row to MAY_IMPORT in tests/house/test_imports.py")
    for path in sorted(pkg_root.rglob("*.py")):
        rel = path.relative_to(src.parent)
        modname, _ = _module_name(src, path)
        parts = modname.split(".")
        layer = parts[1] if len(parts) > 1 else None  # None: the root package itself
        for imp in sorted(imports_of(src, path), key=lambda i: i.line):
            head, *rest = imp.module.split(".")
            where = f"{rel}:{imp.line}"
            if head != "k3kit":
                if layer is not None and head in bans.get(layer, {}):
                    origin = bans[layer][head]
                    why = "" if origin == layer else (
                        f" (inherited from `{origin}`, which may import `{layer}`)")
                    problems.append(f"{where}: `{layer}` must not import `{head}`{why}")
                continue
            if layer is None:
                problems.append(f"{where}: the root package holds only the version: no `{imp.module}`")
                continue
            if not rest or rest[0] not in tops:  # the root package itself (`from k3kit import __version__`)
                continue
            target = rest[0]
            if layer in may_import and target != layer and target not in may_import[layer]:
                allowed = ", ".join(sorted(may_import[layer])) or "nothing"
                problems.append(f"{where}: `{layer}` must not import `{imp.module}` "
                                f"(rule: `{layer}` may import {allowed})")
    return list(dict.fromkeys(problems))  # one line per violation, even if a statement repeats it


def test_rules_are_a_layering():
    """The table names only known packages and has no cycle: every rule points down."""
    for pkg, deps in MAY_IMPORT.items():
        assert deps <= set(MAY_IMPORT), f"{pkg} names unknown packages {sorted(deps - set(MAY_IMPORT))}"
    order: list[str] = []
    visiting: set[str] = set()

    def visit(p: str, path: tuple[str, ...]) -> None:
        assert p not in visiting, f"cycle in the layer rules: {' -> '.join(path + (p,))}"
        if p in order:
            return
        visiting.add(p)
        for d in sorted(MAY_IMPORT[p] - {p}):
            visit(d, path + (p,))
        visiting.discard(p)
        order.append(p)

    for p in MAY_IMPORT:
        visit(p, ())
    assert set(NEVER_IMPORTS) <= set(MAY_IMPORT)


def test_src_follows_the_layer_rules():
    problems = check_tree(SRC)
    if problems:
        pytest.fail(f"{len(problems)} layer-rule violation(s):\n" + "\n".join(problems), pytrace=False)


# ---- the test of the test: plant forbidden imports in a throw-away tree and see them reported ----

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src"
    for rel, text in {"k3kit/__init__.py": '__version__ = "0"\n', "k3kit/errors.py": "", **files}.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        for parent in p.relative_to(src).parents:  # every directory is a package
            init = src / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")
        p.write_text(text)
    return src


def test_checker_accepts_a_tree_that_follows_the_rules(tmp_path):
    src = _tree(tmp_path, {
        "k3kit/gguf/reader.py": "import numpy\nfrom k3kit.errors import K3Error\nfrom . import format\n",
        "k3kit/gguf/format.py": "",
        "k3kit/runtime/engine.py": "from ..gguf import reader\nfrom k3kit import errors\nimport torch\n",
        "k3kit/cli.py": ("import importlib\nfrom k3kit import __version__, commands\n"
                         "def f(n):\n    return importlib.import_module(f'k3kit.commands.{n}')\n"),
        "k3kit/commands/generate.py": "def run():\n    from k3kit.runtime import engine\n",
    })
    assert check_tree(src) == []


def test_checker_reports_planted_violations(tmp_path):
    src = _tree(tmp_path, {
        "k3kit/gguf/reader.py": "import numpy\n\n\ndef load():\n    import torch.nn\n    return torch\n",
        "k3kit/gguf/quants/q4.py": "from ...runtime import engine\n",
        "k3kit/runtime/engine.py": "",
        "k3kit/runtime/loader.py": "from ..models import kimi_k3\n",
        "k3kit/runtime/finder.py": "import importlib\nm = importlib.import_module('k3kit.models.kimi_k3')\n",
        "k3kit/models/kimi_k3.py": "from k3kit.runtime.engine import Engine\n",
        "k3kit/progress.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        "k3kit/tokenizer/codec.py": "import jinja2\nimport tokenizers\nimport torch\n",
        "k3kit/webui/app.py": "",
        "k3kit/serve/app.py": "def load():\n    from k3kit.commands.generate import default_model\n",
        "k3kit/commands/generate.py": "",
        "k3kit/__init__.py": '__version__ = "0"\nfrom .runtime import engine\n',
    })
    assert check_tree(src) == [
        "src/k3kit/webui: package `webui` has no layer rule: "
        "add its row to MAY_IMPORT in tests/house/test_imports.py",
        "src/k3kit/__init__.py:2: the root package holds only the version: no `k3kit.runtime`",
        "src/k3kit/gguf/quants/q4.py:1: `gguf` must not import `k3kit.runtime` "
        "(rule: `gguf` may import _io, errors, progress)",
        "src/k3kit/gguf/reader.py:5: `gguf` must not import `torch`",
        "src/k3kit/models/kimi_k3.py:1: `models` must not import `k3kit.runtime.engine` "
        "(rule: `models` may import convert, errors, gguf, kernels, layers)",
        "src/k3kit/progress.py:3: `progress` must not import `torch` "
        "(inherited from `gguf`, which may import `progress`)",
        "src/k3kit/runtime/finder.py:2: `runtime` must not import `k3kit.models.kimi_k3` "
        "(rule: `runtime` may import _io, errors, gguf, kernels, progress)",
        "src/k3kit/runtime/loader.py:1: `runtime` must not import `k3kit.models` "
        "(rule: `runtime` may import _io, errors, gguf, kernels, progress)",
        "src/k3kit/serve/app.py:2: `serve` must not import `k3kit.commands.generate` "
        "(rule: `serve` may import _io, adapters, errors, gguf, progress, runtime, tokenizer)",
        "src/k3kit/tokenizer/codec.py:3: `tokenizer` must not import `torch`",
    ]


def test_bans_are_inherited_by_what_a_package_may_import():
    bans = effective_bans(MAY_IMPORT, NEVER_IMPORTS)
    for base in _BASE:
        assert {"torch", "tokenizers", "jinja2"} <= set(bans[base]), base
    assert "torch" in bans["tokenizer"] and "torch" in bans["gguf"]
    assert "torch" not in bans["kernels"] and "torch" not in bans["runtime"]
