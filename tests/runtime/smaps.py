"""What this process has mapped of one file, from /proc/self/smaps (Linux): for the expert-mapping
tests, which check that evicted views of an expert file leave the process."""

from __future__ import annotations

import re
from pathlib import Path

_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s+(.*)$")


def mapped_bytes(path: Path, field: str = "Rss") -> int:
    """The sum of smaps' `field` (a kB figure: Rss, FilePmdMapped, ...) over this process's
    mappings of `path`, in bytes."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = _MAPPING.match(line)
        if m:
            ours = m[1] == str(path)
        elif ours and line.startswith(f"{field}:"):
            total += int(line.split()[1]) * 1024
    return total
