"""`k3kit inspect MODEL`: what a GGUF holds, by ggml type and tensor role, from headers only."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import JustifyMethod

NAME = "inspect"
HELP = "show a GGUF model's tensors and bytes by type and role (header-only, any shard)"


def add_arguments(p) -> None:
    p.add_argument("model", help="a .gguf file or any shard NAME-0000K-of-0000N.gguf")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--layers", action="store_true", help="add a per-layer table")


def fmt_bytes(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _layer_list(layers: list[int] | None) -> str:
    if not layers:
        return "-"
    if len(layers) > 12:
        return f"{len(layers)} ({', '.join(map(str, layers[:6]))}, ..., {layers[-1]})"
    return f"{len(layers)} ({', '.join(map(str, layers))})"


def render(result: dict, out=None) -> None:
    """The human report: architecture, the role x type matrix, trunk vs experts, shards."""
    from rich.console import Console
    from rich.table import Table

    from k3kit.gguf.format import ROLES
    from k3kit.gguf.inspect import trunk_summary

    out = out or sys.stdout
    # a pipe gets a wide console: squeezed tables are unreadable in logs and files
    console = Console(file=out, highlight=False, width=None if out.isatty() else 200)
    a = result["architecture"]
    total = result["total_bytes"] or 1
    files = result["files"]
    more = f"  (+{len(files) - 1} shards)" if len(files) > 1 else ""
    console.print(f"[bold]{files[0]['path']}[/bold]{more}")
    facts = [("arch", a["arch"]), ("name", a["name"]), ("layers", a["layers"]),
             ("KDA layers", _layer_list(a["kda_layers"]) if a["kda_layers"] is not None else None),
             ("MLA layers", _layer_list(a["mla_layers"]) if a["mla_layers"] is not None else None),
             ("experts", a["experts"]), ("experts used", a["experts_used"]),
             ("shared experts", a["shared_experts"]), ("vocab", a["vocab"]),
             ("context", a["context"]), ("hidden", a["embedding"])]
    console.print("  ".join(f"{k}: [bold]{v}[/bold]" for k, v in facts if v is not None))
    console.print(f"{result['n_tensors']} tensors, {fmt_bytes(result['total_bytes'])} of tensor data")

    types = list(result["by_type"])
    t = Table(title="bytes by role and ggml type", title_justify="left")
    t.add_column("role")
    for name in types:
        t.add_column(name, justify="right")
    t.add_column("total", justify="right", style="bold")
    t.add_column("tensors", justify="right")
    for role in ROLES:
        rb = result["by_role"][role]
        if not rb["tensors"]:
            continue
        cells = []
        for name in types:
            b = result["by_role_type"][role].get(name)
            cells.append(f"{fmt_bytes(b['bytes'])} ({100 * b['bytes'] / rb['bytes']:.0f}%)" if b else "")
        t.add_row(role, *cells, f"{fmt_bytes(rb['bytes'])} ({100 * rb['bytes'] / total:.1f}%)",
                  str(rb["tensors"]))
    t.add_section()
    t.add_row("all", *(f"{fmt_bytes(result['by_type'][n]['bytes'])} "
                       f"({100 * result['by_type'][n]['bytes'] / total:.1f}%)" for n in types),
              fmt_bytes(result["total_bytes"]), str(result["n_tensors"]))
    console.print(t)

    trunk, trunk_types = trunk_summary(result)
    if trunk:
        main = ", ".join(f"{n} {100 * b / trunk:.0f}%" for n, b in trunk_types.items() if b / trunk >= 0.005)
        console.print(f"trunk (all but routed experts): [bold]{fmt_bytes(trunk)}[/bold]: {main}")
    experts = result["by_role_type"]["routed_experts"]
    eb = result["by_role"]["routed_experts"]["bytes"]
    if eb:
        main = ", ".join(f"{n} {100 * b['bytes'] / eb:.0f}%" for n, b in experts.items())
        console.print(f"routed experts: [bold]{fmt_bytes(eb)}[/bold]: {main}")

    if len(files) > 1:
        s = Table(title="shards", title_justify="left")
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("#", "right"), ("file", "left"), ("tensors", "right"),
            ("tensor bytes", "right"), ("types", "left"))
        for col, just in columns:
            s.add_column(col, justify=just)
        for i, f in enumerate(files):
            s.add_row(str(i + 1), f["path"].rsplit("/", 1)[-1], str(f["n_tensors"]),
                      fmt_bytes(f["tensor_bytes"]),
                      ", ".join(f"{n} {fmt_bytes(b['bytes'])}" for n, b in f["by_type"].items()))
        console.print(s)

    if "layers" in result:
        roles = [r for r in ROLES if any(r in row["by_role"] for row in result["layers"])]
        lt = Table(title="layers", title_justify="left")
        lt.add_column("layer", justify="right")
        lt.add_column("attn")
        for r in roles:
            lt.add_column(r, justify="right")
        lt.add_column("total", justify="right", style="bold")
        lt.add_column("types")
        for row in result["layers"]:
            lt.add_row(str(row["layer"]), row["attention"] or "-",
                       *(fmt_bytes(row["by_role"][r]) if r in row["by_role"] else "" for r in roles),
                       fmt_bytes(row["bytes"]), ", ".join(sorted(row["types"])))
        console.print(lt)


def run(args) -> int:
    from k3kit.gguf.inspect import inspect_model
    from k3kit.gguf.shards import Model

    with Model.open(args.model) as model:
        result = inspect_model(model, layers=args.layers)
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=_json_default)
        sys.stdout.write("\n")
    else:
        render(result)
    return 0


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, bytes):
        return o.hex()
    raise TypeError(f"cannot serialise {type(o).__name__}")
