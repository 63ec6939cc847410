"""profile_step.summarize: per-stream busy time as the union of intervals, copies apart from kernels."""
import pytest
import torch

from examples.bench.profile_step import _union_s, summarize


class Event:
    def __init__(self, name, stream, start, end, device=torch.autograd.DeviceType.CUDA, correlation=0, thread=0):
        self._name, self._stream, self._start, self._end, self._device = name, stream, start, end, device
        self._correlation, self._thread = correlation, thread

    def correlation_id(self):
        return self._correlation

    def start_thread_id(self):
        return self._thread

    def name(self):
        return self._name

    def device_type(self):
        return self._device

    def device_resource_id(self):
        return self._stream

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end


def test_union_counts_overlaps_once():
    assert _union_s([(0, 10), (5, 15), (20, 30)]) == 25e-9
    assert _union_s([(0, 100), (10, 20)]) == 100e-9 and _union_s([]) == 0.0


def test_streams_kernels_and_copies():
    cpu = torch.autograd.DeviceType.CPU
    events = [Event("gemm", 7, 0, 1000), Event("gemm", 7, 500, 1500), Event("Memcpy HtoD", 20, 0, 3000),
              Event("aten::mm", 0, 0, 9000, cpu), Event("stronghold.enter", 0, 0, 400, cpu),
              Event("stronghold.enter", 0, 1000, 1100, cpu)]
    out = summarize(events, wall_s=1e-5)
    assert out["streams"]["7"] == {"busy_s": 1.5e-6, "kernel_busy_s": 1.5e-6, "copy_busy_s": 0.0, "events": 2}
    assert out["streams"]["20"]["copy_busy_s"] == 3e-6 and out["streams"]["20"]["kernel_busy_s"] == 0.0
    assert out["gpu_kernel_busy_s"] == 1.5e-6 and out["gpu_events"] == 3
    assert out["top_kernels"][0] == {"name": "Memcpy HtoD", "calls": 1, "total_s": 3e-6}
    assert out["top_kernels"][1]["calls"] == 2
    assert out["host_ranges"] == {"stronghold.enter": {"calls": 2, "total_s": 5e-7}}


def test_compute_idle_tells_waits_for_copies_apart():
    # Compute stream 7 (microseconds): busy 0-1000, 3000-4000, 6000-7000. The first gap ends 10 us after a D2H ends
    # (within RESUME_NS: a wait for it); the second has an H2D inside it that ends 1000 us before the gap does.
    us = 1000
    events = [Event("gemm", 7, 0, 1000 * us), Event("gemm", 7, 3000 * us, 4000 * us),
              Event("gemm", 7, 6000 * us, 7000 * us),
              Event("Memcpy DtoH (Device -> Pinned)", 21, 500 * us, 2990 * us),
              Event("Memcpy HtoD (Pinned -> Device)", 20, 4500 * us, 5000 * us)]
    idle = summarize(events, wall_s=1e-2)["compute_idle"]
    assert idle["stream"] == "7" and idle["gaps"] == 2 and idle["idle_s"] == 4e-3
    assert idle["idle_ending_with_copy_s"] == {"DtoH": 2e-3}
    assert idle["idle_during_copies_s"] == (1990 + 500) * 1e-6


def test_python_profile_ranks_the_launching_threads_functions():
    """The cProfile summary of a step: the function that burns the time is first by own time, and the one that calls
    it first by cumulative time below the runner itself."""
    import time

    from examples.bench.profile_step import python_profile_one_step

    def burn():
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass

    def step():
        for _ in range(3):
            burn()
        return 0.15

    out = python_profile_one_step(step)
    assert out["step_s"] == 0.15
    names = [r["function"] for r in out["top_own"]]
    assert names[0].startswith("burn (") or names[0].startswith("<built-in method time.perf_counter>"), names[:3]
    burn_row = next(r for r in out["top_cumulative"] if r["function"].startswith("burn ("))
    assert burn_row["calls"] == 3 and burn_row["cumulative_s"] >= 0.15


def test_phases_split_idle_into_host_late_and_waited():
    """Compute stream 7, microseconds. Phase `backward` (marker at 0) then `step` (marker at 10000), `end` at 20000.
    Gap 1000-3000 ends with a kernel launched at 2900-2950: the host was late; over [1000, 2900] the launching thread
    was in stronghold.grad_arrived for 1000 us and in aten::copy_ for 800 us. Gap 4000-6000 ends with a kernel
    launched at 100 (queued long before) as a D2H ends at 5990: a wait for the D2H."""
    us, cpu = 1000, torch.autograd.DeviceType.CPU
    events = [Event("spin_kernel(long)", 7, 0, 1 * us), Event("gemm", 7, 1 * us, 1000 * us),
              Event("gemm", 7, 3000 * us, 4000 * us, correlation=2), Event("gemm", 7, 6000 * us, 7000 * us, correlation=3),
              Event("spin_kernel(long)", 7, 10000 * us, 10001 * us), Event("gemm", 7, 10001 * us, 20000 * us),
              Event("spin_kernel(long)", 7, 20000 * us, 20001 * us),
              Event("Memcpy DtoH (Device -> Pinned)", 21, 4500 * us, 5990 * us),
              Event("cudaLaunchKernel", 0, 2900 * us, 2950 * us, cpu, correlation=2, thread=5),
              Event("cudaLaunchKernel", 0, 100 * us, 110 * us, cpu, correlation=3, thread=5),
              Event("stronghold.grad_arrived", 0, 1000 * us, 2000 * us, cpu, thread=5),
              Event("aten::copy_", 0, 2000 * us, 2800 * us, cpu, thread=5),
              Event("aten::mm", 0, 1000 * us, 2000 * us, cpu, thread=6)]  # another thread: not the launcher's
    phases = summarize(events, wall_s=2e-2, phases=["backward", "step", "end"])["phases"]
    back = phases["backward"]
    assert back["count"] == 1 and back["gaps"] == 2 and back["span_s"] == 0.01
    assert back["busy_s"] == 3e-3 and back["idle_s"] == 7e-3  # 7000-10000 is idle too, before the next marker
    assert back["host_late_s"] == 2e-3 and back["waited_s"] == {"DtoH": 2e-3}
    # The late gap's 2000 us split in proportion to the 1900 us between its start and the launch.
    assert back["late_ranges_s"]["stronghold.grad_arrived"] == pytest.approx(2e-3 * 1000 / 1900, abs=1e-6)
    assert back["late_ranges_s"]["outside"] == pytest.approx(2e-3 * 900 / 1900, abs=1e-6)
    assert back["late_ops_s"] == {"aten::copy_": pytest.approx(2e-3 * 800 / 1900, abs=1e-6)}
    assert phases["step"]["gaps"] == 0 and phases["step"]["idle_s"] == 0.0


def test_phases_report_a_marker_mismatch():
    events = [Event("spin_kernel(long)", 7, 0, 10), Event("gemm", 7, 10, 100)]
    assert "error" in summarize(events, wall_s=1e-6, phases=["forward", "backward", "end"])["phases"]


def test_the_compute_stream_is_not_the_collectives_one():
    # A rank ahead of its peer: its reduce-scatter kernel spins from launch until the peer joins, longer than any
    # compute kernel runs; the compute stream is still the one with the gemms.
    us = 1000
    events = [Event("gemm", 7, 0, 1000 * us), Event("gemm", 7, 2000 * us, 3000 * us),
              Event("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 21, 0, 5000 * us)]
    assert summarize(events, wall_s=1e-2)["compute_idle"]["stream"] == "7"
