"""A probe, not a setting: the CPU optimizer's jobs and the launching thread's waits on one clock, for chosen timed
steps, to say what the first forward of a step waits for (the Llama GA 8 point: 0.10-0.17 s over plain's).

Set STRONGHOLD_BENCH_TIMELINE to the timed steps to record (e.g. "2,3": 0-based, consecutive steps give the boundary
between them). Each recorded step's per_step entry gets `timeline`: rows [what, block, start_ms, end_ms] on one clock
whose zero is the first recorded step's start, so the rows of consecutive steps join up:
- `sum`, `acc`, `early`, `preview`, `final`, `job`: the worker's jobs (cpu_optim.py: the boundary sum of squares, a
  micro-step's accumulation or parking, the early update behind a sum, a weights-first preview, a full update or second
  pass, anything else), with the block they serve (-1: none found);
- `wait`: the launching thread blocked on a block's CPU update before its load (window.py);
- `norm`, `finish`: step()'s wait for every sum (grad_sq_sum) and its finish_step;
- `enter`: a streamed block's forward or backward begins on the launching thread (start = end);
- `mark:<phase>`: the bench loop's phase marks (step_probes.py), block -1.
`python -m examples.bench.cpu_timeline RECORDS.jsonl` prints each recorded boundary block by block.

The engine is changed only through its own objects' instance attributes, and only while the run lasts (`close`)."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Optional

ENV = "STRONGHOLD_BENCH_TIMELINE"
_KINDS = {"decide": "sum", "accumulate_only": "acc", "<lambda>": "early", "_preview_job": "preview", "_final_job": "final"}


def from_env(engine: Any) -> Optional["CpuTimeline"]:
    steps = [int(s) for s in os.environ.get(ENV, "").split(",") if s.strip()]
    runtime = getattr(engine, "stronghold_runtime", None)
    if not steps or runtime is None or runtime.cpu is None or runtime.window is None:
        return None
    return CpuTimeline(runtime, set(steps))


def _kind(job: Callable[[], None]) -> str:
    parts = getattr(job, "__qualname__", "").split(".")
    for part in reversed(parts):
        if part in _KINDS:
            return _KINDS[part]
    return "job"


def _block(job: Callable[[], None]) -> int:
    for cell in getattr(job, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        store = getattr(value, "store", value)
        index = getattr(store, "index", None)
        if isinstance(index, int) and hasattr(store, "master"):
            return index
    return -1


class CpuTimeline:
    def __init__(self, runtime: Any, steps: set[int]):
        self.runtime, self.steps = runtime, steps
        self.rows: list[list] = []
        self.origin: Optional[float] = None
        self.on = False
        self.timed = -1
        self._undo: list[tuple[Any, str, bool, Callable]] = []
        cpu, window = runtime.cpu, runtime.window
        self._wrap(cpu, "_execute", lambda real: lambda job: self._span(_kind(job), _block(job), real, job))
        self._wrap(cpu, "grad_sq_sum", lambda real: lambda: self._span("norm", -1, real))
        self._wrap(cpu, "finish_step", lambda real: lambda *a, **k: self._span("finish", -1, real, *a, **k))
        self._wrap(window, "wait", lambda real: lambda event, what: self._span("wait", _what_block(what), real, event, what))
        self._wrap(window, "enter", lambda real: lambda block: (self._point("enter", block), real(block))[1])

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        real = getattr(obj, name)
        own = name in vars(obj)
        setattr(obj, name, make(real))
        self._undo.append((obj, name, own, real))

    def _span(self, kind: str, block: int, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if self.on:
                self.rows.append([kind, block, self._ms(start), self._ms(time.perf_counter())])

    def _point(self, kind: str, block: int) -> None:
        if self.on:
            now = self._ms(time.perf_counter())
            self.rows.append([kind, block, now, now])

    def _ms(self, t: float) -> float:
        return round((t - self.origin) * 1e3, 2)

    def mark(self, phase: str) -> None:
        self._point(f"mark:{phase}", -1)

    def before(self, timed: bool) -> None:
        """A step begins; record it if it is one of the chosen timed steps."""
        self.timed += 1 if timed else 0
        self.on = timed and self.timed in self.steps
        if self.on and self.origin is None:
            self.origin = time.perf_counter()

    def after(self) -> Optional[list[list]]:
        """The recorded step's rows (worker jobs still running past the step's end land in the next recorded one)."""
        if not self.on:
            return None
        rows, self.rows = self.rows, []
        return rows

    def close(self) -> None:
        self.on = False
        for obj, name, own, real in reversed(self._undo):
            if own:
                setattr(obj, name, real)
            else:
                delattr(obj, name)


def _what_block(what: str) -> int:
    words = what.split()
    return int(words[words.index("block") + 1]) if "block" in words and words[-1] != "block" else -1


def boundary(rows: list[list]) -> list[str]:
    """Block by block around each update: its sum, early update or preview, and when the next forward entered it."""
    lines = []
    updates = [r[2] for r in rows if r[0] == "mark:update"]
    for t_update in updates:
        t_last = max(r[2] for r in rows if r[0] == "mark:last_backward" and r[2] <= t_update)
        later = [r[2] for r in rows if r[0] == "mark:first_forward" and r[2] > t_update]
        t_next = later[0] if later else None
        ends = [r[2] for r in rows if r[0] == "mark:forward" and t_next is not None and r[2] > t_next]
        t_end = ends[0] if ends else float("inf")
        norm = [r for r in rows if r[0] == "norm" and r[2] >= t_update]
        finish = [r for r in rows if r[0] == "finish" and r[2] >= t_update]
        lines.append(f"last backward at {t_last:.1f} ms; step() at {t_update - t_last:.1f}; norm waited "
                     f"{norm[0][3] - norm[0][2] if norm else float('nan'):.1f} ms; finish_step "
                     f"{finish[0][3] - finish[0][2] if finish else float('nan'):.1f} ms; next first forward at "
                     f"{(t_next - t_last) if t_next is not None else float('nan'):.1f} (ms after the last backward began)")
        blocks = sorted({r[1] for r in rows if r[0] in ("sum", "early", "preview") and r[1] >= 0 and r[2] >= t_last})
        for block in blocks:
            cells = [f"block {block:3d}"]
            for kind in ("sum", "early", "preview", "final"):
                spans = [r for r in rows if r[0] == kind and r[1] == block and t_last <= r[2] < t_end]
                cells += [f"{kind} {s[2] - t_last:7.1f}-{s[3] - t_last:7.1f}" for s in spans[:1]]
            enters = [r[2] - t_last for r in rows if r[0] == "enter" and r[1] == block and t_next is not None
                      and t_next <= r[2] < t_end]
            waits = [r[3] - r[2] for r in rows if r[0] == "wait" and r[1] == block and t_next is not None
                     and t_next <= r[2] < t_end]
            if enters:
                cells.append(f"entered {enters[0]:7.1f}")
            if waits:
                cells.append(f"waited {sum(waits):5.1f}")
            lines.append("  " + "; ".join(cells))
    return lines


def main(paths: list[str]) -> None:
    for path in paths:
        for line in open(path):
            record = json.loads(line)
            rows = [row for step in record.get("per_step", []) for row in step.get("timeline", [])]
            if rows:
                print(f"{path}: {record.get('key', record.get('system'))}")
                print("\n".join(boundary(rows)))


if __name__ == "__main__":
    main(sys.argv[1:])
