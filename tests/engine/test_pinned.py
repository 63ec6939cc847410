"""pinned.py: exact-size page-locked buffers. The CUDA calls are injected, so the pairing (one unregister
per register, with the same pointer, only once nothing views the memory) is checked without a GPU;
tests/engine/test_gpu.py's training runs use the real calls."""
import gc

import pytest
import torch

from stronghold.streaming import pinned


class Calls:
    def __init__(self, status: int = 0):
        self.status, self.registered, self.unregistered = status, [], []

    def register(self, ptr: int, nbytes: int) -> int:
        self.registered.append((ptr, nbytes))
        return self.status

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


def test_large_buffer_is_registered_at_its_exact_size_and_unregistered_once_no_view_remains():
    calls = Calls()
    numel = 3 * pinned.EXACT_MIN_BYTES // 2 + 7  # not a power of two: torch's allocator would round it up
    buffer = pinned.pinned_empty(numel, torch.bfloat16, register=calls.register, unregister=calls.unregister)
    assert buffer.shape == (numel,) and buffer.dtype == torch.bfloat16
    assert calls.registered == [(buffer.data_ptr(), numel * 2)]
    buffer.copy_(torch.arange(numel, dtype=torch.bfloat16))  # writable
    view = buffer[5:9]
    expected = view.clone()
    del buffer
    gc.collect()
    assert calls.unregistered == []  # a view still reads the mapping
    assert torch.equal(view, expected)
    ptr = calls.registered[0][0]
    del view
    gc.collect()
    assert calls.unregistered == [ptr]


@pytest.mark.gpu
def test_small_buffer_is_left_to_torch():
    """Under EXACT_MIN_BYTES torch's pinned allocator serves it (it needs CUDA)."""
    calls = Calls()
    buffer = pinned.pinned_empty(16, torch.float32, register=calls.register, unregister=calls.unregister)
    assert calls.registered == [] and buffer.is_pinned()


def test_failed_registration_raises_memory_error_naming_the_fix_and_leaves_nothing_registered():
    calls = Calls(status=2)  # cudaErrorMemoryAllocation
    with pytest.raises(MemoryError, match=r"ulimit -l.*pin_memory"):
        pinned.pinned_empty(pinned.EXACT_MIN_BYTES, torch.uint8, register=calls.register, unregister=calls.unregister)
    gc.collect()
    assert len(calls.registered) == 1 and calls.unregistered == []


@pytest.mark.parametrize("numel,dtype", [(pinned.EXACT_MIN_BYTES // 4 + 3, torch.float32), (10, torch.float32),
                                         (pinned.EXACT_MIN_BYTES + 1, torch.bfloat16)])
def test_pageable_buffers_start_zeroed_are_writable_and_independent(numel, dtype):
    first, second = pinned.pageable_empty(numel, dtype), pinned.pageable_empty(numel, dtype)
    assert first.shape == (numel,) and first.dtype == dtype and not first.is_pinned()
    assert torch.count_nonzero(first) == 0 and torch.count_nonzero(second) == 0  # the optimizer's moments start at 0
    first.fill_(3)
    assert torch.count_nonzero(second) == 0 and float(first[-1]) == 3.0


class _Mapping:
    def __init__(self, error=None):
        self.advice, self.error = [], error

    def madvise(self, advice):
        self.advice.append(advice)
        if self.error:
            raise self.error


@pytest.mark.skipif(not hasattr(pinned.mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_huge_pages_are_asked_for_and_a_refusal_keeps_small_pages():
    asked = _Mapping()
    pinned._huge_pages(asked)
    assert asked.advice == [pinned.mmap.MADV_HUGEPAGE]
    refused = _Mapping(OSError(22, "Invalid argument"))  # THP "never" or not built in
    pinned._huge_pages(refused)
    assert refused.advice == [pinned.mmap.MADV_HUGEPAGE]


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off on this host")
def test_a_large_pageable_buffer_gets_huge_pages_where_the_host_allows():
    """Private mapping + MADV_HUGEPAGE: touched, most of 64 MiB lands on 2 MiB pages (a shared mapping would not,
    under the usual shmem setting "never"). At least half, since the kernel may lack free huge pages for a few."""
    before = pinned.anon_huge_pages_bytes() or 0
    buffer = pinned.pageable_empty(16 * 2 ** 20, torch.float32)
    buffer.fill_(1.0)
    assert (pinned.anon_huge_pages_bytes() or 0) - before >= 32 * 2 ** 20

