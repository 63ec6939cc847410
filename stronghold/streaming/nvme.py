"""The NVMe tier: streamed blocks whose fp32 AdamW state (exp_avg, exp_avg_sq, and in bf16/fp16 the master) lives
in files on a drive instead of host memory (`nvme_path`).

Each such block has one scratch file under a directory of its own made under `nvme_path` (each file's name removed as
soon as it is open, so its space goes with the process however it ends; the directory removed once every file is open,
nvme_setup.py, or at `close()` and at exit): its master (bf16/fp16 only: in fp32 the working copy is the master and
stays in host memory), exp_avg and exp_avg_sq, T fp32 elements each, back to back, the file padded to
nvme_io.ALIGN. A few staging
buffers (`slots`, each the largest such block's file) are the only host memory the tier's states take.

With compact masters (`compact`, compact.py) a file holds exp_avg, exp_avg_sq and the master's low half (int16): the
working copy in host memory is its high half, so the drive moves 10 bytes a parameter a step each way instead of 12.
The CPU update runs on the halves in the staging buffer in place (`hold_halves`: the kernel's `step_compact`); every
other hold merges the master into one fp32 buffer for its length and, if it writes, splits it back into the working
copy and the low half before the write-back, as compact.py's holds do.

Every read or write of a block's state goes through `hold(store)` (BlockStore.states()): the caller gets views of a
staging buffer holding the block's current state, read from its file if no buffer held it (a prefetch may already
have), and on leaving a writer's hold the buffer is written back behind the caller, asynchronously. The buffer keeps
the block's state while the write runs: a later hold of the same block takes it as it is, and another block gets the
buffer only after the write is done (its read is chained behind the write). So the state is always in exactly one
place that is current: a buffer that holds the block, else its file, and no read passes a write of the same block.

Read-ahead: `expect(stores)` queues the blocks the CPU optimizer will want next, in order (the runtime at the start
of a boundary backward: the streamed blocks in backward order; the worker as it queues each job); free buffers start
their reads at once, and each hold that ends lets the next queued block in. A buffer is free when no hold is open on
it and its block is not queued. Correctness never depends on read-ahead: `hold` reads on demand. Holds do not nest
within a thread; the CPU worker runs one job at a time and the main thread holds while it is idle (checkpoints, the
optimizer's state dict) or busy with other blocks (promotion): a hold that finds every buffer held waits for one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from stronghold.optim.adamw_kernel import AdamWKernel
from stronghold.planning import plan_bytes
from stronghold.planning.plan_types import DRIVE_SLOTS
from stronghold.streaming import nvme_io
from stronghold.streaming.nvme_io import DONE, DirectFiles, Transfer, aligned_buffer
from stronghold.streaming.pinned import HostMeter

logger = logging.getLogger(__name__)

States = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def state_kinds(compute_dtype: torch.dtype) -> int:
    return plan_bytes.state_kinds(compute_dtype.itemsize)


def state_file_bytes(trainable_numel: int, compute_dtype: torch.dtype, compact: bool = False) -> int:
    return plan_bytes.state_file_bytes(trainable_numel, compute_dtype.itemsize, compact)


@dataclass
class _Slot:
    buffer: torch.Tensor
    """uint8, page-aligned (nvme_io.aligned_buffer)."""
    index: Optional[int] = None
    """The block whose state the buffer holds (current unless a read into it is still running), or None."""
    transfer: Transfer = DONE
    """The last read into or write from the buffer."""
    holds: int = 0


@dataclass
class _File:
    fd: int
    nbytes: int
    trainable_numel: int
    written: Transfer = DONE
    """The last write of the block's state: a read of the file waits for it."""


@dataclass
class NvmeStats:
    read_bytes: int = 0
    written_bytes: int = 0
    wait_s: float = 0.0
    """Seconds holds waited for a read (or a buffer's write) to finish: what read-ahead did not hide."""
    holds: int = 0
    reads_on_demand: int = 0
    """Holds that found their block in no buffer and read it themselves."""


