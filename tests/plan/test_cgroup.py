"""A container's memory limit (k3kit.plan.cgroup): read from cgroup v1 and v2 trees laid out as the
kernel and the container runtimes lay them out (built under tmp_path), the smallest limit of a
group and its ancestors, what the group has left, and every malformed or missing file meaning
"no limit known", never an error; `mem_available` and `plan`'s RAM take the smaller figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3kit.plan import cgroup, expert_io, hardware

GIB = 1 << 30


def write(d: Path, **files: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(text)
    return d


def proc(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "proc_cgroup"
    p.write_text(text)
    return p


def v2_root(tmp_path: Path) -> Path:
    return write(tmp_path / "fs", cgroup__controllers="cpu memory io\n")


def test_v2_takes_the_smallest_limit_of_the_group_and_its_ancestors(tmp_path):
    root = v2_root(tmp_path)
    write(root / "kubepods", memory__max=str(8 * GIB))
    write(root / "kubepods" / "pod1", memory__max="max", memory__current=str(3 * GIB),
          memory__stat=f"anon {GIB}\nfile {2 * GIB}\ninactive_file {GIB}\n")
    g = cgroup.group_memory(root, proc(tmp_path, "0::/kubepods/pod1\n"))
    assert g is not None and g.version == 2
    assert g.limit == 8 * GIB and g.used == 3 * GIB and g.reclaimable == GIB
    assert g.available == 6 * GIB                      # 8 - (3 - 1): the inactive page cache gives way


def test_v2_unlimited_everywhere_is_no_limit(tmp_path):
    root = v2_root(tmp_path)
    write(root / "user.slice", memory__max="max", memory__current="12345")
    assert cgroup.group_memory(root, proc(tmp_path, "0::/user.slice\n")) is None


def test_v1_uses_the_hierarchical_limit(tmp_path):
    mem = write(tmp_path / "fs" / "memory" / "docker" / "abc", memory__limit_in_bytes="9223372036854771712",
                memory__usage_in_bytes=str(5 * GIB),
                memory__stat=f"cache 100\nhierarchical_memory_limit {16 * GIB}\n"
                             f"total_inactive_file {2 * GIB}\n")
    g = cgroup.group_memory(tmp_path / "fs", proc(tmp_path, "4:memory:/docker/abc\n3:cpu:/\n0::/\n"))
    assert g is not None and g.version == 1 and g.where == str(mem)
    assert g.limit == 16 * GIB and g.available == 13 * GIB


def test_a_container_reads_its_own_group_at_the_mount_root(tmp_path):
    # the path names the host's group, the runtime mounted the container's group at the root
    write(tmp_path / "fs" / "memory", memory__limit_in_bytes=str(4 * GIB), memory__usage_in_bytes=str(GIB),
          memory__stat="total_inactive_file 0\n")
    g = cgroup.group_memory(tmp_path / "fs", proc(tmp_path, "7:memory:/docker/0123abcd\n"))
    assert g is not None and g.limit == 4 * GIB and g.available == 3 * GIB


def test_the_hybrid_layouts_v2_mount(tmp_path):
    unified = write(tmp_path / "fs" / "unified", cgroup__controllers="memory\n")
    write(unified / "svc", memory__max=str(2 * GIB), memory__current=str(GIB))
    g = cgroup.group_memory(tmp_path / "fs", proc(tmp_path, "0::/svc\n"))
    assert g is not None and g.limit == 2 * GIB


@pytest.mark.parametrize("files,line", [
    ({"memory__max": "lots", "memory__current": "1"}, "0::/g\n"),           # not a number
    ({"memory__max": "-5", "memory__current": "1"}, "0::/g\n"),             # negative
    ({"memory__max": str(GIB)}, "0::/g\n"),                                 # no current
    ({"memory__max": str(GIB), "memory__current": "1"}, "garbage\n"),       # no group line
    ({"memory__max": str(GIB), "memory__current": "\x00\xff"}, "0::/g\n"),  # binary
])
def test_malformed_files_mean_no_limit_known(tmp_path, files, line):
    root = v2_root(tmp_path)
    write(root / "g", **files)
    assert cgroup.group_memory(root, proc(tmp_path, line)) is None


def test_a_path_that_climbs_out_is_read_at_the_root(tmp_path):
    root = v2_root(tmp_path)
    write(root, memory__max=str(GIB), memory__current="0")
    write(tmp_path / "outside", memory__max=str(7), memory__current="0")
    g = cgroup.group_memory(root, proc(tmp_path, "0::/../outside\n"))
    assert g is not None and g.limit == GIB


def test_no_cgroup_filesystem_is_no_limit(tmp_path):
    assert cgroup.group_memory(tmp_path / "none", tmp_path / "no_proc") is None


def test_mem_available_and_plans_ram_take_the_groups_smaller_figure(tmp_path, monkeypatch):
    root = v2_root(tmp_path)
    write(root / "box", memory__max=str(GIB), memory__current=str(GIB // 4), memory__stat="inactive_file 0\n")
    monkeypatch.setenv("K3KIT_CGROUP_ROOT", str(root))
    monkeypatch.setenv("K3KIT_PROC_CGROUP", str(proc(tmp_path, "0::/box\n")))
    assert expert_io.mem_available() == GIB - GIB // 4
    hw = hardware.measure_local([])
    assert hw.ram == GIB
    assert any("control group" in n for n in hw.notes)


# -- CPU quotas ---------------------------------------------------------------------------------------

def test_v2_cpu_quota_is_the_smallest_of_the_group_and_its_ancestors(tmp_path):
    root = v2_root(tmp_path)
    write(root / "kubepods", cpu__max="300000 100000\n")
    write(root / "kubepods" / "pod1", cpu__max="max 100000\n")
    assert cgroup.cpu_limit(root, proc(tmp_path, "0::/kubepods/pod1\n")) == 3.0
    write(root / "kubepods" / "pod1", cpu__max="150000 100000\n")
    assert cgroup.cpu_limit(root, proc(tmp_path, "0::/kubepods/pod1\n")) == 1.5


def test_v1_cpu_quota_and_no_quota(tmp_path):
    cpu = write(tmp_path / "fs" / "cpu" / "docker" / "abc", cpu__cfs_quota_us="200000\n",
                cpu__cfs_period_us="100000\n")
    line = "5:cpu,cpuacct:/docker/abc\n"
    assert cgroup.cpu_limit(tmp_path / "fs", proc(tmp_path, line)) == 2.0
    write(cpu, cpu__cfs_quota_us="-1\n")
    assert cgroup.cpu_limit(tmp_path / "fs", proc(tmp_path, line)) is None


@pytest.mark.parametrize("text", ["lots 100000", "100000", "0 100000", "100000 0", "1 2 3", "\x00"])
def test_a_malformed_cpu_max_is_no_quota(tmp_path, text):
    root = v2_root(tmp_path)
    write(root / "g", cpu__max=text)
    assert cgroup.cpu_limit(root, proc(tmp_path, "0::/g\n")) is None


def test_commands_take_no_more_threads_than_the_quota(tmp_path, monkeypatch):
    import torch

    from k3kit.cli import build_parser
    from k3kit.commands.generate import apply_threads
    root = v2_root(tmp_path)
    write(root / "box", cpu__max="100000 100000\n")
    monkeypatch.setenv("K3KIT_CGROUP_ROOT", str(root))
    monkeypatch.setenv("K3KIT_PROC_CGROUP", str(proc(tmp_path, "0::/box\n")))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert apply_threads(build_parser().parse_args(["generate", "--prompt", "x"])) == 1
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)                            # the user's count is the user's
        assert apply_threads(build_parser().parse_args(["generate", "--prompt", "x", "--threads", "2"])) == 2
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")          # so is OMP_NUM_THREADS
        assert apply_threads(build_parser().parse_args(["generate", "--prompt", "x"])) == 0
        assert torch.get_num_threads() == 2
        assert "CPU quota: 1 CPUs" in " ".join(hardware.measure_local([]).notes)
    finally:
        torch.set_num_threads(before)
