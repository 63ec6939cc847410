"""Faulting in the AdamW moments' host pages in the background, while the first step computes.

The moments (`exp_avg`, `exp_avg_sq`) are fresh anonymous mappings (pinned.pageable_empty), zero until written, so
nothing backs them until the CPU AdamW's first update writes them: 8 bytes a trainable parameter, 56 GB for a
Llama-3-8B shape's streamed blocks. That first update (the first step's, run during the second step's forward) then
pays every page fault, and on a fresh virtual machine the hypervisor's first backing of each page too: the 8B's
second step took twice a steady one. Faulting them in at set-up moves the cost into set-up instead.

`Prefault` faults them in on a thread of its own from the end of set-up, in the order the first update wants them
(the blocks in backward order), with `madvise(MADV_POPULATE_WRITE)` (Linux 5.14): the pages are allocated and mapped
writable as a write would, but their contents are not touched, so the CPU worker may update a block while its pages
are still being faulted in and nothing needs ordering. The call runs through ctypes, which releases the GIL for it.
Where the kernel does not take the advice (older kernels, other systems) the thread stops at the first refusal and the
pages fault in at first use, as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import sys
import threading
import time
from typing import Iterable, Optional

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""linux/mman.h; Python's mmap module does not name it."""
CHUNK_BYTES = 256 * 2 ** 20
"""Advised at a time, so that `stop` (engine destroyed mid-way) takes effect within one chunk."""
PAGE = 4096


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned [start, stop) address ranges of the tensors' memory, in order (pages partly theirs
    included: advising a page faults it in, which a neighbour's first write would have done)."""
    out = []
    for tensor in tensors:
        start = tensor.data_ptr()
        stop = start + tensor.numel() * tensor.element_size()
        if stop > start:
            out.append((start // PAGE * PAGE, -(-stop // PAGE) * PAGE))
    return out


class Prefault:
    def __init__(self, tensors: Iterable[torch.Tensor], cores: tuple[int, ...] = (), madvise=None):
        """Start faulting in the pages of `tensors` (host tensors), in order, on `cores` (the CPU worker's, off the
        thread that launches GPU work; all where empty). `madvise`: (address, length, advice) -> 0, or -1 with errno
        set; libc's by default (the tests pass their own)."""
        self._ranges = ranges(tensors)
        self._cores = cores
        self._madvise = madvise or _libc_madvise()
        self._stop = threading.Event()
        self.done_bytes = 0
        self.seconds = 0.0
        self.refused: Optional[int] = None
        """errno of a refusal that stopped the thread (the kernel does not take MADV_POPULATE_WRITE), or None."""
        self._thread: Optional[threading.Thread] = None
        if self._madvise is not None and self._ranges:
            self._thread = threading.Thread(target=self._run, name="stronghold-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if self._cores:
            os.sched_setaffinity(0, self._cores)  # this thread only
        start = time.perf_counter()
        for first, stop in self._ranges:
            for at in range(first, stop, CHUNK_BYTES):
                if self._stop.is_set():
                    return
                length = min(CHUNK_BYTES, stop - at)
                if self._madvise(at, length, MADV_POPULATE_WRITE) == 0:
                    self.done_bytes += length
                    continue
                code = ctypes.get_errno()
                if code == errno.ENOMEM:  # the range went meanwhile (a block promoted to the GPU): the next one
                    break
                self.refused = code
                logger.debug(f"stronghold: MADV_POPULATE_WRITE refused ({os.strerror(code)}); the moments' pages "
                             "fault in at their first update")
                return
        self.seconds = time.perf_counter() - start

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """Stop after the chunk in flight and wait for it (at close: nothing to fault in for an engine that goes)."""
        self._stop.set()
        self.join()

    def report(self) -> dict:
        return {"bytes": self.done_bytes, "seconds": self.seconds, "refused_errno": self.refused,
                "running": self._thread is not None and self._thread.is_alive()}
