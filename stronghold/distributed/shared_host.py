"""One node-shared host copy of the streamed blocks' working weights, and the cross-rank "ready" signal.

With data parallel every local rank streams the same weights, so the node keeps one copy: a file in
/dev/shm mapped MAP_SHARED by every local rank (`torch.from_file(shared=True)`). Each rank's CPU AdamW
writes only its shard of each block into it (data_parallel.py), so before a rank's H2D of block i may
read it, every local rank must have finished its part of block i's update. Layout of the segment:

    int64 published[blocks][local ranks]   epoch each rank last finished block i at
    int64 pids[local ranks]                who to blame when a rank is gone
    working copy of block 0, 1, ...        each aligned to ALIGN bytes

Why a /dev/shm file rather than torch's shared-memory storages: the name can be agreed with one small
all_gather, every rank maps it itself (no file descriptors passed between processes), and local rank
0 unlinks it as soon as every rank has mapped it, so a crash can never leave it behind; the mappings
live on until the processes exit. On a GPU the mapping is registered for DMA with cudaHostRegister
(`register_for_dma`), so the H2D copies from it run asynchronously as from pinned memory.

The signal is a per-block, per-rank epoch counter in the segment. `epoch` counts the optimizer steps
(and checkpoint loads) every rank has agreed on; a rank publishes (block, epoch) from its CPU
optimizer's worker after the jobs that finish block i for that step (the worker runs jobs in order),
and a rank that wants to load block i waits until every rank's counter reaches its own epoch: no
global barrier, no device sync, only the blocks that are late are waited for. A read of the whole copy
outside the window (runtime.synchronize: state_dict, checkpoints) waits for every streamed block (`wait_all`).
The counters are written after the weights by the same thread; x86 keeps stores in order (TSO). A
weakly ordered host (Arm) would need a release fence before the counter store: not built, the GPU hosts
here are x86.

Across nodes each node keeps its own shared copy; after a rank updates its shard of a block, the other nodes'
shards arrive by the cross-node exchange (nodes.py) before the block is published.
"""
from __future__ import annotations

import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from stronghold.streaming.pinned import host_register, host_unregister

ALIGN = 4096
"""Bytes: each block's working copy starts on a page, so registering and DMA never straddle blocks."""
POLL_S = 2e-4
"""Sleep between polls of a counter that is not there yet (the wait is rare: prefetch skips such blocks)."""


