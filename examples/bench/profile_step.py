"""Where one optimizer step's time goes on the GPU: torch.profiler over one extra step after the timed ones
(`python -m examples.bench.run_one ... --profile`), summarized into the point's record as plain numbers.

The question it answers is the one a step-time ratio cannot: is the slower system's GPU busy for longer (more or
slower kernels: compare `streams[...]["busy_s"]` and `top_kernels`), or idle for longer (waits on copies, the CPU,
events: `busy_s` far below `wall_s`)? Per CUDA stream the busy time is the union of its events' intervals, so
overlapping launches are not counted twice; copies are reported apart from kernels. `host_ranges` sums the
engine's named ranges on the launching thread (its hooks, and the waits for a CPU update or a gradient buffer).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Optional

from .profile_phases import phase_idle

TOP = 15
RANGE_PREFIX = "stronghold."
"""stronghold.engine.ranges.PREFIX (not imported: summarizing a record needs no engine)."""


def _union_s(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by (start_ns, end_ns) intervals."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e9


def _is_copy(event: Any) -> bool:
    return event.name().startswith(("Memcpy", "Memset"))


RESUME_NS = 50_000
"""A compute-stream gap that ends within this long after a copy on another stream ends counts as a wait for it."""


def _gaps(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The idle (start_ns, end_ns) between the union of `intervals`, from its first start to its last end."""
    gaps, end = [], None
    for start, stop in sorted(intervals):
        if end is not None and start > end:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def _is_collective(event: Any) -> bool:
    return event.name().startswith("nccl")  # the kernels (ncclDevKernel_...) and their ranges (nccl:...)


def compute_stream(by_stream: dict[int, list]) -> Any:
    """The stream with the most kernel time, collectives left out (None without kernels): a collective's kernel runs
    from its launch until every rank has joined, so on a rank that is ahead the communication stream can hold more
    kernel time than the compute stream."""
    kernel_time = {s: _union_s([(e.start_ns(), e.end_ns()) for e in evs if not (_is_copy(e) or _is_collective(e))])
                   for s, evs in by_stream.items()}
    return max(kernel_time, key=kernel_time.get) if kernel_time else None


def compute_idle(by_stream: dict[int, list], compute: Any) -> dict[str, Any]:
    """The compute stream (the most kernel time) between its first and last event: idle seconds, of them the gaps
    that end as a copy on another stream ends (within RESUME_NS: compute waited for that copy's event, e.g. a
    slot's weights or a block's D2H), and the idle time during which some copy ran. `compute`: compute_stream's."""
    if compute is None:
        return {}
    gaps = _gaps([(e.start_ns(), e.end_ns()) for e in by_stream[compute]])
    copies = [(e.start_ns(), e.end_ns(), e.name()) for s, evs in by_stream.items() if s != compute
              for e in evs if _is_copy(e)]
    after: dict[str, float] = defaultdict(float)
    during = 0.0
    for start, stop in gaps:
        overlap = [(max(a, start), min(b, stop)) for a, b, _ in copies if b > start and a < stop]
        during += _union_s(overlap)
        ended = [name for a, b, name in copies if stop - RESUME_NS <= b <= stop]
        if ended:
            after[ended[0].split(" ")[1] if " " in ended[0] else ended[0]] += (stop - start) / 1e9
    return {"stream": str(compute), "idle_s": sum(b - a for a, b in gaps) / 1e9, "gaps": len(gaps),
            "idle_ending_with_copy_s": dict(after), "idle_during_copies_s": during}


def summarize(events: list[Any], wall_s: float, phases: Optional[list[str]] = None) -> dict[str, Any]:
    """`events`: the profiler's kineto events (name(), device_type(), device_resource_id(), start_ns(), end_ns());
    `phases`: the names of the marker kernels the step launched, in order (profile_phases.py), if it did."""
    import torch

    gpu = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA]
    by_stream: dict[int, list] = defaultdict(list)
    for e in gpu:
        by_stream[e.device_resource_id()].append(e)
    streams = {}
    for stream, evs in by_stream.items():
        copies = [e for e in evs if _is_copy(e)]
        kernels = [e for e in evs if not _is_copy(e)]
        streams[str(stream)] = {
            "busy_s": _union_s([(e.start_ns(), e.end_ns()) for e in evs]),
            "kernel_busy_s": _union_s([(e.start_ns(), e.end_ns()) for e in kernels]),
            "copy_busy_s": _union_s([(e.start_ns(), e.end_ns()) for e in copies]),
            "events": len(evs),
        }
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        totals[e.name()][0] += 1
        totals[e.name()][1] += (e.end_ns() - e.start_ns()) / 1e9
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:TOP]
    kernels_all = [e for e in gpu if not _is_copy(e)]
    # The engine's named ranges on the host (stronghold/engine/ranges.py: hooks, waits; nested ones counted in each).
    host: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith(RANGE_PREFIX):
            host[e.name()][0] += 1
            host[e.name()][1] += (e.end_ns() - e.start_ns()) / 1e9
    compute = compute_stream(by_stream)
    out = {
        "wall_s": wall_s,
        "gpu_kernel_busy_s": _union_s([(e.start_ns(), e.end_ns()) for e in kernels_all]),
        "gpu_events": len(gpu),
        "streams": streams,
        "compute_idle": compute_idle(by_stream, compute),
        "top_kernels": [{"name": name[:120], "calls": n, "total_s": s} for name, (n, s) in top],
        "host_ranges": {name: {"calls": n, "total_s": s} for name, (n, s) in sorted(host.items())},
    }
    if phases and compute is not None:
        out["phases"] = phase_idle(events, phases, compute, RANGE_PREFIX)
    return out


def profile_one_step(run_step: Callable[[Callable[[str], None]], float]) -> dict[str, Any]:
    """Profile `run_step` (one optimizer step, returning its wall seconds; it calls the mark it is given as each
    phase begins) and summarize it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    phases: list[str] = []

    def mark(phase: str) -> None:
        phases.append(phase)
        torch.cuda._sleep(1)  # a marker kernel on the current (compute) stream: profile_phases.MARKER

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s = run_step(mark)
    return summarize(list(prof.profiler.kineto_results.events()), wall_s, phases)


PY_TOP = 40


def python_profile_one_step(run: Callable[[], float]) -> dict[str, Any]:
    """cProfile over one more step: which Python functions and torch calls the host time of a launch-bound step goes
    to. From Python 3.12 cProfile records every thread (sys.monitoring), so stronghold's CPU-optimizer jobs
    (cpu_optim, cpu_adam) appear beside the launching thread's calls: tell them apart by function. It adds
    about a microsecond to every call it records, so the shares matter, not the seconds. The top PY_TOP by own
    time and by cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        step_s = run()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        where = f"{path.rsplit('/site-packages/', 1)[-1].rsplit('/work/main/', 1)[-1]}:{line}" if line else path
        rows.append({"function": f"{name} ({where})", "calls": calls, "own_s": round(own, 6),
                     "cumulative_s": round(cumulative, 6)})
    rows.sort(key=lambda r: -r["own_s"])
    return {"step_s": step_s, "total_own_s": round(sum(r["own_s"] for r in rows), 6), "top_own": rows[:PY_TOP],
            "top_cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:PY_TOP]}
