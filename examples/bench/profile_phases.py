"""The compute stream's idle time phase by phase in one profiled step, and who it waited for.

The phase probe (step_probes.py) says how long each phase of a step takes on the GPU; this says why a phase is
longer than plain DeepSpeed's. The profiled step's loop launches a marker kernel (torch.cuda._sleep, a
`spin_kernel` of a few cycles) on the compute stream as each phase begins, so the compute stream's timeline splits
into the phases of every micro-batch without any wait. Within each phase, every idle gap of the compute stream is
one of two kinds, told apart by the kernel that ends it:
- **host late**: that kernel's launch (the CUDA runtime call with its correlation id) ended after the gap began. The
  GPU had run out of work: the launching thread was busy elsewhere. The gap is split over the engine's named ranges
  (`stronghold.*`) that the launching thread was inside between the gap's start and the launch, the rest counted as
  `outside`; `late_ops` names the torch ops running on that thread then (nested ops each count, so they can sum
  above the gap time).
- **waited**: the kernel was launched before the gap began, so the stream waited on an event (a slot's H2D, or
  anything else). Named by the copy that ended within RESUME_NS before the gap did, else `other`.
Seconds are summed over the micro-batches of each phase name.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

MARKER = "spin_kernel"
RESUME_NS = 50_000
"""As profile_step.RESUME_NS: a gap ending this soon after a copy ends counts as a wait for that copy."""
LONG_NS = 1_000_000
"""Host ops longer than this are searched one by one; shorter ones through a sorted index (few ops are long)."""
TOP_OPS = 12


def _copy_kind(name: str) -> str:
    return "DtoH" if "DtoH" in name else "HtoD" if "HtoD" in name else name.split(" ")[0]


class _HostIndex:
    """One thread's host ops, to find those overlapping a time window."""

    def __init__(self, ops: list[tuple[int, int, str]]):
        short = sorted(op for op in ops if op[1] - op[0] <= LONG_NS)
        self.starts = [op[0] for op in short]
        self.short = short
        self.long = [op for op in ops if op[1] - op[0] > LONG_NS]

    def overlapping(self, start: int, stop: int) -> list[tuple[int, int, str]]:
        lo = bisect.bisect_left(self.starts, start - LONG_NS)
        hi = bisect.bisect_right(self.starts, stop)
        found = [op for op in self.short[lo:hi] if op[1] > start and op[0] < stop]
        return found + [op for op in self.long if op[1] > start and op[0] < stop]


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def phase_idle(events: list[Any], phases: list[str], compute: Any, range_prefix: str) -> dict[str, Any]:
    """`events`: the profiler's kineto events; `phases`: the names the loop marked, in order (the last, "end", closes
    the step); `compute`: the compute stream's id."""
    import torch

    from .profile_step import _union_s  # here: profile_step imports this module

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    gpu = [e for e in events if e.device_type() == cuda]
    stream = sorted((e for e in gpu if e.device_resource_id() == compute), key=lambda e: e.start_ns())
    markers = [e for e in stream if MARKER in e.name()]
    if len(markers) != len(phases):
        return {"error": f"{len(markers)} marker kernels on the compute stream for {len(phases)} marks"}
    copies = sorted((e.end_ns(), _copy_kind(e.name())) for e in gpu
                    if e.device_resource_id() != compute and e.name().startswith(("Memcpy", "Memset")))
    copy_ends = [end for end, _ in copies]
    # CUDA runtime and driver calls (cudaLaunchKernel, cuLaunchKernel for Triton's kernels, cudaMemcpyAsync...).
    launches = {e.correlation_id(): e for e in events
                if e.device_type() == cpu and e.name().startswith("cu") and e.correlation_id()}
    by_thread: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for e in events:
        if e.device_type() == cpu and not e.name().startswith("cu"):
            by_thread[e.start_thread_id()].append((e.start_ns(), e.end_ns(), e.name()))
    hosts = {thread: _HostIndex(ops) for thread, ops in by_thread.items()}

    out: dict[str, dict[str, Any]] = {}
    bounds = [m.start_ns() for m in markers]
    for k, phase in enumerate(phases[:-1]):
        start, stop = bounds[k], bounds[k + 1]
        row = out.setdefault(phase, {"count": 0, "span_s": 0.0, "busy_s": 0.0, "gaps": 0, "host_late_s": 0.0,
                                     "waited_s": defaultdict(float), "late_ranges_s": defaultdict(float),
                                     "late_ops_s": defaultdict(float)})
        row["count"] += 1
        row["span_s"] += (stop - start) / 1e9
        inside = [e for e in stream if start <= e.start_ns() < stop]
        end = None
        for e in inside:
            s, t = e.start_ns(), e.end_ns()
            if end is not None and s > end:
                _gap(row, end, s, e, launches, hosts, copies, copy_ends, range_prefix)
            end = t if end is None else max(end, t)
        row["busy_s"] += _union_s([(e.start_ns(), min(e.end_ns(), stop)) for e in inside])
    for row in out.values():
        row["idle_s"] = row["span_s"] - row["busy_s"]
        for key in ("waited_s", "late_ranges_s"):
            row[key] = {k: round(v, 6) for k, v in sorted(row[key].items(), key=lambda kv: -kv[1])}
        row["late_ops_s"] = {k: round(v, 6) for k, v in sorted(row["late_ops_s"].items(), key=lambda kv: -kv[1])[:TOP_OPS]}
        for key in ("span_s", "busy_s", "idle_s", "host_late_s"):
            row[key] = round(row[key], 6)
    return out


def _gap(row: dict, g0: int, g1: int, next_kernel: Any, launches: dict, hosts: dict, copies: list,
         copy_ends: list, range_prefix: str) -> None:
    row["gaps"] += 1
    seconds = (g1 - g0) / 1e9
    launch = launches.get(next_kernel.correlation_id())
    if launch is not None and launch.end_ns() > g0:
        row["host_late_s"] += seconds
        until = min(launch.start_ns(), g1)
        index = hosts.get(launch.start_thread_id())
        ops = index.overlapping(g0, until) if index is not None and until > g0 else []
        window = max(until - g0, 1)
        ranged = 0
        for s, t, name in ops:
            share = _overlap(s, t, g0, until) / window * seconds
            if name.startswith(range_prefix):
                row["late_ranges_s"][name] += share
                ranged = max(ranged, _overlap(s, t, g0, until))
            else:
                row["late_ops_s"][name] += share
        row["late_ranges_s"]["outside"] += (1 - ranged / window) * seconds
        return
    i = bisect.bisect_right(copy_ends, g1) - 1
    kind = copies[i][1] if i >= 0 and copy_ends[i] >= g1 - RESUME_NS else "other"
    row["waited_s"][kind] += seconds
