"""Python's full garbage collections at optimizer-step boundaries, every N steps, on every rank at the same step.

Why: a full (oldest-generation) collection walks every object the process tracks (torch, transformers, DeepSpeed,
the compiled blocks, the model: hundreds of thousands of objects), so it pauses the thread that launches GPU work
for 0.2-0.7 s, and the interpreter starts one whenever enough objects have survived into the oldest generation,
which in a training step is a matter of where its young collections happened to fall (the CPU worker thread
allocates too). In data parallel each rank's collections fall on different steps, and every collective waits for
the slowest rank, so each rank's pause costs the whole job a step (the data-parallel records in
results/placement/ show it: a step with a collection on either rank is longer by about that pause). Megatron-LM
(`--manual-gc`) and torchtitan (`gc_freq`) take the same remedy for the same reason.

What: automatic full collections are switched off (the oldest generation's threshold, `gc.set_threshold`); the
young generations still collect as before, so short-lived cycles are freed as they always were. At the second
optimizer-step boundary one full collection is run and timed, and the interval is set so that these collections
take about COST_SHARE of the step time, at most MAX_GAP_S apart; data-parallel ranks take the largest interval
of all (one object all-gather). From then on a full collection runs every that many steps, at the boundary, and
each sets the next interval again from its own time and the median step since the one before: the second step
can be several times a steady one (the first step's deferred updates, promotion), and an interval from it alone
collected several times too often. A number in the setting fixes the interval; "python" leaves the collector
alone.

The collector is process-wide: the thresholds are changed while any engine that changed them is alive, and put back
as the last one is closed (or collected). A script that turned the collector off itself (`gc.disable()`) is left
alone. From Python 3.14 the interpreter collects the oldest generation incrementally, in small pauses: "auto" then
leaves it alone, and a number only adds the collections at the boundaries.
"""
from __future__ import annotations

import gc
import logging
import math
import statistics
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional, Union

import torch

from stronghold.engine.interrupts import deferred_interrupt

logger = logging.getLogger(__name__)

COST_SHARE = 0.01
"""The share of the step time that the boundary collections may take on average."""
MAX_GAP_S = 30.0
"""At most this long between two full collections (at the measured step time): cyclic garbage that outlived the
young collections waits at most this long to be freed."""
FIRST_BOUNDARY = 2
"""The boundary whose collection is timed: the first step carries compilation and placement, not a step's time."""
NO_AUTOMATIC = 2 ** 31 - 1
"""The oldest generation's threshold that the interpreter never reaches (a C int)."""
INCREMENTAL = sys.version_info >= (3, 14)
"""The interpreter's oldest generation is collected in increments, without a long pause."""


@dataclass
class CollectorReport:
    mode: str
    """"steps" (the boundaries collect), "python" (the interpreter's own collector)."""
    interval_steps: Optional[int]
    """Optimizer steps between two boundary collections; None until measured."""
    collections: int = 0
    collect_s: float = 0.0
    """Time of the boundary collections so far."""
    measured_collect_s: Optional[float] = None
    measured_step_s: Optional[float] = None


class _Thresholds:
    """The interpreter's thresholds, changed while any collector that took them lives."""

    def __init__(self):
        # Re-entrant: a finalizer of a collected owner can run inside `take`, on this thread, in a collection.
        self.lock = threading.RLock()
        self.owners: set[int] = set()
        self.saved: Optional[int] = None
        """The oldest generation's threshold to put back."""

    def take(self, owner: "StepCollector") -> weakref.finalize:
        """Returns the finalizer that gives the owner's share back if it is dropped without `release`."""
        with self.lock:
            current = gc.get_threshold()
            if current[2] != NO_AUTOMATIC:  # first, or set again by the script meanwhile: the one to put back
                self.saved = current[2]
                gc.set_threshold(*current[:2], NO_AUTOMATIC)
            self.owners.add(id(owner))
            return weakref.finalize(owner, self.release, id(owner))

    def release(self, key: int) -> None:
        with self.lock:
            self.owners.discard(key)
            if self.saved is not None and not self.owners:
                current = gc.get_threshold()
                if current[2] == NO_AUTOMATIC:  # set again by the script meanwhile: theirs stays
                    gc.set_threshold(*current[:2], self.saved)
                self.saved = None


