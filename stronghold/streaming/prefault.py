"""Host pages faulted in ahead of their first use, without changing them.

The first write to a page of a fresh anonymous mapping costs far more than any later one: the kernel finds a free
page, zeroes it and maps it (and on a virtual machine the hypervisor may back it first). On the 2x H200 host this
ran at about 5 GB/s for the whole process, whatever the thread count, once ~100 GB of the host was in use
(results/engine/setup_time.jsonl, "host_pages" records): a large model's host footprint costs tens of seconds once.

- page-locking a fresh buffer (cudaHostRegister) faults its pages in one at a time under the driver's lock, slower
  than populating them first and locking pages already there: `populate` (Linux's MADV_POPULATE_WRITE, 5.14 on)
  before `host_register` (pinned.py);
- the fp32 moments are mapped zero-filled at set-up and first written by the first optimizer step, whose updates
  then wait on the faults while the next forward waits for the updates (docs/results.md, "Llama-3-8B shape: where
  the set-up and the second step go"). `Prefault` faults them in on a thread of its own while the first step runs,
  in the order the first updates want them, from the end of the first training forward (the runtime's
  `start_prefault`): after its placement has promoted what it promotes, since a block promoted there never writes
  its host moments and populating them would only raise the host peak (the same section, the Llama GA 8 point), and
  after its compile. It faults them by the CPU AdamW kernel's `fault_in` (a locked add of zero a page), not by
  madvise: the kernel holds the process's mmap lock through a populate call, and the rest of the step, which maps
  and unmaps memory all through (the compile, the allocators, the promotion's copies), waited behind it
  (`CHUNK_BYTES`; examples/bench/probes/populate_stall.py). Where the eager kernel runs, madvise in chunks.

Both leave the contents as they are, so they are safe beside a kernel that is already writing the same pages. Where
the kernel refuses the advice (before 5.14, or another OS), nothing is populated and the pages fault on first use as
before; the report says so.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import threading
import time
import weakref
from typing import Callable, Iterable, Optional

import torch

MADV_POPULATE_WRITE = 23
MIN_BYTES = 1 << 20
"""Smaller buffers come from torch's allocator (pinned.py), already touched."""
CHUNK_BYTES = 2 << 20
"""`populate` advises at most this much a call. The kernel holds the process's mmap lock for the whole of a call: a
thread that maps or unmaps memory meanwhile (Python's arenas, the allocators, the CUDA driver) waits for the call to
end, and the page faults queued behind it wait with it, over a whole buffer for the buffer's whole populate
(examples/bench/probes/populate_stall.py). In chunks, a mapping call waits a chunk at most, and the extra system
calls cost little beside the faults. A thread that maps memory all the time still waits a chunk a call, so the
moments' thread starts after the first forward's compile (the runtime's `start_prefault`)."""

_refused = False
"""Set once the kernel refused the advice: later calls skip the system call."""


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # a foreign call releases the GIL: populating runs beside Python
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def populate(ptr: int, nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> bool:
    """Fault in [ptr, ptr + nbytes) of a mapping, writable, leaving its contents as they are, `chunk_bytes` a system
    call (0: one call for the whole range). False where the kernel does not support it (nothing was done); raises
    OSError for any other failure."""
    global _refused
    if _refused or _MADVISE is None:
        return False
    start, end = ptr - ptr % mmap.PAGESIZE, ptr + nbytes
    step = max(mmap.PAGESIZE, chunk_bytes - chunk_bytes % mmap.PAGESIZE) if chunk_bytes > 0 else end - start
    while start < end:
        length = min(step, end - start)
        if _MADVISE(start, length, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                _refused = True
                return False
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {length} bytes at offset {start - ptr} of "
                               f"{nbytes} failed: {errno.errorcode.get(err, err)}")
        start += length
    return True


class Prefault:
    """Populates host tensors on a daemon thread, in the order given. Holds them only by weak reference, so a buffer
    dropped meanwhile (a block promoted to the GPU) is freed as usual and skipped. `close` stops it between buffers.

    `fault_in(tensor)`, where given, faults a buffer in without the mmap lock (the CPU AdamW kernel's: a locked add
    of zero a page, adamw_kernel.py) and returns False where it cannot; the buffer is then populated by madvise."""

    def __init__(self, tensors: Iterable[torch.Tensor], fault_in: Optional[Callable[[torch.Tensor], bool]] = None):
        self._refs = [weakref.ref(t) for t in tensors if t.untyped_storage().nbytes() >= MIN_BYTES]
        self._fault_in = fault_in
        self.how: Optional[str] = None
        """How the last buffer was faulted in: "fault_in" or "madvise"."""
        self.seconds: Optional[float] = None
        """The thread's time, once it has finished (None while it runs)."""
        self.bytes = 0
        """Bytes populated so far."""
        self.error: Optional[str] = None
        """Why it stopped early: the kernel's refusal, or a failure (the pages then fault on first use)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stronghold-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            for ref in self._refs:
                if self._stop.is_set():
                    break
                tensor = ref()
                if tensor is None:
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                if self._fault_in is not None and self._fault_in(tensor):
                    self.how = "fault_in"
                elif populate(tensor.data_ptr(), nbytes):
                    self.how = "madvise"
                else:
                    self.error = "the kernel does not support MADV_POPULATE_WRITE (Linux 5.14 on)"
                    break
                del tensor
                self.bytes += nbytes
        except OSError as err:  # the pages fault on first use instead: slower, never wrong
            self.error = str(err)
        finally:
            self._refs = []
            self.seconds = time.perf_counter() - start

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict:
        out = {"bytes": self.bytes, "seconds": self.seconds, "done": self.seconds is not None, "how": self.how}
        if self.error is not None:
            out["error"] = self.error
        return out