class NvmeStates:
    def __init__(self, path: Path, compute_dtype: torch.dtype, largest_trainable: int, slots: int = DRIVE_SLOTS,
                 threads: int = nvme_io.DEFAULT_THREADS, host=None, compact: Optional[AdamWKernel] = None):
        """`host`: the runtime's pinned.HostMeter, which counts the staging buffers. `compact`: the CPU AdamW kernel
        where the blocks keep compact masters (bf16 only; see the module docstring), else None."""
        if compact is not None and compute_dtype != torch.bfloat16:
            raise ValueError("a compact master needs a bf16 working copy")
        self.directory = Path(tempfile.mkdtemp(prefix="stronghold-nvme-", dir=path))
        self.compute_dtype = compute_dtype
        self.kinds = state_kinds(compute_dtype)
        self.compact = compact
        self.files: dict[int, _File] = {}
        self.io = DirectFiles(self.directory, threads)
        host = host if host is not None else HostMeter()
        nbytes = state_file_bytes(largest_trainable, compute_dtype, compact is not None)
        self.slots = [_Slot(host.track(aligned_buffer(nbytes))) for _ in range(slots)]
        self._merged = host.empty(largest_trainable, torch.float32) if compact is not None else None
        """Where a hold other than the update's merges a compact master (one at a time: `_merge_lock`)."""
        self._merge_lock = threading.Lock()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        """Notified when a hold ends: a hold that found every buffer held waits on it."""
        self._queue: deque[int] = deque()
        self._where: dict[int, _Slot] = {}
        self.stats = NvmeStats()
        self._closed = False
        # Scratch: the files go with the engine, or at exit if it is never closed.
        self._finalizer = weakref.finalize(self, _remove, self.directory, self.files, self.io)
        if not self.io.direct:
            logger.warning(f"stronghold NVMe tier: {path} does not take O_DIRECT (tmpfs or an overlay filesystem?); "
                           "the state files go through the page cache, which holds host memory the tier should save")

    @property
    def bytes_on_drive(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def add(self, store) -> None:
        """Move a freshly built store's fp32 state (store.master in bf16/fp16; the moments, zero) into its file and
        drop it from host memory: afterwards only `hold` reaches it (store.states())."""
        nbytes = state_file_bytes(store.trainable_numel, self.compute_dtype, self.compact is not None)
        fd = self.io.open(_file_name(store.index), nbytes)
        entry = self.files[store.index] = _File(fd, nbytes, store.trainable_numel)
        # bf16/fp16: the master (or its low half) and zero moments are written. fp32 has only the moments on the
        # drive, zero at the start: the fresh file's unwritten (sparse) range reads as zeros.
        if self.compact is not None and store.lean:
            raise ValueError("a compact master needs a working copy that is not lean")
        if self.kinds == 3:
            slot = self._free_slot()
            slot.transfer.wait()
            slot.index = None
            master, exp_avg, exp_avg_sq = self._views(slot, store)
            exp_avg.zero_()
            exp_avg_sq.zero_()
            if self.compact is not None:  # `master` is the low half's place
                self.compact.split_master(store.master, _high(store), master)
            else:
                master.copy_(store.master)
            entry.written = slot.transfer = self.io.write(fd, slot.buffer, nbytes)
            store.master = None
        store.exp_avg = store.exp_avg_sq = None
        store.tier = self

    # Holds -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, store, write: bool = True) -> Iterator[States]:
        """The block's (master, exp_avg, exp_avg_sq), current, for the duration; written back after if `write`."""
        slot = self._acquire(store)
        try:
            if self.compact is None:
                yield self._views(slot, store)
            else:
                low, exp_avg, exp_avg_sq = self._views(slot, store)
                with self._merge_lock:
                    master = self._merged[:low.numel()]
                    self.compact.merge_master(_high(store), low, master)
                    yield master, exp_avg, exp_avg_sq
                    if write:
                        self.compact.split_master(master, _high(store), low)
        finally:
            self._release(slot, write)

    @contextlib.contextmanager
    def hold_halves(self, store) -> Iterator[States]:
        """A compact tier's (master's low half, exp_avg, exp_avg_sq) of the block for an update in place with the
        working copy as the high half (the kernel's `step_compact`); written back after."""
        assert self.compact is not None, "hold_halves is for compact masters"
        slot = self._acquire(store)
        try:
            yield self._views(slot, store)
        finally:
            self._release(slot, True)

    def to_host(self, store, host) -> None:
        """Move a block's state from its file back into host memory, where a later plan found room for it: the
        store's master (bf16/fp16) and moments are host tensors again, `store.tier` None, the file gone, and a
        staging buffer beyond what the blocks left on the drive need is freed. No job may touch the block meanwhile
        (the runtime drains the CPU optimizer first)."""
        t = store.trainable_numel
        kinds = 3 if self.compact is not None else self.kinds  # a compact master comes back whole (compact.to_host)
        with self.hold(store, write=False) as (master, exp_avg, exp_avg_sq):  # waits for the block's last write
            moved = [host.empty(t, torch.float32) for _ in range(kinds)]
            for target, source in zip(moved, (master, exp_avg, exp_avg_sq)[3 - kinds:]):
                target.copy_(source)
        with self._lock:
            entry = self.files.pop(store.index)
            slot = self._where.pop(store.index, None)
            if slot is not None:
                slot.index = None
            with contextlib.suppress(ValueError):
                self._queue.remove(store.index)
            surplus = [s for s in self.slots if s.holds == 0 and s.index is None][:len(self.slots) - len(self.files)]
            dropped_ids = {id(s) for s in surplus}
            self.slots = [s for s in self.slots if id(s) not in dropped_ids]
        for dropped in surplus:
            dropped.transfer.wait()
        entry.written.wait()
        os.close(entry.fd)  # its name went at its creation (DirectFiles.open): this frees the space
        if kinds == 3:
            store.master = moved.pop(0)
        store.exp_avg, store.exp_avg_sq = moved
        store.tier = None

    def gather(self, store) -> dict[int, States]:
        """Copies of the block's state per trainable entry (by offset), as BlockStore.life.gathered holds a sharded
        block's: for checkpoints, promotion and the optimizer's state dict, which keep them past one hold."""
        with self.hold(store, write=False) as (master, exp_avg, exp_avg_sq):
            return {e.offset: tuple(t[e.offset:e.offset + e.numel].clone().view(e.shape)
                                    for t in (master, exp_avg, exp_avg_sq)) for e in store.trainable}

    def _views(self, slot: _Slot, store) -> States:
        """(master, exp_avg, exp_avg_sq) in the buffer, or with compact masters (low half, exp_avg, exp_avg_sq)."""
        t = store.trainable_numel
        if self.compact is not None:
            exp_avg, exp_avg_sq = slot.buffer[:8 * t].view(torch.float32).split(t)
            return slot.buffer[8 * t:10 * t].view(torch.int16), exp_avg, exp_avg_sq
        staged = slot.buffer[:self.kinds * 4 * t].view(torch.float32)
        parts = [staged[k * t:(k + 1) * t] for k in range(self.kinds)]
        if self.kinds == 2:  # fp32: the master is the working copy, in host memory
            parts.insert(0, store.master)
        return tuple(parts)

    def _acquire(self, store) -> _Slot:
        start = time.perf_counter()
        with self._lock:
            if self._closed:
                raise RuntimeError("stronghold's NVMe tier was closed (engine.destroy()); build a new engine")
            self.stats.holds += 1
            slot = self._where.get(store.index)
            while slot is None and all(s.holds for s in self.slots):
                self._freed.wait()
                slot = self._where.get(store.index)
            if slot is None:
                self.stats.reads_on_demand += 1
                slot = self._victim()
                self._load(slot, store.index)
            slot.holds += 1
            with contextlib.suppress(ValueError):
                self._queue.remove(store.index)
            transfer = slot.transfer
        # Done before the hold's views are used: a read into the buffer, or the write of this same block's last
        # update (so a later write of the buffer never races it).
        try:
            transfer.wait()
        except BaseException:
            with self._lock:  # the buffer's content is unknown: the next hold reads the file again
                slot.holds -= 1
                if self._where.get(slot.index) is slot:
                    del self._where[slot.index]
                slot.index = None
                self._freed.notify_all()
            raise
        self.stats.wait_s += time.perf_counter() - start
        return slot

    def _release(self, slot: _Slot, write: bool) -> None:
        with self._lock:
            slot.holds -= 1
            if write:
                entry = self.files[slot.index]
                entry.written = slot.transfer = self.io.write(entry.fd, slot.buffer, entry.nbytes)
                self.stats.written_bytes += entry.nbytes
            self._read_ahead()
            self._freed.notify_all()

    def _victim(self) -> _Slot:
        """A buffer no hold is open on: an empty one, else one whose block is not queued (least recently loaded
        first: slots are scanned in load order), else the one whose block is queued last."""
        free = [s for s in self.slots if s.holds == 0]
        assert free, "every NVMe staging buffer is held"
        queued = {index: rank for rank, index in enumerate(self._queue)}
        for slot in free:
            if slot.index is None or slot.index not in queued:
                return slot
        return max(free, key=lambda s: queued[s.index])

    def _free_slot(self) -> _Slot:
        with self._lock:
            slot = self._victim()
            if slot.index is not None:
                del self._where[slot.index]
            return slot

    def _load(self, slot: _Slot, index: int) -> None:
        """Point `slot` at block `index` and start reading its file into it (behind the buffer's last transfer and
        the block's last write). Under the lock."""
        if slot.index is not None:
            del self._where[slot.index]
        entry = self.files[index]
        slot.index = index
        slot.transfer = self.io.read(entry.fd, slot.buffer, entry.nbytes, after=(slot.transfer, entry.written))
        self._where[index] = slot
        self.stats.read_bytes += entry.nbytes

    # Read-ahead --------------------------------------------------------------------------------
    def expect(self, stores, replace: bool = False) -> None:
        """Queue these stores' blocks (those in this tier), in order, for reading ahead; `replace` drops the queue
        first (a new phase of the step whose order supersedes it)."""
        with self._lock:
            if replace:
                self._queue.clear()
            for store in stores:
                if store.index in self.files and store.index not in self._queue:
                    self._queue.append(store.index)
            self._read_ahead()

    def _read_ahead(self) -> None:
        """Start reads of queued blocks into free buffers (under the lock)."""
        queued = set(self._queue)
        for index in self._queue:
            if index in self._where:
                continue
            slot = next((s for s in self.slots if s.holds == 0 and (s.index is None or s.index not in queued)), None)
            if slot is None:
                return
            self._load(slot, index)

    def report(self, steps: int, reset: bool = False) -> dict:
        """Per optimizer step since the last reset: bytes moved, the seconds the drive was busy (the measured NVMe
        term) and the seconds holds waited for it (what read-ahead did not hide)."""
        s = self.stats
        out = {"blocks": len(self.files), "bytes_on_drive": self.bytes_on_drive, "direct": self.io.direct,
               "staging_buffers": len(self.slots), "read_bytes_per_step": s.read_bytes / steps,
               "written_bytes_per_step": s.written_bytes / steps, "busy_s_per_step": self.io.busy.seconds / steps,
               "hold_wait_s_per_step": s.wait_s / steps, "reads_on_demand_per_step": s.reads_on_demand / steps}
        if reset:
            self.stats = NvmeStats()
            self.io.busy.reset()
        return out

    # End ---------------------------------------------------------------------------------------
    def wait_writes(self) -> None:
        """Every write issued so far is on the drive (for the bench's accounting and for close)."""
        with self._lock:
            pending = [s.transfer for s in self.slots] + [f.written for f in self.files.values()]
        for transfer in pending:
            transfer.wait()

    def close(self) -> None:
        """Wait for the transfers, close the files and remove the tier's directory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()


def _high(store) -> torch.Tensor:
    """A compact master's high half: the store's working copy (its trainable elements)."""
    return store.working[store.shard_start:store.shard_stop]


def _file_name(index: int) -> str:
    return f"block-{index:05d}.states"


def _remove(directory: Path, files: dict[int, _File], io: DirectFiles) -> None:
    io.close()  # waits for every queued transfer
    for entry in files.values():
        with contextlib.suppress(OSError):
            os.close(entry.fd)
    shutil.rmtree(directory, ignore_errors=True)
