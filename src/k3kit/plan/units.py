"""Sizes and bandwidths as people write them (`24GiB`, `7GB/s`), parsed strictly, printed plainly.

A planner that silently reads `24G` as 24e9 where the user meant GiB is off by 7% on every
GPU, which is the difference between fitting and not. So the unit is required: decimal
(KB, MB, GB, TB) or binary (KiB, MiB, GiB, TiB); a bare integer is bytes. Anything else is a
one-line error naming the flag.
"""

from __future__ import annotations

import math
import re

from k3kit.errors import K3Error

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_NUMBER = r"(?P<num>\d+(?:\.\d*)?|\.\d+)"
_SIZE_RE = re.compile(rf"^{_NUMBER}\s*(?P<unit>[kmgt]i?b|b)?$", re.IGNORECASE)
_BW_RE = re.compile(rf"^{_NUMBER}\s*(?P<unit>[kmgt]i?b|b)\s*/\s*s$", re.IGNORECASE)
MAX_BYTES = 1 << 60  # 1 EiB: anything larger is a typo


def parse_size(text: str | int, flag: str) -> int:
    """`24GiB`, `2.39GB`, `512MiB`, `2390153888` -> bytes (an int > 0)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE_RE.match(str(text).strip())
        if m is None:
            raise K3Error(f"{flag} {text!r}: not a size (expected a number and a unit, e.g. 24GiB or 128GB)")
        if m["unit"] is None and "." in m["num"]:
            raise K3Error(f"{flag} {text!r}: a size without a unit is a whole number of bytes")
        value = float(m["num"]) * UNITS[(m["unit"] or "b").lower()]
    if not (math.isfinite(value) and 0 < value <= MAX_BYTES):
        raise K3Error(f"{flag} {text!r}: must be more than 0 and at most 1 EiB")
    return int(value)


def parse_bandwidth(text: str, flag: str) -> float:
    """`7GB/s`, `900 GB/s`, `80GiB/s` -> bytes per second (a float > 0)."""
    m = _BW_RE.match(str(text).strip())
    if m is None:
        raise K3Error(f"{flag} {text!r}: not a bandwidth (expected a number, a unit and /s, e.g. 7GB/s)")
    value = float(m["num"]) * UNITS[m["unit"].lower()]
    if not (math.isfinite(value) and 0 < value <= MAX_BYTES):
        raise K3Error(f"{flag} {text!r}: must be more than 0 B/s")
    return value


def fmt_bytes(n: float) -> str:
    """Decimal units, as `inspect` prints them (59.29 GB), so the two outputs compare by eye."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"


def fmt_gib(n: float) -> str:
    """Binary units, for device capacities people know as 16 GiB / 24 GiB."""
    return f"{n / (1 << 30):.2f} GiB"


def fmt_bw(bps: float) -> str:
    if bps >= 1e9:
        return f"{bps / 1e9:.4g} GB/s"
    return f"{bps / 1e6:.4g} MB/s"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
