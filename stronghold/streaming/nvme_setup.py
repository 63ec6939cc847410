"""Setting up the NVMe tier (nvme.py): how many blocks go to the drive where the runtime decides (no plan: the CPU),
the drive's free space checked before anything is allocated, and the tier built block by block. Once every state file
is open (and nameless: nvme_io.DirectFiles.open) the tier's directory goes too, so a job killed at any point after
set-up leaves nothing under `nvme_path`."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from stronghold.optim.adamw_kernel import AdamWKernel
from stronghold.planning.plan_types import DRIVE_SLOTS
from stronghold.streaming.nvme import NvmeStates, state_file_bytes
from stronghold.streaming.nvme_path import check_path

logger = logging.getLogger(__name__)

GIB = 2 ** 30


def check_space(path: Path, needed_bytes: int) -> None:
    free = shutil.disk_usage(path).free
    if needed_bytes > free:
        raise ValueError(f"stronghold.nvme_path {str(path)!r}: the NVMe tier needs {needed_bytes / GIB:.2f} GiB for "
                         f"the optimizer states of its blocks ({needed_bytes} bytes) but the drive has "
                         f"{free / GIB:.2f} GiB ({free} bytes) free; free "
                         "space there, point nvme_path at a larger drive, or put fewer blocks on it "
                         "(\"nvme_blocks\", or a larger \"host_memory_limit_gb\")")


def count_on_drive(check: Callable[[int], None], streamed: int, wanted: Optional[int]) -> int:
    """Blocks whose states go to the drive: `wanted` (clamped to the `streamed` blocks) once `check(count)` passes,
    or for None the fewest that pass it (`check` raises MemoryError when the host cannot hold the rest; with none
    passing, the error for all of them on the drive)."""
    if wanted is not None:
        check(min(wanted, streamed))
        return min(wanted, streamed)
    for count in range(streamed + 1):
        try:
            check(count)
            return count
        except MemoryError:
            if count == streamed:
                raise
    return 0


def build_on_drive(nvme_path: str, layouts: dict, compute_dtype: torch.dtype, build: Callable,
                   slots: int = DRIVE_SLOTS, host=None, compact: Optional[AdamWKernel] = None
                   ) -> tuple[NvmeStates, dict]:
    """The tier for the blocks of `layouts` (index -> store.ParamEntry list) and their stores, built by `build(index,
    entries)` one at a time, each moved to its file before the next: the host holds one block's fp32 master at most
    beyond the staging buffers. Checks the path and the drive's free space first, before anything is allocated.
    `compact`: the kernel of compact masters (NvmeStates)."""
    path = check_path(nvme_path)
    trainable = {i: sum(e.numel for e in entries if e.group is not None) for i, entries in layouts.items()}
    check_space(path, sum(state_file_bytes(t, compute_dtype, compact is not None) for t in trainable.values()))
    # A buffer per block at most: with as many, each block stays in its own and is never read back.
    tier = NvmeStates(path, compute_dtype, max(trainable.values()), slots=min(slots, len(layouts)), host=host,
                      compact=compact)
    stores = {}
    for index, entries in sorted(layouts.items()):
        stores[index] = build(index, entries)
        try:
            tier.add(stores[index])
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            tier.close()
            raise ValueError(f"stronghold.nvme_path {str(path)!r}: the drive filled up while the NVMe tier reserved "
                             f"its files (block {index} of {min(layouts)}-{max(layouts)}; the check before start-up "
                             f"saw room for all): something else is writing there. Free space on the drive or point "
                             "nvme_path at another one") from err
    tier.wait_writes()
    with contextlib.suppress(OSError):  # every file is open and has no name: the directory is empty
        os.rmdir(tier.directory)
    logger.info(f"stronghold NVMe tier: the states of blocks {min(layouts)}-{max(layouts)} "
                f"({tier.bytes_on_drive / GIB:.2f} GiB) in nameless files under {path} "
                f"({'O_DIRECT' if tier.io.direct else 'buffered'}, {len(tier.slots)} staging buffers)")
    return tier, stores
