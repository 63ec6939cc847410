"""A container's memory limit (cgroups.memory_available) bounds the host budget: cgroup v2 and v1 trees written in a
temporary directory, as the kernel lays them out."""
from pathlib import Path

import psutil

from stronghold import cgroups
from stronghold.cgroups import memory_available as cgroup_available
from stronghold.planning import plan_inputs

GIB = 2 ** 30


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_v2_takes_the_tightest_headroom_of_the_cgroup_and_its_ancestors(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    proc.write_text("0::/job/step\n")
    _write(root / "job", memory_max=str(10 * GIB), memory_current=str(4 * GIB), memory_stat="inactive_file 0\n")
    _write(root / "job" / "step", memory_max="max", memory_current=str(3 * GIB),
           memory_stat=f"anon 1\ninactive_file {GIB}\n")
    assert cgroup_available(root, proc) == 6 * GIB  # the job's limit binds: 10 GiB less the 4 it holds
    _write(root / "job" / "step", memory_max=str(5 * GIB))
    assert cgroup_available(root, proc) == 3 * GIB  # the step's: 5 less 3, of which 1 is reclaimable page cache
    _write(root / "job", memory_max="max")
    _write(root / "job" / "step", memory_max="max")
    assert cgroup_available(root, proc) is None, "no limit anywhere"


def test_v1_reads_the_memory_controller_and_its_hierarchical_limit(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/docker/abc\n0::/\n")
    unlimited = "9223372036854771712"
    _write(root / "memory" / "docker" / "abc", memory_limit_in_bytes=unlimited, memory_usage_in_bytes=str(2 * GIB),
           memory_stat=f"hierarchical_memory_limit {8 * GIB}\ntotal_inactive_file {GIB}\n")
    assert cgroup_available(root, proc) == 7 * GIB
    _write(root / "memory" / "docker" / "abc", memory_stat=f"hierarchical_memory_limit {unlimited}\n")
    assert cgroup_available(root, proc) is None
    assert cgroup_available(root, tmp_path / "missing") is None, "no /proc/self/cgroup: nothing to bound by"


def test_the_host_budget_is_the_containers_where_that_is_tighter(monkeypatch):
    available = psutil.virtual_memory().available
    monkeypatch.setattr(cgroups, "memory_available", lambda: 3 * GIB)
    assert plan_inputs.host_available(None) == min(available, 3 * GIB)
    monkeypatch.setattr(cgroups, "memory_available", lambda: None)
    assert abs(plan_inputs.host_available(None) - psutil.virtual_memory().available) < GIB
