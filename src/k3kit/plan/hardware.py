"""The machine a plan is for: GPUs, RAM, bandwidths; from flags, a TOML preset, a built-in box, or measured.

Built-in presets are the seed's two boxes. What the seed states (GPU model and count) is
fact; CPU RAM, its bandwidth, the disk and the core count were not published for either box,
so those are assumptions, listed in `notes` and printed with every plan: override any of them
with the flags (`--ram`, `--ram-bw`, `--disk-bw` ...).

`local` measures this machine in well under two seconds: RAM and cores from /proc and the
scheduler, memory read bandwidth with one numpy pass over 128 MiB (single thread: a lower
bound of what all cores reach), and the storage holding MODEL with a bounded sequential
O_DIRECT read of the model's own data (a sparse or tiny file cannot be measured: then the
default is kept and said so). GPUs come from `nvidia-smi` when it exists.

A TOML preset (`--hardware box.toml`):

    name = "my box"
    ram = "256GiB"
    ram_bw = "120GB/s"
    disk_bw = "7GB/s"
    pcie_bw = "25GB/s"
    cores = 32
    nodes = 1
    [[gpu]]
    name = "RTX 3090"
    memory = "24GiB"
    bandwidth = "936GB/s"
    count = 2
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import time
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from k3kit.errors import K3Error
from k3kit.plan.cgroup import GroupMemory, cpu_cores, cpu_limit, group_memory
from k3kit.plan.units import fmt_bw, fmt_gib, parse_bandwidth, parse_size

GiB = 1 << 30
DEFAULT_DISK_BW = 7e9     # PCIe 4.0 NVMe, sequential (k3-notes)
DEFAULT_RAM_BW = 80e9     # DDR5, two channels (k3-notes)
DEFAULT_GPU_BW = 900e9
DEFAULT_PCIE_BW = 25e9    # PCIe 4.0 x16, what a copy reaches (k3-notes)


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int            # bytes
    bandwidth: float       # bytes/s

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "memory_bytes": self.memory, "bandwidth_bytes_s": self.bandwidth}


@dataclass(frozen=True)
class Hardware:
    """One box (or `nodes` identical boxes joined by llama.cpp's RPC backend)."""

    name: str
    gpus: tuple[GPU, ...] = ()
    ram: int | None = None
    ram_bw: float = DEFAULT_RAM_BW
    disk_bw: float = DEFAULT_DISK_BW
    pcie_bw: float = DEFAULT_PCIE_BW
    cores: int | None = None
    nodes: int = 1
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "gpus": [g.to_dict() for g in self.gpus], "ram_bytes": self.ram,
                "ram_bw_bytes_s": self.ram_bw, "disk_bw_bytes_s": self.disk_bw,
                "pcie_bw_bytes_s": self.pcie_bw, "cores": self.cores, "nodes": self.nodes,
                "notes": list(self.notes)}


def _gpus(name: str, memory_gib: int, bw: float, count: int) -> tuple[GPU, ...]:
    return tuple(GPU(name, memory_gib * GiB, bw) for _ in range(count))


