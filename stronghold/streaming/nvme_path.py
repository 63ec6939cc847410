"""Where the NVMe tier may keep its state files (`nvme_path`): a directory this process can write to, on a drive, not
on a filesystem whose files are host memory."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional


RAM_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose files are host memory: states written there take the memory the tier is meant to free, after
the plan counted it free (a /tmp on tmpfs, /dev/shm)."""


MOUNTS = "/proc/self/mounts"
"""The mount table `filesystem_type` reads (a seam for tests, whose temporary directories may be on tmpfs)."""


def filesystem_type(path: Path, mounts: Optional[str] = None) -> Optional[str]:
    """The type of the filesystem `path` is on (the mount point that is its longest prefix), or None where the mount
    table cannot be read (not Linux)."""
    try:
        lines = Path(MOUNTS if mounts is None else mounts).read_text().splitlines()
    except OSError:
        return None
    target, best = str(path.resolve()), None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and (
                best is None or len(point) >= len(best[0])):
            best = (point, fields[2])
    return best[1] if best else None


def check_path(nvme_path: str, mounts: Optional[str] = None) -> Path:
    """`nvme_path` as a directory this process can write to on a drive, or a ValueError that says what is wrong."""
    path = Path(nvme_path).expanduser()
    if not path.is_dir():
        raise ValueError(f"stronghold.nvme_path {nvme_path!r} is not a directory; create it on the NVMe drive "
                         "(mkdir -p) or point nvme_path at an existing one")
    kind = filesystem_type(path, mounts)
    if kind in RAM_FILESYSTEMS:
        raise ValueError(f"stronghold.nvme_path {nvme_path!r} is on {kind}, which keeps its files in host memory: the "
                         "NVMe tier's states there would take the memory it is meant to free. Point nvme_path at a "
                         "directory on a drive (`df -T DIR` names a directory's filesystem)")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ValueError(f"stronghold.nvme_path {nvme_path!r} is not writable by this process ({err.strerror}); "
                         "pick a directory you can write to") from None
    return path
