"""A sweep: points run one after another under a time budget, each cached in the results store.

The GPU machine allows 10 minutes a command, so a sweep gets `budget_s` and stops cleanly
(BudgetExhausted) before it would overrun: a point is started only with at least `min_start_s`
left, and runs under min(point_timeout_s, time left). A point cut short by the budget (rather
than by its own timeout) is not recorded, so the next command runs it again in full.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .harness import RunnerConfig, run_point
from .markdown import cap_label, fmt, outcome, table
from .point import Point
from .store import CAPACITY_ERRORS, ResultStore

RunFn = Callable[[Point, float], dict[str, Any]]


class BudgetExhausted(Exception):
    """The sweep's time budget is spent; what finished is in the store."""


class SearchAborted(Exception):
    """A point failed for a reason other than memory or time: the search cannot trust it."""


@dataclass(kw_only=True)
class SweepConfig:
    figure: str
    """Names the results file (results/bench/<figure>.jsonl) new records go to."""
    budget_s: float = 500.0
    """Wall-clock seconds this command may spend on points (the GPU machine allows 600 a command,
    which also covers installing DeepSpeed's wheels and starting Python)."""
    point_timeout_s: float = 450.0
    """Wall-clock limit of one point, init included; longer is recorded as `timeout`."""
    min_start_s: float = 90.0
    """Do not start a point with less than this left: it would be cut by the budget anyway."""

    def __post_init__(self) -> None:
        for name in ("budget_s", "point_timeout_s", "min_start_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")


@dataclass
class Row:
    record: dict[str, Any]
    source: str
    """'new', 'cached' or 'cut' (stopped by the budget, not recorded)."""


@dataclass(kw_only=True)
class Sweep:
    config: SweepConfig
    store: ResultStore
    run: RunFn
    """(point, timeout_s) -> record; harness.run_point in real use, a fake in tests."""
    clock: Callable[[], float] = time.monotonic
    rows: list[Row] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def remaining_s(self) -> float:
        return self.config.budget_s - (self.clock() - self.started)

    def point(self, point: Point) -> dict[str, Any]:
        """The record for `point`: from the store, or run now (raises BudgetExhausted)."""
        cached = self.store.lookup(point, self.config.point_timeout_s)
        if cached is not None:
            self.rows.append(Row(cached, "cached"))
            return cached
        remaining = self.remaining_s()
        if remaining < self.config.min_start_s:
            raise BudgetExhausted(f"{remaining:.0f} s left, less than min_start_s={self.config.min_start_s:g}")
        timeout_s = min(self.config.point_timeout_s, remaining)
        print(f"[bench] {point.label()}: running (limit {timeout_s:.0f} s)", flush=True)
        record = self.run(point, timeout_s)
        if record.get("error") == "timeout" and timeout_s < self.config.point_timeout_s:
            self.rows.append(Row(record, "cut"))
            raise BudgetExhausted(f"{point.label()} was cut at {timeout_s:.0f} s by the budget; rerun to resume")
        record["figure"] = self.config.figure
        self.store.append(self.config.figure, record)
        self.rows.append(Row(record, "new"))
        print(f"[bench] {point.label()}: {outcome(record)}", flush=True)
        return record

    def fits(self, point: Point) -> bool:
        """For the search: did `point` train? Memory and time failures say no; other errors abort."""
        record = self.point(point)
        error = record.get("error")
        if error is None:
            return True
        if error in CAPACITY_ERRORS:
            return False
        raise SearchAborted(f"{point.label()} failed with {error}: {str(record.get('error_detail', ''))[-300:]}")

    def summary(self) -> str:
        header = ["system", "layers", "seq", "params B", "cap", "outcome", "samples/s", "s/step", "peak GPU GiB",
                  "peak host GiB", "from"]
        return table(header, (
            [r.get("system"), r.get("layers"), r.get("seq"), fmt(r.get("params_B"), 3), cap_label(r.get("gpu_cap_GB")), outcome(r),
             fmt(r.get("samples_per_s"), 3), fmt(r.get("step_s"), 3), fmt(r.get("peak_gpu_GB"), 1),
             fmt(r.get("peak_host_GB"), 1), row.source]
            for row in self.rows for r in (row.record,)
        ))


def make_runner(config: RunnerConfig, store: ResultStore) -> RunFn:
    return lambda point, timeout_s: run_point(point, timeout_s, config, store.provenance)
