"""Profiler ranges around the engine's host work (stronghold/engine/ranges.py) and the timed wait for a gradient buffer."""
import threading
import time
from types import SimpleNamespace

from torch.profiler import ProfilerActivity, profile

from stronghold.optim.cpu_records import CpuStats
from stronghold.optim.cpu_worker import Worker
from stronghold.engine.ranges import PREFIX, ranged, span
from stronghold.streaming.flag import Flag
from stronghold.streaming.lifecycle import BlockLife


def _names(prof) -> list[str]:
    return [e.name() for e in prof.profiler.kineto_results.events()]


def test_ranges_appear_only_under_a_profiler_and_pass_values_through():
    double = ranged("double", lambda x: 2 * x)
    assert double(3) == 6  # no profiler: the call only
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert double(4) == 8
        with span("wait"):
            pass
    names = _names(prof)
    assert PREFIX + "double" in names and PREFIX + "wait" in names


def test_ranged_adds_each_call_s_seconds_to_its_totals():
    totals: dict = {}
    slow = ranged("slow", lambda: time.sleep(0.01), totals)
    slow()
    slow()
    assert 0.02 <= totals["slow"] < 5.0  # two sleeps of 10 ms; the upper bound only catches a unit error


def test_the_report_has_the_hooks_host_seconds_and_a_reset_clears_them():
    from .helpers import batches, ds_config, tiny_gpt2, train_stronghold

    engine, _ = train_stronghold(tiny_gpt2(4), batches(2), ds_config(window=2, resident=1))
    hooks = engine.stronghold_report(reset=True)["overlap"]["host_hook_s_per_step"]
    # Every streamed block is entered in forward and backward and gets its gradients: each kind of hook ran.
    assert set(hooks) == {"enter", "exit_forward", "enter_backward", "grad_arrived"} and all(v > 0 for v in hooks.values())
    assert engine.stronghold_report()["overlap"]["host_hook_s_per_step"] == {}


class _ReleasingEvent(Flag):
    """An event whose first `wait` (the backward thread's, inside take_grad_buffer) releases `go`: the job that sets
    it is held until the backward thread is waiting, so the wait is real on every run, whatever the machine's speed."""

    def __init__(self, go: threading.Event):
        super().__init__()
        self.go = go

    def wait(self, timeout=None):
        self.go.set()
        return super().wait(timeout)


def test_take_grad_buffer_waits_for_the_worker_and_times_it():
    """The backward thread claims a block's gradient buffer only once the worker released it; the wait is timed."""
    from stronghold.optim.cpu_optim import CpuOptimizer

    class Probe(Worker):
        take_grad_buffer = CpuOptimizer.take_grad_buffer

        def __init__(self):
            super().__init__()
            self.stats = CpuStats()
            self.taken = []

    worker = Probe()
    go = threading.Event()
    life = BlockLife()
    life.grad_free = _ReleasingEvent(go)
    store = SimpleNamespace(index=3, life=life, pool=None)
    try:
        released = []

        def job():
            assert go.wait(60), "the backward thread never waited for the buffer"
            released.append(True)
            life.grads_released()

        worker.submit_after(job)
        start = time.perf_counter()
        worker.take_grad_buffer(store)
        elapsed = time.perf_counter() - start
        assert released and not life.grad_free.is_set()  # it waited for the job, then claimed the buffer
        assert 0 < worker.stats.grad_buffer_wait_s <= elapsed
        life.grads_released()
        before = worker.stats.grad_buffer_wait_s
        worker.take_grad_buffer(store)  # already free: no wait counted
        assert worker.stats.grad_buffer_wait_s == before
    finally:
        worker.close()
