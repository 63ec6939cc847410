"""This process's cgroups (Linux): where a container's or a batch job's limits on cores, CPU time and memory are.

A process in a container (Docker, a Kubernetes pod, a SLURM job with cgroup enforcement) sees the whole host in
/proc/cpuinfo and /proc/meminfo; the limits that bind are in the cgroup files of its own cgroup and its ancestors
(each limit covers everything below it). cgroup v2 has one unified hierarchy; v1 one per controller, mounted under
the controller's name. `directories(controller)` lists this process's directories for a controller, innermost first,
v2's before v1's; the limits below read the files they need there and take the tightest.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc/self/cgroup")
UNLIMITED = 2 ** 60
"""v1 writes "no limit" as a page-aligned LONG_MAX; any limit at or above this is none."""


def directories(controller: str, root: Path = ROOT, proc: Path = PROC) -> list[list[Path]]:
    """For each hierarchy that has `controller` for this process (v2's unified one, then v1's): its cgroup directory
    and every ancestor up to the hierarchy's root, innermost first. Empty where /proc/self/cgroup cannot be read."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return []
    found: list[list[Path]] = []
    for line in sorted(lines, key=lambda text: not text.startswith("0::")):  # v2 first
        try:
            _, controllers, path = line.split(":", 2)
        except ValueError:
            continue
        if controllers == "":
            base = root if not (root / "unified").is_dir() or (root / "cgroup.controllers").exists() else \
                root / "unified"
        elif controller in controllers.split(","):
            base = root / controller if (root / controller).is_dir() else root / controllers
        else:
            continue
        found.append(_up_to(base / path.lstrip("/"), base))
    return found


def _up_to(directory: Path, base: Path) -> list[Path]:
    chain = [directory]
    while chain[-1] != base and base in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def read_number(path: Path) -> Optional[int]:
    """An integer file, or None where it is absent, unreadable or says "max"."""
    try:
        text = path.read_text().split()
    except OSError:
        return None
    try:
        return int(text[0]) if text and text[0] != "max" else None
    except ValueError:
        return None


def read_stat(path: Path, key: str) -> int:
    """`key`'s value in a flat-keyed stat file (memory.stat), or 0."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cpu_quota(root: Path = ROOT, proc: Path = PROC) -> Optional[float]:
    """CPUs' worth of time the cgroup's CPU bandwidth limit gives this process and everything in its cgroup (v2
    `cpu.max`, v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us`; the tightest over the cgroup and its ancestors), or
    None where none is set. A Kubernetes CPU limit or Docker's `--cpus` is one: the cores stay visible, the time
    does not, and threads beyond it are throttled for whole periods at a time."""
    quotas = []
    for chain in directories("cpu", root, proc):
        for directory in chain:
            try:
                fields = (directory / "cpu.max").read_text().split()
            except OSError:
                fields = []
            if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:
                quotas.append(int(fields[0]) / int(fields[1]))
            quota, period = read_number(directory / "cpu.cfs_quota_us"), read_number(directory / "cpu.cfs_period_us")
            if quota is not None and quota > 0 and period:
                quotas.append(quota / period)
    return min(quotas) if quotas else None


def memory_available(root: Path = ROOT, proc: Path = PROC) -> Optional[int]:
    """Bytes this process's memory cgroup lets it add, or None where no limit applies (or none can be read): the
    tightest headroom over the cgroup and its ancestors, each limit less what that cgroup holds that the kernel cannot
    take back without a write (its inactive file pages, the page cache of a dataset read once, are not counted). A
    process in a container sees the whole host in /proc/meminfo, so the memory "available" there can be several times
    what the kernel will let it have. v2: `memory.max`, `memory.current`, `inactive_file`; v1: `memory.limit_in_bytes`,
    `hierarchical_memory_limit`, `memory.usage_in_bytes`, `total_inactive_file`."""
    headrooms = []
    for chain in directories("memory", root, proc):
        for directory in chain:
            stat = directory / "memory.stat"
            v2 = _limit(read_number(directory / "memory.max"))
            if v2 is not None:
                held = (read_number(directory / "memory.current") or 0) - read_stat(stat, "inactive_file")
                headrooms.append(max(0, v2 - max(0, held)))
            v1 = [limit for limit in (_limit(read_number(directory / "memory.limit_in_bytes")),
                                      _limit(read_stat(stat, "hierarchical_memory_limit") or None)) if limit]
            if v1:
                held = (read_number(directory / "memory.usage_in_bytes") or 0) - read_stat(stat, "total_inactive_file")
                headrooms.append(max(0, min(v1) - max(0, held)))
    return min(headrooms) if headrooms else None


def _limit(value: Optional[int]) -> Optional[int]:
    return value if value is not None and value < UNLIMITED else None
