"""prefault.py: the host moments faulted in on background threads, contents unchanged, in the order given."""
import ctypes
import mmap
import threading

import pytest
import torch

from stronghold.streaming import pinned, prefault
from tests.engine.helpers import batches, engine_for, tiny_gpt2, train_loop

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(buffer: torch.Tensor) -> int:
    nbytes = buffer.numel() * buffer.element_size()
    pages = (nbytes + PAGE - 1) // PAGE
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(buffer.data_ptr(), nbytes, vec) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vec.raw)


def test_populate_faults_in_every_page_and_keeps_the_contents():
    buffer = pinned.pageable_empty(3 * prefault.CHUNK_BYTES // 4 // 4 + 1000, torch.float32)
    assert resident_pages(buffer) == 0  # a fresh anonymous mapping has no pages yet
    buffer[:10] = torch.arange(1.0, 11.0)  # what an update may already have written
    if not prefault.populate_range(buffer.data_ptr(), buffer.numel() * 4):
        pytest.skip("this kernel does not know MADV_POPULATE_WRITE (Linux < 5.14): the prefault does nothing here")
    assert resident_pages(buffer) == (buffer.numel() * 4 + PAGE - 1) // PAGE
    assert torch.equal(buffer[:10], torch.arange(1.0, 11.0))
    assert torch.count_nonzero(buffer[10:]) == 0


class Recorder:
    def __init__(self, result: bool = True, gate: threading.Event = None):
        self.calls, self.result, self.gate = [], result, gate
        self.lock = threading.Lock()

    def __call__(self, ptr: int, nbytes: int) -> bool:
        if self.gate is not None:
            self.gate.wait()
        with self.lock:
            self.calls.append((ptr, nbytes))
        return self.result


def big(chunks: float) -> torch.Tensor:
    return pinned.pageable_empty(int(chunks * prefault.CHUNK_BYTES) // 4, torch.float32)


def test_chunks_cover_each_buffer_in_the_order_given_and_small_ones_are_left_out():
    first, second, small = big(2.5), big(1), torch.zeros(16)
    record = Recorder()
    job = prefault.StatePrefault([first, small, second], threads=1, populate=record)
    job.wait()
    c = prefault.CHUNK_BYTES
    assert record.calls == [(first.data_ptr(), c), (first.data_ptr() + c, c), (first.data_ptr() + 2 * c, c // 2),
                            (second.data_ptr(), c)]
    assert job.faulted_bytes == job.total_bytes == int(3.5 * c) and job.supported and job.done


def test_a_buffer_dropped_before_its_turn_is_skipped_and_freed():
    gate = threading.Event()
    first, second = big(1), big(1)
    record = Recorder(gate=gate)
    job = prefault.StatePrefault([first, second], threads=1, populate=record)
    ptr_first = first.data_ptr()
    del second  # a promotion drops the store: the job holds no reference that keeps it
    gate.set()
    job.wait()
    assert record.calls == [(ptr_first, prefault.CHUNK_BYTES)]


def test_a_refused_advice_stops_the_work():
    record = Recorder(result=False)
    job = prefault.StatePrefault([big(3)], threads=2, populate=record)
    job.wait()
    assert not job.supported and job.faulted_bytes == 0 and len(record.calls) <= 2


def test_stop_ends_the_work_with_chunks_left():
    gate = threading.Event()
    record = Recorder(gate=gate)
    job = prefault.StatePrefault([big(4)], threads=1, populate=record)
    threading.Timer(0.0, gate.set).start()
    job.stop()
    assert job.done and len(record.calls) <= 1


def test_training_starts_it_at_the_first_forward_last_block_first_and_close_stops_it():
    model = tiny_gpt2(n_layer=3, n_embd=256)  # blocks of 0.8 M parameters: moments over EXACT_MIN_BYTES
    engine = engine_for(model, window=2, resident=0)
    runtime = engine.stronghold_runtime
    assert runtime.prefault is None  # nothing before the first training forward
    train_loop(engine, batches(2))
    job = runtime.prefault
    job.wait()
    stores = sorted(runtime.stores.values(), key=lambda s: -s.index)
    expected = [b for s in stores for b in (s.exp_avg, s.exp_avg_sq)]
    assert job.total_bytes == sum(b.numel() * 4 for b in expected if b.numel() * 4 >= pinned.EXACT_MIN_BYTES) > 0
    assert job.faulted_bytes == job.total_bytes or not job.supported
    engine.destroy()
    assert job.done
