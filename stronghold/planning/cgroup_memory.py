"""The memory a container lets this process still take: its memory cgroup's limit less what the cgroup holds.

A process in a container (Docker's `--memory`, a Kubernetes pod's limit, a SLURM job's `--mem` with cgroup
enforcement) sees the whole host in /proc/meminfo, so the memory "available" there can be several times what the
kernel will let it have: a plan made from it is killed by the OOM killer part-way into its first step. The limit that
binds is the tightest of the cgroup's and its ancestors' (each counts the memory of everything below it); what each
already holds that the kernel can take back without a write (inactive file pages, the page cache of a dataset read
once) is not counted as held.

cgroup v2 (one unified hierarchy: `memory.max`, `memory.current`, `inactive_file` in `memory.stat`), else v1 (the
`memory` controller: `memory.limit_in_bytes`, `memory.usage_in_bytes`, `hierarchical_memory_limit` and
`total_inactive_file` in `memory.stat`). Where neither is readable, or no limit is set, there is nothing to add.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from stronghold import cgroups

UNLIMITED = 2 ** 60
"""v1 writes "no limit" as a page-aligned LONG_MAX; any limit at or above this is none."""


def cgroup_available(root: Path = cgroups.ROOT, proc: Path = cgroups.PROC) -> Optional[int]:
    """Bytes this process's memory cgroup lets it add, or None where no limit applies (or none can be read)."""
    headrooms = []
    for chain in cgroups.directories("memory", root, proc):
        for directory in chain:
            v2 = _limit(directory / "memory.max")
            if v2 is not None:
                held = (cgroups.read_number(directory / "memory.current") or 0) - cgroups.read_stat(
                    directory / "memory.stat", "inactive_file")
                headrooms.append(max(0, v2 - max(0, held)))
            v1 = _limit(directory / "memory.limit_in_bytes")
            hierarchical = cgroups.read_stat(directory / "memory.stat", "hierarchical_memory_limit")
            v1_limits = [limit for limit in (v1, hierarchical if 0 < hierarchical < UNLIMITED else None)
                         if limit is not None]
            if v1_limits:
                held = (cgroups.read_number(directory / "memory.usage_in_bytes") or 0) - cgroups.read_stat(
                    directory / "memory.stat", "total_inactive_file")
                headrooms.append(max(0, min(v1_limits) - max(0, held)))
    return min(headrooms) if headrooms else None


def _limit(path: Path) -> Optional[int]:
    value = cgroups.read_number(path)
    return value if value is not None and value < UNLIMITED else None