PRESETS: dict[str, Hardware] = {
    # The rented box the seed validated on. The seed ran llama-server with -t 112 (a two-socket
    # server); its RAM was not published.
    "8x5060ti": Hardware(
        name="8x5060ti", gpus=_gpus("RTX 5060 Ti", 16, 448e9, 8), ram=512 * GiB, ram_bw=150e9,
        disk_bw=DEFAULT_DISK_BW, pcie_bw=25e9, cores=112,
        notes=("8x RTX 5060 Ti 16 GiB (seed); 448 GB/s each (128-bit GDDR7 at 28 Gbps, spec sheet)",
               "assumed, not published: 512 GiB RAM at 150 GB/s (two-socket server; the seed ran -t 112), "
               "one PCIe 4.0 NVMe at 7 GB/s, PCIe 5.0 x8 links ~25 GB/s: "
               "override with --ram/--ram-bw/--disk-bw")),
    # The home build the seed was planning.
    "2x3090": Hardware(
        name="2x3090", gpus=_gpus("RTX 3090", 24, 936e9, 2), ram=128 * GiB, ram_bw=DEFAULT_RAM_BW,
        disk_bw=DEFAULT_DISK_BW, pcie_bw=25e9, cores=16,
        notes=("2x RTX 3090 24 GiB (seed); 936 GB/s each (k3-notes)",
               "assumed, not published: 128 GiB DDR5 in two channels at 80 GB/s, 16 cores, one PCIe 4.0 NVMe "
               "at 7 GB/s, PCIe 4.0 x16 ~25 GB/s: override with --ram/--ram-bw/--disk-bw")),
}
ALIASES = {"8x5060": "8x5060ti", "8x-5060-ti": "8x5060ti", "2x-3090": "2x3090", "2x3090ti": "2x3090"}


# ---------------------------------------------------------------- TOML

_TOML_KEYS = {"name", "ram", "ram_bw", "disk_bw", "pcie_bw", "cores", "nodes", "gpu"}
_GPU_KEYS = {"name", "memory", "bandwidth", "count"}


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise K3Error(f"{what}: expected a whole number >= 1, got {value!r}")
    return value


def from_toml(path: Path) -> Hardware:
    """A TOML preset; unknown keys are refused (a typo must not silently fall back to a default)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise K3Error(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise K3Error(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise K3Error(f"{path}: not valid TOML ({str(e).splitlines()[0]})") from None
    unknown = sorted(set(data) - _TOML_KEYS)
    if unknown:
        raise K3Error(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_TOML_KEYS))})")
    gpus: list[GPU] = []
    raw_gpus = data.get("gpu", [])
    if not isinstance(raw_gpus, list):
        raise K3Error(f"{path}: gpu must be an array of tables ([[gpu]])")
    for i, g in enumerate(raw_gpus):
        where = f"{path}: gpu[{i}]"
        if not isinstance(g, dict):
            raise K3Error(f"{where}: must be a table")
        bad = sorted(set(g) - _GPU_KEYS)
        if bad:
            raise K3Error(f"{where}: unknown key(s) {', '.join(bad)} (known: {', '.join(sorted(_GPU_KEYS))})")
        if "memory" not in g:
            raise K3Error(f"{where}: missing memory (e.g. memory = \"24GiB\")")
        mem = parse_size(g["memory"], f"{where}.memory")
        bw = parse_bandwidth(g["bandwidth"], f"{where}.bandwidth") if "bandwidth" in g else DEFAULT_GPU_BW
        count = _positive_int(g.get("count", 1), f"{where}.count")
        gpus += [GPU(str(g.get("name", f"gpu{i}")), mem, bw)] * count
    return Hardware(
        name=str(data.get("name", path.stem)), gpus=tuple(gpus),
        ram=parse_size(data["ram"], f"{path}: ram") if "ram" in data else None,
        ram_bw=parse_bandwidth(data["ram_bw"], f"{path}: ram_bw") if "ram_bw" in data else DEFAULT_RAM_BW,
        disk_bw=(parse_bandwidth(data["disk_bw"], f"{path}: disk_bw") if "disk_bw" in data
                 else DEFAULT_DISK_BW),
        pcie_bw=(parse_bandwidth(data["pcie_bw"], f"{path}: pcie_bw") if "pcie_bw" in data
                 else DEFAULT_PCIE_BW),
        cores=_positive_int(data["cores"], f"{path}: cores") if "cores" in data else None,
        nodes=_positive_int(data.get("nodes", 1), f"{path}: nodes"),
        notes=(f"from {path}",))


# ---------------------------------------------------------------- local

MEM_PROBE_BYTES = 128 << 20
DISK_PROBE_BYTES = 256 << 20
DISK_PROBE_SECONDS = 0.6
DISK_CHUNK = 8 << 20
DISK_MIN_BYTES = 32 << 20   # less real data than this under MODEL: not a measurement


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where there is no /proc)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def measure_memory_bw(nbytes: int = MEM_PROBE_BYTES) -> float:
    """Bytes/s of one numpy reduction over a buffer far larger than any cache (best of 3)."""
    a = np.ones(nbytes // 8, dtype=np.int64)
    a.sum()  # fault the pages in and warm up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def _data_extents(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) runs of real data in [start, end): holes of a sparse file are skipped."""
    runs = []
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:
            break  # no more data (ENXIO), or a filesystem without SEEK_DATA: treat the rest as hole
        if data >= end:
            break
        try:
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        except OSError:
            hole = end
        runs.append((data, hole - data))
        pos = hole
    return runs


