"""What one bench run measures: the base settings from the flags and the `--sweep` product.

A configuration is the settings one set of `pp`/`tg` rows runs with. `--sweep KEY=V1,V2`
(repeatable) replaces the flag's value by each listed value; several sweeps give their
cartesian product, in the order given. Every key and value is checked before a model is
loaded, so a typo costs nothing but a one-line error.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from k3kit.errors import K3Error

MAX_CONFIGS = 256
MAX_CLIENTS = 256
EXPERT_KERNELS = ("auto", "native", "torch")
DRAFT_KEYS = ("block_size", "verify_budget", "confidence_threshold")


@dataclass(frozen=True)
class Config:
    """The settings of one configuration (the sweepable ones; the rest are run-wide)."""

    expert_cache_mib: float = 256.0
    expert_kernel: str = "auto"
    threads: int = 0                       # 0: torch's default
    block_size: int | None = None          # None: the draft's trained block
    verify_budget: str = "auto"            # "auto" or a row count
    confidence_threshold: float = 0.0

    def load_key(self) -> tuple[Any, ...]:
        """What needs a fresh model load when it changes (the rest is set on the loaded model)."""
        return (self.expert_kernel,)

    def label(self, keys: Sequence[str]) -> str:
        """`key=value` of the swept keys ('default' when nothing is swept)."""
        return " ".join(f"{k}={getattr(self, k)}" for k in keys) or "default"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _int(low: int) -> Callable[[str], int]:
    def parse(v: str) -> int:
        n = int(v)
        if n < low:
            raise ValueError(f"must be >= {low}")
        return n
    return parse


def _mib(v: str) -> float:
    x = float(v)
    if not x >= 0 or x == float("inf"):
        raise ValueError("must be a number of MiB >= 0")
    return x


def _threshold(v: str) -> float:
    x = float(v)
    if not 0.0 <= x <= 1.0:
        raise ValueError("must be in [0, 1]")
    return x


def _budget(v: str) -> str:
    if v == "auto":
        return v
    _int(1)(v)
    return str(int(v))


def _kernel(v: str) -> str:
    if v not in EXPERT_KERNELS:
        raise ValueError(f"must be one of {', '.join(EXPERT_KERNELS)}")
    return v


PARSERS: dict[str, Callable[[str], Any]] = {
    "block_size": _int(1), "verify_budget": _budget, "confidence_threshold": _threshold,
    "expert_cache_mib": _mib, "expert_kernel": _kernel, "threads": _int(1),
}


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """`KEY=V1,V2,...` -> (key, values); keys take '-' or '_'; one-line errors."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise K3Error(f"--sweep {text!r}: expected KEY=V1,V2,... (keys: {', '.join(PARSERS)})")
    parse = PARSERS.get(key)
    if parse is None:
        raise K3Error(f"--sweep {text!r}: unknown key {key!r} (keys: {', '.join(PARSERS)})")
    items = [v.strip() for v in values.split(",")]
    if not values.strip() or any(not v for v in items):
        raise K3Error(f"--sweep {text!r}: empty value in the list")
    out = []
    for v in items:
        try:
            out.append(parse(v))
        except ValueError as e:
            raise K3Error(f"--sweep {key}={v!r}: {str(e).splitlines()[0]}") from None
    if len(set(out)) != len(out):
        raise K3Error(f"--sweep {text!r}: a value is listed twice")
    return key, out


def expand(base: Config, sweeps: Sequence[str], *, draft: bool) -> tuple[list[Config], list[str]]:
    """The configurations of `sweeps` around `base` (cartesian product) and the swept keys."""
    parsed = [parse_sweep(s) for s in sweeps]
    keys = [k for k, _ in parsed]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise K3Error(f"--sweep {sorted(dup)[0]}: given more than once (list every value in one --sweep)")
    if not draft:
        for k in keys:
            if k in DRAFT_KEYS:
                raise K3Error(f"--sweep {k}=...: sweeps a speculative setting, needs --draft")
    n = 1
    for _, values in parsed:
        n *= len(values)
    if n > MAX_CONFIGS:
        raise K3Error(f"--sweep: {n} configurations; at most {MAX_CONFIGS} per run")
    configs = [replace(base, **dict(zip(keys, combo, strict=True)))
               for combo in itertools.product(*(v for _, v in parsed))]
    return configs, keys


def parse_concurrency(text: str | None) -> list[int]:
    """`--concurrency 1,4,16` -> [1, 4, 16] (each 1..MAX_CLIENTS, no repeats)."""
    if text is None:
        return []
    out = []
    for v in text.split(","):
        try:
            n = int(v.strip())
        except ValueError:
            raise K3Error(f"--concurrency {text!r}: {v.strip()!r} is not a whole number of clients") from None
        if not 1 <= n <= MAX_CLIENTS:
            raise K3Error(f"--concurrency {text!r}: {n} clients: must be 1..{MAX_CLIENTS}")
        out.append(n)
    if len(set(out)) != len(out):
        raise K3Error(f"--concurrency {text!r}: a client count is listed twice")
    return out