@dataclass(frozen=True, kw_only=True)
class SharedCopyConfig:
    local_rank: int
    local_world: int
    global_ranks: tuple[int, ...]
    """Global rank of each local rank (for messages)."""
    timeout_s: float = 300.0
    """How long a load waits for another rank's update of a block before failing (naming it)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class NodeSharedCopy:
    """The mapping and its counters; build with `create_shared_copy` (a collective over the node)."""

    def __init__(self, path: str, sizes: dict[int, tuple[int, torch.dtype]], config: SharedCopyConfig):
        self.path, self.config = path, config
        self.rows = {index: row for row, index in enumerate(sorted(sizes))}
        offsets, at = _layout(sizes, config.local_world)
        self.nbytes = at
        self.raw = torch.from_file(path, shared=True, size=at, dtype=torch.uint8)
        counters = self.raw[:8 * (len(sizes) + 1) * config.local_world].view(torch.int64)
        self.published = counters[:len(sizes) * config.local_world].view(len(sizes), config.local_world)
        self.pids = counters[len(sizes) * config.local_world:]
        self.working = {index: self.raw[offsets[index]:offsets[index] + numel * _itemsize(dtype)].view(dtype)
                        for index, (numel, dtype) in sizes.items()}
        self.epoch = 0
        """Steps (and loads) agreed by every rank so far: what a load waits for."""
        self.check: Optional[Callable[[], None]] = None
        """Raises this rank's CPU optimizer's failure (`watch`): its own publication will not come."""
        self.registered = False

    def advance_epoch(self) -> int:
        """One more step (or load) agreed by every rank: the epoch loads now wait for."""
        self.epoch += 1
        return self.epoch

    def watch(self, check: Callable[[], None]) -> None:
        """`check` raises the CPU optimizer's failure: a wait for this rank's own publication calls it, so a failed
        update (or exchange) fails the wait at once instead of at the stall timeout."""
        self.check = check

    def register_for_dma(self, device: torch.device) -> None:
        """Page-lock the mapping for the GPU's copy engines (untestable on the CPU: guarded by device type)."""
        if device.type != "cuda" or self.registered:
            return
        status = host_register(self.raw.data_ptr(), self.nbytes, portable=True)
        if status != 0:
            raise RuntimeError(f"stronghold: cudaHostRegister of the node-shared working copy ({self.nbytes} bytes "
                               f"at {self.path}) failed with CUDA error {status}; raise the locked-memory limit "
                               "(ulimit -l) or run one rank per node")
        self.registered = True

    def publish(self, index: int, epoch: int) -> None:
        """This rank finished its shard of block `index` for `epoch` (called after its writes, same thread)."""
        self.published[self.rows[index], self.config.local_rank] = epoch

    def ready(self, index: int) -> bool:
        return bool((self.published[self.rows[index]] >= self.epoch).all())

    def wait(self, index: int) -> None:
        """Wait until every local rank has published block `index` at the current epoch; fail naming the
        ranks that did not, when one has exited or after `timeout_s`."""
        if self.ready(index):
            return
        deadline = time.monotonic() + self.config.timeout_s
        while not self.ready(index):
            if self.check is not None:
                self.check()
            late = [r for r in range(self.config.local_world) if int(self.published[self.rows[index], r]) < self.epoch]
            dead = [r for r in late if not _alive(int(self.pids[r]))]
            if dead:
                # Name the dead ranks only: the others, this one included (its own publication may be the
                # next job of its worker), are late because they are still working, not the cause.
                raise RuntimeError(self._message(index, dead, f"rank {self._names(dead)} exited"))
            if time.monotonic() > deadline:
                raise TimeoutError(self._message(index, late, f"waited {self.config.timeout_s:.0f} s"))
            time.sleep(POLL_S)

    def wait_all(self, indices: Iterable[int]) -> None:
        """`wait` for each of these blocks: the streamed ones. A block promoted to the GPU keeps its rows in the
        mapping but is published no more, so a wait for it would never end."""
        for index in indices:
            self.wait(index)

    def dead_ranks(self) -> list[int]:
        """Global ranks of the local ranks whose process has exited."""
        return [self.config.global_ranks[r] for r in range(self.config.local_world) if not _alive(int(self.pids[r]))]

    def _names(self, local: list[int]) -> str:
        return ", ".join(str(self.config.global_ranks[r]) for r in local)

    def _message(self, index: int, late: list[int], why: str) -> str:
        return (f"stronghold: block {index}'s update for step {self.epoch} never arrived from rank "
                f"{self._names(late)} ({why}); every rank streams the node-shared weights and must update its "
                "shard of each block. Check that rank's log for the first error.")

    def close(self) -> None:
        if self.registered:
            host_unregister(self.raw.data_ptr())
            self.registered = False


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not registered yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited rank stays a zombie until its launcher reaps it: that is not alive either
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's shard of `numel` elements: equal shards of ceil(numel / world) (the last ones
    shorter or empty), so the reduce-scatter input is padded to shard * world."""
    size = math.ceil(numel / world) if numel else 0
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def create_shared_copy(sizes: dict[int, tuple[int, torch.dtype]], config: SharedCopyConfig, gather,
                       directory: str = "/dev/shm") -> NodeSharedCopy:
    """Collective over the node's ranks: local rank 0 creates the segment, every rank maps it, then local
    rank 0 unlinks its name. `gather(value)` all-gathers a picklable value over the node's ranks."""
    name = gather(f"stronghold-{uuid.uuid4().hex}" if config.local_rank == 0 else None)[0]
    path = os.path.join(directory if os.path.isdir(directory) else "/tmp", name)
    failure = None
    if config.local_rank == 0:
        size = _layout(sizes, config.local_world)[1]
        try:
            # A tmpfs takes a file larger than its free space and kills the first write past it with SIGBUS: a
            # container's /dev/shm is 64 MiB unless it was started with more.
            free = shutil.disk_usage(os.path.dirname(path)).free
            if free < size:
                failure = (f"it needs {size / 2 ** 30:.2f} GiB and {os.path.dirname(path)} has "
                           f"{free / 2 ** 30:.2f} GiB free; in a container, start it with a larger --shm-size "
                           "(or --ipc=host)")
            else:
                with open(path, "wb") as f:
                    os.ftruncate(f.fileno(), size)
        except OSError as err:
            failure = f"{type(err).__name__}: {err}"
    failures = [f for f in gather(failure) if f]
    if failures:
        raise MemoryError(f"stronghold: the node-shared working copy could not be created at {path} ({failures[0]}); "
                          "free host memory (/dev/shm) or use fewer streamed blocks")
    try:
        shared = NodeSharedCopy(path, sizes, config)
        shared.pids[config.local_rank] = os.getpid()
    finally:
        try:
            gather(None)  # every rank has mapped it (or failed): the name is no longer needed
        finally:
            # Also where that gather failed (a rank died while mapping): the name would outlive the job in /dev/shm.
            if config.local_rank == 0:
                os.unlink(path)
    return shared


def _itemsize(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _layout(sizes: dict[int, tuple[int, torch.dtype]], local_world: int) -> tuple[dict[int, int], int]:
    """Byte offset of each block's working copy in the segment, and the segment's size."""
    offsets, at = {}, _align(8 * (len(sizes) + 1) * local_world)
    for index in sorted(sizes):
        numel, dtype = sizes[index]
        offsets[index] = at
        at = _align(at + numel * _itemsize(dtype))
    return offsets, at
