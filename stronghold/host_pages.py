"""Huge pages for the large pageable host buffers (fp32 masters and AdamW moments, 12 of the ~16 host bytes
per streamed parameter), asked for with madvise(MADV_HUGEPAGE) before their first touch.

Why: set-up first-touches every buffer (zeroing the moments, copying the masters), and with 4 KiB pages
that is one page fault per 4 KiB. On the 2-core CI VM, a 303 M-parameter GPT-2 (23 streamed blocks)
spent 2.1 s of its 5.3 s `stronghold.initialize` zeroing moments; torch's own switch for the same advice
(THP_MEM_ALLOC_ENABLE=1, process-wide, for every CPU tensor) took it to 3.3 s. This does it for our
buffers only. Linux with transparent huge pages in "madvise" or "always" mode; elsewhere a no-op.
Pinned buffers are the CUDA driver's allocations and are left alone. STRONGHOLD_HUGE_PAGES=0 in the
environment turns the advice off (examples/bench_setup.py compares both).
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

import torch

HUGE_PAGE = 2 * 2 ** 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
ENABLED = os.environ.get("STRONGHOLD_HUGE_PAGES", "1") != "0"
_libc: Optional[ctypes.CDLL] = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages on the 2 MiB-aligned interior of `tensor`'s storage (before it is touched);
    True if the kernel took the advice. Never raises: the advice only changes speed."""
    if not ENABLED or not sys.platform.startswith("linux") or tensor.device.type != "cpu" or tensor.is_pinned():
        return False
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    if last - first < HUGE_PAGE:
        return False
    try:
        return _madvise()(first, last - first, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised pageable host tensor, advised for huge pages."""
    tensor = torch.empty(numel, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor
