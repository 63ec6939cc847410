"""Synthetic records and a fake runner for tests of the store, sweeps, search and report."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable

from examples.bench.point import Point
from examples.bench.store import point_fields

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden=64, heads=4, seq=32, batch=2)
_clock = itertools.count()


def record(point: Point, error: str | None = None, *, samples_per_s: float | None = 1.0, commit: str = "c0",
           **extra: Any) -> dict[str, Any]:
    """A stored record of `point` as harness.run_point would write it (dates strictly increasing)."""
    r = point_fields(point)
    r.update(error=error, commit=commit, dirty=False, device="FakeGPU (32 GiB)", timeout_s=480.0,
             date=f"2026-11-21T10:{next(_clock) % 60:02d}:00+00:00")
    if error is None:
        r.update(samples_per_s=samples_per_s, step_s=point.batch / samples_per_s, peak_gpu_GB=10.0, peak_host_GB=20.0)
    r.update(extra)
    return r


class FakeRunner:
    """run(point, timeout_s) that trains up to `limits[system]` layers and OOMs above, counting calls."""

    def __init__(self, limits: dict[str, int], seconds_per_run: float = 10.0, clock: "FakeClock | None" = None,
                 speed: Callable[[Point], float] = lambda p: 10.0 / p.layers) -> None:
        self.limits, self.seconds, self.clock, self.speed = limits, seconds_per_run, clock, speed
        self.calls: list[Point] = []

    def __call__(self, point: Point, timeout_s: float) -> dict[str, Any]:
        self.calls.append(point)
        if self.clock is not None:
            if timeout_s < self.seconds:
                self.clock.now += timeout_s
                return record(point, "timeout", timeout_s=timeout_s)
            self.clock.now += self.seconds
        if point.layers > self.limits[point.system]:
            return record(point, "oom_host" if point.system.startswith("zero") else "oom_gpu")
        return record(point, samples_per_s=self.speed(point))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
