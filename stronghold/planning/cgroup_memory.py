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

CGROUP = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
UNLIMITED = 2 ** 60
"""v1 writes "no limit" as a page-aligned LONG_MAX; any limit at or above this is none."""


def cgroup_available(root: Path = CGROUP, proc: Path = PROC_CGROUP) -> Optional[int]:
    """Bytes this process's memory cgroup lets it add, or None where no limit applies (or none can be read)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found = _v2(root, path)
            if found is not None:
                return found
        elif "memory" in controllers.split(","):
            return _v1(root / "memory" / path.lstrip("/"))
    return None


def _stat(directory: Path, key: str) -> int:
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _number(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < UNLIMITED else None


def _v2(root: Path, path: str) -> Optional[int]:
    """The tightest headroom over the cgroup at `path` and its ancestors (a container's own root included)."""
    directory = root / path.lstrip("/")
    headrooms = []
    while True:
        limit = _number(directory / "memory.max")
        if limit is not None:
            held = (_number(directory / "memory.current") or 0) - _stat(directory, "inactive_file")
            headrooms.append(max(0, limit - max(0, held)))
        if directory == root or root not in directory.parents:
            break
        directory = directory.parent
    return min(headrooms) if headrooms else None


def _v1(directory: Path) -> Optional[int]:
    hierarchical = _stat(directory, "hierarchical_memory_limit")
    limits = [_number(directory / "memory.limit_in_bytes"), hierarchical if 0 < hierarchical < UNLIMITED else None]
    limits = [limit for limit in limits if limit is not None]
    if not limits:
        return None
    held = (_number(directory / "memory.usage_in_bytes") or 0) - _stat(directory, "total_inactive_file")
    return max(0, min(limits) - max(0, held))