def measure_disk_bw(paths: list[Path]) -> tuple[float | None, str]:
    """Sequential read speed of the storage under `paths`, reading around the page cache.

    The largest shard's real data is read with O_DIRECT (page-cache hits would measure RAM),
    at most DISK_PROBE_BYTES or DISK_PROBE_SECONDS. Returns (bytes/s or None, how it was measured).
    """
    sizes = [(p.stat().st_size, p) for p in paths if p.exists()]
    if not sizes:
        return None, "no model file to read"
    _, path = max(sizes)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    direct = bool(getattr(os, "O_DIRECT", 0))
    try:
        fd = os.open(path, flags)
    except OSError:
        fd, direct = os.open(path, os.O_RDONLY), False
    try:
        runs = _data_extents(fd, 0, os.fstat(fd).st_size)
        real = sum(n for _, n in runs)
        if real < DISK_MIN_BYTES:
            return None, (f"{path.name} holds {real >> 20} MiB of real data (sparse or small): "
                          f"too little to measure storage")
        buf = mmap.mmap(-1, DISK_CHUNK)  # page-aligned, as O_DIRECT needs
        done = 0
        t0 = time.perf_counter()
        for off, n in runs:
            off = off // 4096 * 4096
            stop = off + n
            while off < stop and done < DISK_PROBE_BYTES and time.perf_counter() - t0 < DISK_PROBE_SECONDS:
                try:
                    got = os.preadv(fd, [buf], off)
                except OSError:
                    if not direct:
                        raise
                    os.close(fd)  # a filesystem that refuses O_DIRECT reads: fall back, page cache and all
                    fd, direct = os.open(path, os.O_RDONLY), False
                    got = os.preadv(fd, [buf], off)
                if got <= 0:
                    break
                done += got
                off += got
            if done >= DISK_PROBE_BYTES or time.perf_counter() - t0 >= DISK_PROBE_SECONDS:
                break
        dt = time.perf_counter() - t0
        buf.close()
    finally:
        os.close(fd)
    how = "O_DIRECT" if direct else "buffered (may include page-cache hits)"
    return done / max(dt, 1e-9), f"read {done >> 20} MiB of {path.name} in {dt:.2f} s, {how}"


