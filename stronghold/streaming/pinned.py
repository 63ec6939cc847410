"""Host buffers: pinned ones of exactly the requested size, and large pageable ones on huge pages; `HostMeter` makes
and counts those of a runtime's stores.

torch's pinned allocator (CachingHostAllocator) rounds every request up to a power of two, so a GPT-2
h2048 block's bf16 working copy (100.7 MB) takes 128 MiB of page-locked memory: +33% on the two pinned
buffers of every streamed block (on an H100 host 16 such buffers grew the RSS by 2.15 GB with torch's
allocator, 1.71 GB registered here, for 1.61 GB asked). Host memory is what
limits the largest model, so large buffers are anonymous mappings of the exact page count,
page-locked with cudaHostRegister (as the node-shared copy is, shared_host.py) and unregistered before
they are unmapped. Small ones stay with torch's allocator, where rounding costs little.

The large pageable buffers (`pageable_empty`: the fp32 master and moments) are private anonymous mappings that ask
for transparent huge pages before their first touch. The CPU optimizer's kernels stream through them at the host's
memory bandwidth, and with 4 KiB pages the hardware prefetchers stop at each page boundary: on an H200 host 2 MiB
pages made accumulate, preview and step 5-8% faster.
Where THP is off the advice is refused and the pages stay 4 KiB. The pinned ones stay shared mappings (mmap's
default), which the kernel backs with huge pages only under its shmem setting (usually "never"): in a process that
forks after set-up (DataLoader workers) no write to a shared page is copied, so DMA and the CPU keep seeing one page,
where a private page-locked page written after a fork would be copied away from the one the GPU reads.

The mapping lives as long as any tensor viewing it (torch.frombuffer keeps a reference); the last
reference gone, `_RegisteredMap.__del__` unregisters it, then mmap's own deallocation unmaps it. A copy
still reading the buffer would need it alive: the runtime synchronizes before it drops a store
(promotion, destroy), as it did with torch's allocator, whose cache only delayed the reuse.
"""
from __future__ import annotations

import mmap
import threading
import weakref
from typing import Callable, Optional

import torch

from stronghold.streaming.prefault import populate

EXACT_MIN_BYTES = 1 << 20
"""Below this the power-of-two rounding wastes under 1 MiB a buffer: torch's allocator is kept."""


class _RegisteredMap(mmap.mmap):
    """An anonymous shared mapping (see the module docstring); `unregister(ptr)` runs once, before it goes away."""

    ptr: Optional[int] = None
    unregister: Optional[Callable[[int], object]] = None

    def __del__(self):
        if self.ptr is not None and self.unregister is not None:
            self.unregister(self.ptr)
            self.ptr = None


def host_register(ptr: int, nbytes: int, portable: bool = False) -> int:
    """cudaHostRegister of [ptr, ptr + nbytes); the CUDA error code (0: success). `portable`
    (cudaHostRegisterPortable): usable from every CUDA context of the process."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1 if portable else 0))


def host_unregister(ptr: int) -> object:
    return torch.cuda.cudart().cudaHostUnregister(ptr)


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def anon_huge_pages_bytes() -> Optional[int]:
    """This process's anonymous memory on transparent huge pages now (None where /proc does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _huge_pages(mapping: mmap.mmap) -> None:
    """Advise transparent huge pages for a mapping not yet touched (a no-op where unsupported or off)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        mapping.madvise(advice)
    except OSError:  # THP "never", or a kernel without it: 4 KiB pages
        pass


def pageable_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D host tensor of `numel` elements, zero-filled (an anonymous mapping starts zeroed), on huge pages where
    the host allows; small ones from torch's allocator (zeroed too)."""
    nbytes = numel * _element_size(dtype)
    if nbytes < EXACT_MIN_BYTES:
        return torch.zeros(numel, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _huge_pages(mapping)
    return torch.frombuffer(mapping, dtype=dtype, count=numel)


def pinned_empty(numel: int, dtype: torch.dtype, *, register: Callable[[int, int], int] = host_register,
                 unregister: Callable[[int], object] = host_unregister) -> torch.Tensor:
    """An uninitialised 1-D pinned tensor of `numel` elements. `register(ptr, nbytes)` returns a CUDA error
    code (0: success); the two hooks are parameters so that the CPU tests can check the pairing."""
    nbytes = numel * _element_size(dtype)
    if nbytes < EXACT_MIN_BYTES:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    mapping = _RegisteredMap(-1, nbytes)
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel)
    # Faulted in first, then locked: registering a fresh mapping faults its pages one by one (prefault.py). Only a
    # speed-up: where populating fails (memory short), the register below fails with the error that names the fix.
    try:
        populate(tensor.data_ptr(), nbytes)
    except OSError:
        pass
    status = register(tensor.data_ptr(), nbytes)
    if status != 0:
        raise MemoryError(f"stronghold: cudaHostRegister of a {nbytes / 2 ** 20:.0f} MiB host buffer failed with CUDA "
                          f"error {status}: the page-locked memory limit (ulimit -l) or the host's free memory is too "
                          "small. Raise `ulimit -l`, or set \"pin_memory\": false in the stronghold section (slower "
                          "copies)")
    mapping.ptr, mapping.unregister = tensor.data_ptr(), unregister
    return tensor


class HostMeter:
    """Host bytes held by the streamed blocks' buffers of one runtime (this rank's: its mapping of the
    node-shared working copy or its own working copies, states, gradient buffers, and the transients of
    set-up, saves and promotion): `live` now and `peak`, the high-water mark since `reset_peak`.

    A buffer counts until its storage is freed (a finalizer on the storage, so a view that outlives the
    tensor keeps it counted, and a buffer leaked by a lingering reference is seen). The peak is updated
    on each allocation, the only moment `live` grows, so it is exact for the buffers registered here."""

    def __init__(self):
        self._lock = threading.Lock()  # finalizers run on whichever thread drops the last reference
        self.live = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a freshly allocated host tensor's storage (never one already counted, nor a view of one)."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, nbytes)
        return tensor

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes

    def empty(self, numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        # Exact-size page-locked buffers (pinned.py): torch's pinned allocator rounds up to a power of two.
        return self.track(pinned_empty(numel, dtype) if pin else pageable_empty(numel, dtype))

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.track(pageable_empty(numel, dtype))  # zero-filled: a fresh anonymous mapping

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live
