"""This process's cgroups (stronghold/cgroups.py): a container's CPU quota, as the kernel lays out its files (v2 and
v1 trees in a temporary directory), and the CPU AdamW's default thread count under it."""
from stronghold import cgroups
from stronghold.optim import cpu_adam


def _tree(tmp_path, proc_text: str, files: dict) -> tuple:
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    proc.write_text(proc_text)
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root, proc


def test_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    root, proc = _tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cgroup.controllers": "cpu memory\n", "kubepods/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "400000 100000\n", "kubepods/pod1/ctr/cpu.max": "250000 50000\n"})
    assert cgroups.cpu_quota(root, proc) == 4.0
    (root / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    assert cgroups.cpu_quota(root, proc) == 5.0
    (root / "kubepods/pod1/ctr/cpu.max").write_text("max 100000\n")
    assert cgroups.cpu_quota(root, proc) is None


def test_v1_quota_reads_the_cpu_controller(tmp_path):
    root, proc = _tree(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroups.cpu_quota(root, proc) == 1.5
    assert cgroups.cpu_quota(root, tmp_path / "missing") is None


def test_the_cpu_adamw_threads_fit_the_ranks_part_of_the_quota(monkeypatch):
    monkeypatch.setattr(cpu_adam.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setattr(cgroups, "cpu_quota", lambda: None)
    assert cpu_adam.default_threads() == 63
    monkeypatch.setattr(cgroups, "cpu_quota", lambda: 8.5)
    assert cpu_adam.default_threads() == 8  # 9 cores' worth, one kept for the launching thread
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_adam.default_threads() == 4  # two ranks share the quota: ceil(4.25) - 1
    monkeypatch.setattr(cgroups, "cpu_quota", lambda: 0.5)
    assert cpu_adam.default_threads() == 1