_THRESHOLDS = _Thresholds()


class StepCollector:
    def __init__(self, setting: Union[None, int, str], group=None):
        """`setting` (Settings.garbage_collection): None (the interval timed), a number of optimizer steps, or
        "python"; `group`: the data-parallel process group whose ranks must collect at the same steps (None: one
        process)."""
        self.group = group
        manage = setting != "python" and gc.isenabled() and not (setting is None and INCREMENTAL)
        self.report = CollectorReport(mode="steps" if manage else "python",
                                      interval_steps=setting if isinstance(setting, int) and manage else None)
        self.timed = manage and setting is None
        """The interval is set from measured times (else fixed by the setting, or none)."""
        self.boundaries = 0
        self._since = 0
        """Boundaries since the last boundary collection."""
        self._steps: list[float] = []
        """Step times since the last boundary collection (each boundary to the next, the collection left out)."""
        self._last_boundary_at: Optional[float] = None
        self._release = _THRESHOLDS.take(self) if manage and not INCREMENTAL else None

    def after_step(self) -> None:
        """At an optimizer-step boundary (every rank reaches the same ones)."""
        if self.report.mode != "steps":
            return
        self.boundaries += 1
        self._since += 1
        now = time.perf_counter()
        if self._last_boundary_at is not None:
            self._steps.append(now - self._last_boundary_at)
        self._last_boundary_at = now
        if self.report.interval_steps is None:
            # From the first boundary that is due on: a Ctrl-C raised after the timed collection leaves the interval
            # unset, and the next boundary times one again.
            if self.boundaries >= FIRST_BOUNDARY and self._steps:
                self._measure(self._steps[-1], self._collect())
                self._restart()
            return
        if self._since >= self.report.interval_steps:
            try:
                collect_s = self._collect()
            finally:  # a Ctrl-C held through the collection is raised after it: the collection still counts
                steps = self._steps
                self._restart()
            if self.timed:
                self._measure(statistics.median(steps), collect_s)

    def _restart(self) -> None:
        """After a boundary collection."""
        self._since, self._steps = 0, []
        self._last_boundary_at = time.perf_counter()  # the next step's time leaves this collection out

    def _measure(self, step_s: float, collect_s: float) -> None:
        """Sets the interval from a step time and a full collection's."""
        interval = max(1, min(math.ceil(collect_s / (COST_SHARE * max(step_s, 1e-9))),
                              math.floor(MAX_GAP_S / max(step_s, 1e-9))))
        first = self.report.interval_steps is None
        if self.group is not None:
            intervals: list = [None] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(intervals, interval, group=self.group)
            interval = max(intervals)
        self.report.interval_steps = interval
        self.report.measured_collect_s, self.report.measured_step_s = collect_s, step_s
        if first and (self.group is None or torch.distributed.get_rank(self.group) == 0):
            logger.info(f"garbage collection: a full collection took {collect_s:.3f} s against a {step_s:.3f} s "
                        f"step; one every {interval} optimizer steps from now on")

    def _collect(self) -> float:
        started = time.perf_counter()
        # A Ctrl-C whose KeyboardInterrupt surfaces in a finalizer (`__del__`, a weakref callback) that the collection
        # runs is printed as "Exception ignored" and lost; held, it is raised once the collection is over.
        with deferred_interrupt():
            try:
                gc.collect()
            finally:
                elapsed = time.perf_counter() - started
                self.report.collections += 1
                self.report.collect_s += elapsed
        return elapsed

    def close(self) -> None:
        if self._release is not None:
            self._release()  # a finalizer runs once: closing twice, or closing then dropping, releases once


def free_dropped_engines() -> None:
    """A full collection now if an engine that turned the interpreter's full collections off is alive and not closed.
    One that the script dropped without destroy() is cyclic garbage (DeepSpeed's engine and its model point at each
    other) that only a full collection frees, so the next engine's plan would count its GPU and host memory as taken.
    Called before an engine is built; nothing runs (no pause) when every earlier engine was destroyed."""
    if _THRESHOLDS.owners:
        with deferred_interrupt():
            gc.collect()
