"""The memory and CPU time this process's control group allows: a container's limits, which
/proc/meminfo and the CPU count do not show.

A rented GPU box is often a container (Docker `--memory`, a Kubernetes limit, systemd's
`MemoryMax`): /proc/meminfo there reports the host's RAM, and an expert cache or prompt cache
sized from it overshoots the group's limit, where the kernel's OOM killer ends the process
instead of the page cache giving way. What the group allows is read as the container runtimes
and language runtimes (the JVM, Go, .NET) read it:

* cgroup v2: the group from `/proc/self/cgroup`'s `0::PATH` line under the cgroup2 mount;
  the smallest `memory.max` of the group and its ancestors; `memory.current` charged now, of
  which `inactive_file` (in `memory.stat`) the kernel reclaims first.
* cgroup v1: the memory controller's group; `hierarchical_memory_limit` (the group's and its
  ancestors' smallest `limit_in_bytes`), `usage_in_bytes`, `total_inactive_file`.
* Inside a container the group's path from /proc/self/cgroup often does not exist under the
  mount (the runtime mounts the container's own group at the root): the mount's root is read then.

CPU time likewise (`cpu_limit`): a CPU quota (`docker --cpus`, a Kubernetes CPU limit) lets the
group run `quota / period` CPUs' worth of time per period, while the scheduler still offers every
core; one OpenMP thread per core then spends most of each period throttled at a barrier, waiting
for threads the quota has stopped. v2: the smallest `cpu.max` ("QUOTA PERIOD" or "max PERIOD")
of the group and its ancestors; v1: `cpu.cfs_quota_us / cpu.cfs_period_us` (-1: none).

Every file is treated as hostile: a missing, unreadable or malformed one means "no limit known"
(None), never an error. `K3KIT_CGROUP_ROOT` / `K3KIT_PROC_CGROUP` point the reader elsewhere
(tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# a limit at or above this is "none" (v1 writes 2^63 rounded down to a page for an unlimited group)
UNLIMITED = 1 << 60


@dataclass(frozen=True)
class GroupMemory:
    """Bytes a control group allows (`limit`), charges now (`used`, page cache included) and
    could take back first (`reclaimable`: inactive file pages)."""

    limit: int
    used: int
    reclaimable: int
    version: int
    where: str

    @property
    def available(self) -> int:
        """What more this process's group can take before the limit: the limit less the working
        set (what is charged less the inactive page cache), as cAdvisor and Kubernetes count it."""
        return max(self.limit - max(self.used - self.reclaimable, 0), 0)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except (OSError, ValueError):
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return UNLIMITED
    try:
        n = int(text)
    except ValueError:
        return None
    return n if n >= 0 else None


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        n = _int(value)
        if key and n is not None:
            out[key] = n
    return out


def _groups(proc_cgroup: Path, controller: str) -> tuple[str | None, str | None]:
    """(the v2 group's path, the v1 `controller`'s group path) from /proc/self/cgroup."""
    v2 = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(root: Path, group: Path) -> list[Path]:
    """`group` and each directory above it up to the mount's root."""
    out = [group]
    while out[-1] != root and root in out[-1].parents:
        out.append(out[-1].parent)
    return out


def _v2_mount(root: Path) -> Path | None:
    """The cgroup2 mount: `root` itself (pure v2) or the hybrid layout's `unified`."""
    for mount in (root, root / "unified"):
        if (mount / "cgroup.controllers").is_file():
            return mount
    return None


def _roots(root: str | Path | None, proc_cgroup: str | Path | None) -> tuple[Path, Path]:
    return (Path(root or os.environ.get("K3KIT_CGROUP_ROOT") or "/sys/fs/cgroup"),
            Path(proc_cgroup or os.environ.get("K3KIT_PROC_CGROUP") or "/proc/self/cgroup"))


def _within(root: Path, path: str) -> Path:
    """The group's directory under `root`, or `root` itself where the path is not there (a
    container's own group mounted at the root) or would leave it."""
    rel = path.strip().lstrip("/")
    if not rel or ".." in rel.split("/"):
        return root
    d = root / rel
    return d if d.is_dir() else root


def _v2(root: Path, path: str) -> GroupMemory | None:
    group = _within(root, path)
    limit = UNLIMITED
    for d in _ancestors(root, group):                  # the group and every ancestor under the mount
        n = _int(_read(d / "memory.max"))
        if n is not None:
            limit = min(limit, n)
    used = _int(_read(group / "memory.current"))
    if limit >= UNLIMITED or used is None:
        return None
    return GroupMemory(limit, used, _stat(group / "memory.stat").get("inactive_file", 0), 2, str(group))


def _v1(root: Path, path: str) -> GroupMemory | None:
    group = _within(root, path)
    stat = _stat(group / "memory.stat")
    own = _int(_read(group / "memory.limit_in_bytes"))
    limit = min(stat.get("hierarchical_memory_limit", UNLIMITED), UNLIMITED if own is None else own)
    used = _int(_read(group / "memory.usage_in_bytes"))
    if limit >= UNLIMITED or used is None:
        return None
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return GroupMemory(limit, used, inactive, 1, str(group))


def group_memory(root: str | Path | None = None, proc_cgroup: str | Path | None = None) -> GroupMemory | None:
    """This process's control-group memory limit and use, or None where no limit applies or
    none can be read (no cgroup filesystem, an unlimited group, a file that makes no sense)."""
    root, proc = _roots(root, proc_cgroup)
    v2_path, v1_path = _groups(proc, "memory")
    found: list[GroupMemory] = []
    if v1_path is not None and (root / "memory").is_dir():
        g = _v1(root / "memory", v1_path)
        if g is not None:
            found.append(g)
    mount = _v2_mount(root) if v2_path is not None else None
    if mount is not None and v2_path is not None:
        g = _v2(mount, v2_path)
        if g is not None:
            found.append(g)
    return min(found, key=lambda g: g.available) if found else None


def _quota(text: str | None, period_text: str | None = None) -> float | None:
    """CPUs a quota allows: v2 "QUOTA PERIOD" (`period_text` None) or v1's two files; None: none."""
    if text is None:
        return None
    if period_text is None:
        parts = text.split()
        if len(parts) != 2:
            return None
        text, period_text = parts
    if text.strip() in ("max", "-1"):
        return None
    try:
        quota, period = int(text), int(period_text)
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_cores(root: str | Path | None = None, proc_cgroup: str | Path | None = None) -> int | None:
    """Whole CPUs the group's quota lets threads run on at once (at least 1), or None: no quota."""
    quota = cpu_limit(root, proc_cgroup)
    return None if quota is None else max(1, int(quota))


def cpu_limit(root: str | Path | None = None, proc_cgroup: str | Path | None = None) -> float | None:
    """CPUs' worth of time this process's control group may use (a quota: 2.5 = two and a half
    CPUs), or None where no quota applies or none can be read."""
    root, proc = _roots(root, proc_cgroup)
    found: list[float] = []
    v2_path, v1_path = _groups(proc, "cpu")
    v1 = next((m for m in (root / "cpu", root / "cpu,cpuacct") if m.is_dir()), None)
    if v1_path is not None and v1 is not None:
        for d in _ancestors(v1, _within(v1, v1_path)):
            q = _quota(_read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us") or "")
            if q is not None:
                found.append(q)
    v2 = _v2_mount(root) if v2_path is not None else None
    if v2 is not None and v2_path is not None:
        for d in _ancestors(v2, _within(v2, v2_path)):
            q = _quota(_read(d / "cpu.max"))
            if q is not None:
                found.append(q)
    return min(found) if found else None
