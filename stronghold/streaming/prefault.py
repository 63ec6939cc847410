"""The host AdamW moments faulted in on background threads during the first training step, before the first CPU
update reads them.

The moments start as fresh anonymous mappings (pinned.pageable_empty): zero, but with no pages behind them. The first
AdamW pass over a block then waits while the kernel faults in and zeroes every page (on a virtual machine the
hypervisor backs each one too), at a few GB/s; 8 bytes a parameter, so tens of GB on a 7-8 B model. The first step's
updates are deferred into the second step (cpu_optim.py), so the whole cost lands there. Faulting every store in at
set-up moves it into set-up and holds pages for blocks that the first forward's placement then makes resident on the
GPU. So the runtime starts this at the first training forward, after that placement, for the stores still on the host,
in the order backward hands them to the CPU (last block first), on a few threads while the GPU runs the first step.

`madvise(MADV_POPULATE_WRITE)` faults pages in without changing their contents, so it is safe beside an AdamW that
already writes the same block. Where the kernel does not know the advice (Linux before 5.14) nothing is done: writing
zeros instead could overwrite moments an update has already written. The threads hold each buffer only for the chunk
being faulted in (weak references otherwise), so a store dropped meanwhile (a promotion) is freed as before.
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import threading
import weakref
from typing import Iterable

import torch

from stronghold.streaming.pinned import EXACT_MIN_BYTES

MADV_POPULATE_WRITE = 23
"""madvise(2) advice (Linux 5.14+); Python's mmap module does not name it."""
CHUNK_BYTES = 64 * 2 ** 20
"""One madvise call's range: small enough that stop() returns within a few tens of milliseconds."""
THREADS = 4
"""Fault-in runs at the rate the kernel zeroes pages; a few threads reach most of it without taking the cores the
first step's host gradient accumulation and the launching thread use."""

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def populate_range(ptr: int, nbytes: int) -> bool:
    """Fault in [ptr, ptr + nbytes) for writing, contents unchanged. False where the kernel refuses the advice.
    ctypes releases the GIL for the call."""
    return _libc.madvise(ptr, nbytes, MADV_POPULATE_WRITE) == 0


class StatePrefault:
    """Background fault-in of host buffers (see the module docstring). `populate` is the per-chunk call (a parameter
    so that the CPU tests can watch the order and the stop)."""

    def __init__(self, buffers: Iterable[torch.Tensor], threads: int = THREADS, populate=populate_range):
        self._chunks: collections.deque = collections.deque()
        for buffer in buffers:
            nbytes = buffer.numel() * buffer.element_size()
            if nbytes < EXACT_MIN_BYTES:
                continue  # torch's allocator zeroed it by writing: already faulted in
            ref = weakref.ref(buffer)
            self._chunks.extend((ref, offset, min(CHUNK_BYTES, nbytes - offset))
                                for offset in range(0, nbytes, CHUNK_BYTES))
        self.total_bytes = sum(chunk[2] for chunk in self._chunks)
        self.faulted_bytes = 0
        self.supported = True
        self._populate = populate
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"stronghold-prefault-{i}", daemon=True)
                         for i in range(min(threads, len(self._chunks)))]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ref, offset, nbytes = self._chunks.popleft()
            except IndexError:
                return
            buffer = ref()
            if buffer is None:
                continue  # its store was dropped (promoted to the GPU)
            if not self._populate(buffer.data_ptr() + offset, nbytes):
                self.supported = False
                self._stop.set()
                return
            del buffer
            with self._lock:
                self.faulted_bytes += nbytes

    def wait(self) -> None:
        """Wait until every chunk is faulted in (or the work stopped)."""
        for thread in self._threads:
            thread.join()

    def stop(self) -> None:
        """End the work (the chunk in flight finishes) and wait for the threads."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._chunks.clear()

    @property
    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)


def moment_buffers(stores: Iterable) -> list[torch.Tensor]:
    """The host moments of `stores` (those the NVMe tier keeps on a drive have none), in the given order."""
    return [buffer for store in stores for buffer in (store.exp_avg, store.exp_avg_sq) if buffer is not None]