def nvidia_gpus() -> list[GPU]:
    """GPUs `nvidia-smi` reports (none without it); bandwidth is not reported, the default is used."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=1.5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, mib = line.rpartition(",")
        if mib.strip().isdigit():
            gpus.append(GPU(name.strip(), int(mib.strip()) << 20, DEFAULT_GPU_BW))
    return gpus


def ram_total(info: dict[str, int] | None = None) -> tuple[int | None, GroupMemory | None]:
    """(the RAM this process may use, the control group that limits it or None): MemTotal, or the
    group's limit where that is less (a container's, which /proc/meminfo does not show)."""
    ram = (meminfo() if info is None else info).get("MemTotal")
    group = group_memory()
    if group is not None and (ram is None or group.limit < ram):
        return group.limit, group
    return ram, None


def measure_local(model_paths: list[Path]) -> Hardware:
    info = meminfo()
    ram, group = ram_total(info)
    if group is not None:
        info["MemAvailable"] = min(info.get("MemAvailable", group.available), group.available)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota, allowed = cpu_limit(), cpu_cores()   # a container's CPU quota: fewer cores' worth of time
    if allowed is not None:
        cores = min(cores, allowed)
    mem_bw = measure_memory_bw()
    disk_bw, disk_how = measure_disk_bw(model_paths)
    gpus = nvidia_gpus()
    source = "MemTotal" if group is None else f"the control group's limit, cgroup v{group.version}"
    notes = [f"measured: RAM {fmt_gib(ram) if ram else '?'} ({source}; "
             f"{fmt_gib(info.get('MemAvailable', 0))} available now), {cores} cores"
             + (f" (the control group's CPU quota: {quota:g} CPUs)" if quota is not None else ""),
             f"measured: memory read {fmt_bw(mem_bw)} (one numpy thread over 128 MiB: a lower bound)"]
    if disk_bw is None:
        notes.append(f"storage not measured ({disk_how}); assumed {fmt_bw(DEFAULT_DISK_BW)}")
    else:
        notes.append(f"measured: storage {fmt_bw(disk_bw)} ({disk_how})")
    notes.append(f"GPUs: {len(gpus)} from nvidia-smi" + (f", bandwidth assumed {fmt_bw(DEFAULT_GPU_BW)}"
                                                         if gpus else ""))
    return Hardware(name="local", gpus=tuple(gpus), ram=ram, ram_bw=mem_bw,
                    disk_bw=disk_bw if disk_bw is not None else DEFAULT_DISK_BW, pcie_bw=DEFAULT_PCIE_BW,
                    cores=cores, notes=tuple(notes))


# ---------------------------------------------------------------- resolve


def preset(spec: str, model_paths: list[Path]) -> Hardware:
    """--hardware NAME|local|FILE.toml."""
    key = ALIASES.get(spec.lower(), spec.lower())
    if key == "local":
        return measure_local(model_paths)
    if key in PRESETS:
        return PRESETS[key]
    if spec.endswith(".toml") or os.sep in spec or Path(spec).exists():
        return from_toml(Path(spec))
    raise K3Error(f"--hardware {spec!r}: expected local, {', '.join(PRESETS)} or a FILE.toml")


def with_flags(hw: Hardware, *, gpus: list[str] | None, gpu_bw: str | None, ram: str | None,
               ram_bw: str | None, disk_bw: str | None, pcie_bw: str | None, nodes: int | None) -> Hardware:
    """Flags override the preset field by field (--gpu replaces its GPUs, --gpu-bw sets every GPU's)."""
    out = hw
    if gpus:
        bw = hw.gpus[0].bandwidth if hw.gpus else DEFAULT_GPU_BW
        out = replace(out, gpus=tuple(GPU(f"gpu{i}", parse_size(g, "--gpu"), bw) for i, g in enumerate(gpus)))
    if gpu_bw is not None:
        b = parse_bandwidth(gpu_bw, "--gpu-bw")
        out = replace(out, gpus=tuple(replace(g, bandwidth=b) for g in out.gpus))
    if ram is not None:
        out = replace(out, ram=parse_size(ram, "--ram"))
    if ram_bw is not None:
        out = replace(out, ram_bw=parse_bandwidth(ram_bw, "--ram-bw"))
    if disk_bw is not None:
        out = replace(out, disk_bw=parse_bandwidth(disk_bw, "--disk-bw"))
    if pcie_bw is not None:
        out = replace(out, pcie_bw=parse_bandwidth(pcie_bw, "--pcie-bw"))
    if nodes is not None:
        if nodes < 1:
            raise K3Error(f"--nodes {nodes}: must be >= 1")
        out = replace(out, nodes=nodes)
    if out.ram is None:
        raise K3Error("--ram is required (e.g. --ram 128GiB), or a --hardware preset that states it")
    return out
