"""The `k3kit` command line: parse arguments, call one function per command, map errors to exit codes.

Each command lives in its own module under `k3kit.commands` and exposes
`NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`. Commands with
sub-commands (``k3kit draft convert``) build their own sub-parsers in `add_arguments`.
Heavy imports (torch) belong inside `run`, so `k3kit inspect` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from k3kit import __version__, commands
from k3kit.errors import K3Error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3kit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"k3kit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"k3kit.commands.{info.name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def openmp_waits_passively() -> None:
    """Let OpenMP threads sleep while they wait, unless the user chose (OMP_WAIT_POLICY, or
    GOMP_SPINCOUNT: `GOMP_SPINCOUNT=300000` is libgomp's own default back). libgomp's threads spin
    first, and when anything else wants the cores (another process, a client, a build) a spinning
    team loses a time slice at every parallel region: the mini's server at 2 threads beside one
    busy process ran 16-91 tok/s spinning against 41-242 sleeping (1-16 clients), `generate` 4.7
    against 97 beside a compiler and a test run. Alone, every parallel region pays a thread's
    wake-up (~0.15 ms on a 2-vCPU VM): 16% of the mini's server at 8-16 clients, 5-25% of a K3
    slice's decode at 2 threads (benchmarks/RESULTS.md); the README tells a dedicated machine's
    owner to set GOMP_SPINCOUNT. libgomp reads it once, when torch loads it: so before that."""
    if "torch" not in sys.modules and not ({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ)):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def main(argv: list[str] | None = None) -> int:
    openmp_waits_passively()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except K3Error as e:
        print(f"k3kit: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"k3kit: error: {e.filename}: no such file or directory", file=sys.stderr)
        return 2
    except IsADirectoryError as e:
        print(f"k3kit: error: {e.filename}: is a directory", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"k3kit: error: {e.filename}: permission denied", file=sys.stderr)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"k3kit: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("k3kit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
