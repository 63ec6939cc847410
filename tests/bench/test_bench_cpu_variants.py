"""cpu_variants: the probe's cycle over timed steps, and the engine's objects as they were once it closes."""
import os
import sys
import threading

import pytest

from examples.bench.cpu_variants import CpuVariants


class Kernel:
    threads = 15

    def __init__(self):
        self.threads = 15
        self.seen = []

    def accumulate(self, acc, g, first):
        self.seen.append(self.threads)
        return 1.0


class Cpu:
    """The worker's two calls the probe uses: a job runs on another thread, as on the engine's worker."""

    def __init__(self):
        self.kernel = Kernel()

    def submit_after(self, job):
        thread = threading.Thread(target=job)
        thread.start()
        thread.join()

    def wait(self, event, what):
        assert event.wait(5), what


class Runtime:
    def __init__(self):
        self.cpu = Cpu()


def test_cycle_and_restore(monkeypatch):
    policies = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, policy, param: policies.append(policy))
    runtime = Runtime()
    kernel = runtime.cpu.kernel
    variants = CpuVariants(runtime, ["default", "skip", "idle", "threads4"])
    assert [variants.apply() for _ in range(5)] == ["default", "skip", "idle", "threads4", "default"]
    assert policies == [os.SCHED_IDLE, os.SCHED_OTHER]  # set on a change only
    variants.count = 1
    assert variants.apply() == "skip" and kernel.accumulate(None, None, True) == 0.0 and kernel.threads == 15
    variants.count = 3
    assert variants.apply() == "threads4" and kernel.threads == 4 and kernel.accumulate(None, None, True) == 1.0
    variants.count = 1
    variants.apply()
    variants.close()
    assert kernel.threads == 15 and kernel.accumulate(None, None, True) == 1.0
    assert policies[-1] == os.SCHED_OTHER


def test_switch_interval_is_set_per_step_and_restored():
    before = sys.getswitchinterval()
    variants = CpuVariants(Runtime(), ["switch50", "default", "switch0.5"])
    try:
        variants.apply()
        assert sys.getswitchinterval() == pytest.approx(0.05)
        variants.apply()
        assert sys.getswitchinterval() == pytest.approx(before)
        variants.apply()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        variants.close()
    assert sys.getswitchinterval() == pytest.approx(before)


def test_acc_variant_runs_only_the_accumulation_on_fewer_threads():
    runtime = Runtime()
    variants = CpuVariants(runtime, ["acc4", "default"])
    variants.apply()
    assert runtime.cpu.kernel.accumulate(None, None, True) == 1.0 and runtime.cpu.kernel.threads == 15
    variants.apply()
    runtime.cpu.kernel.accumulate(None, None, True)
    variants.close()
    assert runtime.cpu.kernel.seen == [4, 15]


def test_nod2h_copies_only_at_the_boundary():
    calls = []

    class Transfers:
        def offload(self, pieces, sq, sq_destination, done):
            calls.append(list(pieces))

    runtime = Runtime()
    runtime.transfers, runtime.boundary = Transfers(), False
    variants = CpuVariants(runtime, ["nod2h", "default"])
    variants.apply()
    runtime.transfers.offload(["g"], None, None, None)
    runtime.boundary = True
    runtime.transfers.offload(["g"], None, None, None)
    runtime.boundary = False
    variants.apply()
    runtime.transfers.offload(["g"], None, None, None)
    variants.close()
    assert calls == [[], ["g"], ["g"]] and "offload" not in vars(runtime.transfers)


def test_nopair_sets_the_spare_buffers_aside_and_back():
    from types import SimpleNamespace
    runtime = Runtime()
    spare = object()
    runtime.stores = {3: SimpleNamespace(grad_spare=spare)}
    variants = CpuVariants(runtime, ["nopair", "default"])
    variants.apply()
    assert runtime.stores[3].grad_spare is None
    variants.apply()
    assert runtime.stores[3].grad_spare is spare
    variants.count = 0
    variants.apply()
    variants.close()
    assert runtime.stores[3].grad_spare is spare


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="'fast'"):
        CpuVariants(Runtime(), ["default", "fast"])
