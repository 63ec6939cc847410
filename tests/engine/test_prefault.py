"""prefault.py: host pages faulted in without being written, before page-locking and on a thread for the moments.
Residency is read back with mincore(2), so each check sees whether the pages are there, not how long it took."""
import ctypes
import errno
import mmap
import sys

import pytest
import torch

from stronghold.streaming import pinned, prefault

from .helpers import batches, ds_config, engine_for, failing_call, tiny_llama, train_stronghold

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
PAGE = mmap.PAGESIZE


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(pages of the tensor's memory that are resident, pages in all)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = tensor.data_ptr() - tensor.data_ptr() % PAGE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw), pages


def fresh(nbytes: int) -> torch.Tensor:
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


def supported() -> bool:
    probe = fresh(PAGE)
    return prefault.populate(probe.data_ptr(), PAGE)


def test_populate_makes_every_page_resident_and_leaves_the_contents_as_they_were():
    if not supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    buffer = fresh(64 * PAGE)
    assert resident_pages(buffer)[0] == 0, "a fresh mapping has no pages yet"
    buffer[:PAGE * 8].copy_(torch.arange(PAGE * 8, dtype=torch.int64).remainder(251).to(torch.uint8))
    written = buffer[:PAGE * 8].clone()
    assert prefault.populate(buffer.data_ptr() + 5, buffer.numel() - 5), "an unaligned start is rounded down"
    assert resident_pages(buffer) == (64, 64)
    assert torch.equal(buffer[:PAGE * 8], written), "pages already written keep their values"
    assert not buffer[PAGE * 8:].any(), "populated pages read as zeros, as faulted ones do"


def test_populate_advises_a_few_mib_a_call_so_no_call_holds_the_mmap_lock_for_a_whole_buffer(monkeypatch):
    calls = []
    real, populates_here = prefault._MADVISE, supported()

    def record(ptr, nbytes, advice):
        calls.append((ptr, nbytes))
        return real(ptr, nbytes, advice) if real is not None else 0

    monkeypatch.setattr(prefault, "_MADVISE", record)
    monkeypatch.setattr(prefault, "_refused", False)
    chunk = 4 * PAGE
    buffer = fresh(3 * chunk + 16 * PAGE)
    ptr, nbytes = buffer.data_ptr() + 100, 3 * chunk + 5 * PAGE  # a range that starts inside a page
    assert prefault.populate(ptr, nbytes, chunk_bytes=chunk + 1)  # rounded down to whole pages
    start = ptr - ptr % PAGE
    assert [call[0] for call in calls] == [start + i * chunk for i in range(5)]  # 18 pages from `start`
    assert all(call[0] % PAGE == 0 and call[1] <= chunk for call in calls)
    assert calls[-1][0] + calls[-1][1] == ptr + nbytes
    if populates_here:
        assert resident_pages(buffer[100:100 + nbytes]) == (18, 18)
    calls.clear()
    assert prefault.populate(ptr, nbytes, chunk_bytes=0)
    assert calls == [(start, ptr + nbytes - start)]
    assert prefault.CHUNK_BYTES <= 16 << 20  # the default call is a few MiB


def test_a_populate_that_fails_part_way_names_the_offset(monkeypatch):
    fail_second, calls = failing_call(2, errno.ENOMEM)
    monkeypatch.setattr(prefault, "_MADVISE", fail_second)
    monkeypatch.setattr(prefault, "_refused", False)
    with pytest.raises(OSError, match=f"offset {2 * PAGE} of {8 * PAGE} failed: ENOMEM"):
        prefault.populate(8 * PAGE, 8 * PAGE, chunk_bytes=2 * PAGE)
    assert len(calls) == 2 and not prefault._refused


def native_kernel():
    from stronghold.optim.cpu_adam import NativeAdamW, load_kernel
    kernel = load_kernel(1)
    if not isinstance(kernel, NativeAdamW):
        pytest.skip("no C compiler: the native CPU AdamW kernel did not build")
    return kernel


def test_the_kernels_fault_in_makes_every_page_resident_and_leaves_the_contents_as_they_were():
    kernel = native_kernel()
    buffer = fresh(64 * PAGE)
    assert resident_pages(buffer)[0] == 0, "a fresh mapping has no pages yet"
    buffer[:PAGE * 8].copy_(torch.arange(PAGE * 8, dtype=torch.int64).remainder(251).to(torch.uint8))
    written = buffer[:PAGE * 8].clone()
    assert kernel.fault_in(buffer[5:]), "an unaligned start: the word after it, then one a page"
    assert resident_pages(buffer) == (64, 64)
    assert torch.equal(buffer[:PAGE * 8], written), "pages already written keep their values"
    assert not buffer[PAGE * 8:].any(), "faulted pages read as zeros"
    assert type(kernel).__mro__[1].fault_in(kernel, buffer) is False, "the interface's default: not supported"


def test_the_thread_faults_in_by_the_kernel_where_given_and_by_madvise_where_it_declines(monkeypatch):
    kernel, advised = native_kernel(), []
    real = prefault._MADVISE
    monkeypatch.setattr(prefault, "_MADVISE", lambda *a: advised.append(a) or (real(*a) if real else 0))
    monkeypatch.setattr(prefault, "_refused", False)
    buffers = [fresh(prefault.MIN_BYTES) for _ in range(2)]
    job = prefault.Prefault(buffers, fault_in=kernel.fault_in)
    job._thread.join()
    assert advised == [] and job.report()["how"] == "fault_in" and job.report()["bytes"] == 2 * prefault.MIN_BYTES
    assert all(resident_pages(b) == resident_pages(b)[1:] * 2 for b in buffers)
    job = prefault.Prefault([fresh(prefault.MIN_BYTES)], fault_in=lambda t: False)
    job._thread.join()
    assert advised and job.report()["how"] == "madvise"


def test_a_pinned_buffer_is_faulted_in_before_it_is_page_locked():
    if not supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    seen = []

    def register(ptr, nbytes):
        seen.append(resident_pages(buffer_of(ptr, nbytes)))
        return 0

    def buffer_of(ptr, nbytes):
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_buffer(
            (ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8), 0, (nbytes,))

    numel = 2 * pinned.EXACT_MIN_BYTES
    pinned.pinned_empty(numel, torch.uint8, register=register, unregister=lambda ptr: None)
    assert len(seen) == 1 and seen[0][0] == seen[0][1], "every page resident when the register call sees it"


def test_the_thread_populates_in_order_skips_what_was_freed_and_reports_the_bytes(monkeypatch):
    if not supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    order = []
    real = prefault.populate
    monkeypatch.setattr(prefault, "populate", lambda ptr, nbytes: order.append(ptr) or real(ptr, nbytes))
    kept = [fresh(prefault.MIN_BYTES), fresh(2 * prefault.MIN_BYTES)]
    dropped = fresh(prefault.MIN_BYTES)
    small = torch.zeros(16)
    gate = prefault.threading.Event()
    monkeypatch.setattr(prefault.threading, "Thread", gated_thread(gate))
    job = prefault.Prefault([kept[0], dropped, small, kept[1]])
    del dropped  # freed before the thread reaches it: skipped, not kept alive
    gate.set()
    job._thread.join()
    assert order == [t.data_ptr() for t in kept], "in the order given, the small and the freed ones left out"
    assert all(resident_pages(t)[0] == resident_pages(t)[1] for t in kept)
    report = job.report()
    assert report == {"bytes": 3 * prefault.MIN_BYTES, "seconds": report["seconds"], "done": True, "how": "madvise"}
    job.close()


def gated_thread(gate):
    real = prefault.threading.Thread

    def make(target, **kwargs):
        def run():
            gate.wait()
            target()
        return real(target=run, **kwargs)
    return make


def test_a_kernel_without_the_advice_leaves_the_pages_to_fault_on_first_use(monkeypatch):
    def refuse(ptr, nbytes, advice):
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(prefault, "_MADVISE", refuse)
    monkeypatch.setattr(prefault, "_refused", False)
    buffer = fresh(prefault.MIN_BYTES)
    job = prefault.Prefault([buffer])
    job.close()
    assert job.report()["bytes"] == 0 and "5.14" in job.report()["error"]
    assert resident_pages(buffer)[0] == 0
    buffer.fill_(3)  # still an ordinary buffer
    assert int(buffer[-1]) == 3


def test_an_engine_populates_every_moment_and_trains_the_same(monkeypatch):
    if not supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    config = ds_config(window=2, resident=1, gas=2)
    reference, _ = train_stronghold(tiny_llama(), batches(4), config)
    monkeypatch.setattr(prefault, "MIN_BYTES", 0)  # the tiny model's moments are small: populate them all
    engine, _ = train_stronghold(tiny_llama(), batches(4), config)
    runtime = engine._sh_runtime
    runtime.prefault._thread.join()
    stores = [*runtime.stores.values(), *runtime.cached.stores.values()]
    moments = sum(t.numel() * t.element_size() for s in stores for t in (s.exp_avg, s.exp_avg_sq))
    report = engine.stronghold_report()["set_up"]["prefault"]
    assert runtime.stores and report["bytes"] == moments
    from stronghold.optim.cpu_adam import NativeAdamW
    assert report["how"] == ("fault_in" if isinstance(runtime.cpu.kernel, NativeAdamW) else "madvise")
    for ours, theirs in zip(engine.module.parameters(), reference.module.parameters()):
        assert torch.equal(ours.detach().cpu(), theirs.detach().cpu()), "populating writes nothing"


class FirstForwardPlacement:
    """Stands for the GPU's placement (planning/placement.py), which the CPU does not build: records what the runtime
    had started when its first forward hook ran."""

    def __init__(self, runtime):
        self.runtime, self.seen = runtime, []

    def first_forward(self, inputs, kwargs, training):
        self.seen.append((training, self.runtime.prefault is not None))

    def make_room(self, inputs, kwargs, training):
        pass

    def before_forward(self, training):
        pass


def test_with_a_placement_the_moments_wait_for_the_first_training_forwards_promotion():
    engine = engine_for(tiny_llama(), window=2, resident=1, gas=1)
    runtime = engine._sh_runtime
    assert runtime.prefault is not None, "nothing is placed on the CPU: the moments are populated from set-up"
    runtime.prefault.close()
    runtime.prefault, runtime.placement = None, FirstForwardPlacement(runtime)
    batch = {k: v.to(engine.device) for k, v in batches(1)[0].items()}
    with torch.no_grad():
        engine(**batch)
    assert runtime.prefault is None, "an evaluation forward promotes nothing and starts nothing"
    during = []
    hook = engine.module.model.layers[-1].register_forward_pre_hook(lambda *_: during.append(runtime.prefault))
    loss = engine(**batch).loss
    hook.remove()
    assert runtime.placement.seen == [(False, False), (True, False)], "the placement runs first, the thread after it"
    assert during == [None], "the blocks' forward (the first one's compile) runs before the thread starts"
    runtime.placement = None  # the stand-in has done its part: the step runs as on any CPU
    assert runtime.prefault is not None and engine.stronghold_report()["set_up"]["prefault"] is not None
    started = runtime.prefault
    engine.backward(loss)
    engine.step()
    engine(**batch)
    assert runtime.prefault is started, "started once"


def test_a_pinned_buffer_whose_pages_cannot_be_populated_still_reaches_the_register_that_names_the_fix(monkeypatch):
    def short_of_memory(ptr, nbytes):
        raise OSError(errno.ENOMEM, "madvise(MADV_POPULATE_WRITE) failed: ENOMEM")

    monkeypatch.setattr(pinned, "populate", short_of_memory)
    with pytest.raises(MemoryError, match="ulimit -l"):
        pinned.pinned_empty(pinned.EXACT_MIN_BYTES, torch.uint8, register=lambda ptr, nbytes: 2,
                            unregister=lambda ptr: None)
