"""The moments' host pages faulted in on a thread while the first step computes (streaming/prefault.py): every range
advised in order and in chunks, a refusal stops the thread, a range gone meanwhile is skipped, and with the kernel's
own madvise the pages are resident afterwards with their contents untouched."""
import ctypes
import errno
import threading

import psutil
import pytest
import torch

from stronghold.streaming import prefault
from stronghold.streaming.pinned import pageable_empty
from stronghold.streaming.prefault import CHUNK_BYTES, MADV_POPULATE_WRITE, PAGE, Prefault, ranges


class Recorder:
    def __init__(self, fail_at=None, code=errno.EINVAL):
        self.calls, self.fail_at, self.code = [], fail_at, code

    def __call__(self, address, length, advice):
        assert advice == MADV_POPULATE_WRITE
        self.calls.append((address, length))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            ctypes.set_errno(self.code)
            return -1
        return 0


def test_ranges_are_whole_pages_in_order():
    a, b = torch.empty(10, dtype=torch.float32), pageable_empty(3 * 2 ** 20, torch.float32)
    got = ranges([b, a, torch.empty(0)])
    assert [r[0] % PAGE for r in got] == [0, 0] and [r[1] % PAGE for r in got] == [0, 0]
    assert got[0] == (b.data_ptr(), b.data_ptr() + b.numel() * 4)
    assert got[1][0] <= a.data_ptr() and a.data_ptr() + 40 <= got[1][1]


def test_every_range_is_advised_in_chunks_in_order():
    tensors = [pageable_empty(n, torch.float32) for n in (CHUNK_BYTES // 4 * 2 + 5, 2 ** 20)]
    madvise = Recorder()
    job = Prefault(tensors, madvise=madvise)
    job.join()
    expected = ranges(tensors)
    assert madvise.calls[0][0] == expected[0][0] and all(length <= CHUNK_BYTES for _, length in madvise.calls)
    covered = [(a, a + n) for a, n in madvise.calls]
    assert covered[:3] == [(expected[0][0] + k * CHUNK_BYTES, min(expected[0][0] + (k + 1) * CHUNK_BYTES,
                                                                  expected[0][1])) for k in range(3)]
    assert covered[3:] == [expected[1]]
    assert job.done_bytes == sum(b - a for a, b in expected) and job.report()["refused_errno"] is None


def test_a_refusal_stops_and_a_range_gone_meanwhile_is_skipped():
    tensors = [pageable_empty(CHUNK_BYTES // 4 * 2, torch.float32), pageable_empty(2 ** 20, torch.float32)]
    refused = Recorder(fail_at=1, code=errno.EINVAL)  # a kernel without MADV_POPULATE_WRITE
    job = Prefault(tensors, madvise=refused)
    job.join()
    assert len(refused.calls) == 1 and job.refused == errno.EINVAL and job.done_bytes == 0
    gone = Recorder(fail_at=1, code=errno.ENOMEM)  # the first tensor's mapping went (a promoted block)
    job = Prefault(tensors, madvise=gone)
    job.join()
    assert [a for a, _ in gone.calls] == [ranges(tensors)[0][0], ranges(tensors)[1][0]]
    assert job.refused is None and job.done_bytes == 2 ** 20 * 4


def test_stop_ends_the_thread_before_the_rest():
    tensors = [pageable_empty(CHUNK_BYTES // 4 * 4, torch.float32)]
    started, release = threading.Event(), threading.Event()

    def madvise(address, length, advice):
        started.set()
        release.wait()
        return 0
    job = Prefault(tensors, madvise=madvise)
    started.wait()
    stopper = threading.Thread(target=job.stop)
    stopper.start()
    release.set()
    stopper.join()
    assert job.done_bytes == CHUNK_BYTES and not job.report()["running"]


def test_the_kernel_faults_the_pages_in_and_keeps_their_contents():
    if prefault._libc_madvise() is None:
        pytest.skip("no libc madvise here")
    n = 64 * 2 ** 20 // 4
    moments = pageable_empty(n, torch.float32)
    moments[: n // 8] = 3.0  # written before: must stay as written
    before = psutil.Process().memory_info().rss
    job = Prefault([moments])
    job.join()
    if job.refused is not None:
        pytest.skip(f"this kernel refuses MADV_POPULATE_WRITE (errno {job.refused})")
    grown = psutil.Process().memory_info().rss - before
    assert grown >= 0.8 * (n - n // 8) * 4, "the untouched 7/8 of the buffer is resident now"
    assert bool((moments[: n // 8] == 3.0).all()) and int(torch.count_nonzero(moments[n // 8:])) == 0
