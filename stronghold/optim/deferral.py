"""The deferral share of each optimizer step: the planner's one rate that is a property of the training, not the machine.

A streamed block's CPU update that runs after its step's backward (deferred until the global norm is known,
claimed by step() from the worker's backlog, or redone because the step clipped after all; cpu_optim.py) is
waited for by the next forward, and the planner's step prediction adds that tail (planner.py, `deferred_share`).
How many updates go that way depends on the gradient norm against the clipping limit, which changes as training
goes: the first steps defer every block (no forecast yet, speculation.py) and a run whose norm then falls below
the limit speculates most of them. A prediction refreshed from the first steps alone overshot the steps after them
by +22% (GPT-2 8.36 B) and +61% (5.14 B) on an H200, where the later steps deferred a third to a half. The share to
plan with is the median over the steps a report covers: the step time grows with the share, so the median step is the
one with the median share.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Optional

RECENT_STEPS = 64
"""Steps the median looks back over in a run that never resets its report: its share as training goes now."""


class DeferralShares:
    """Per optimizer step, the share of streamed updates that ran after backward. Counted from the CPU optimizer's
    statistics between two step ends; a report's reset (`stronghold_report(reset=True)`, a benchmark's warm-up end)
    replaces those statistics and starts a new list, as the report's other per-step figures start again."""

    def __init__(self) -> None:
        self.shares: deque[float] = deque(maxlen=RECENT_STEPS)
        self._stats = None
        self._before = 0

    def mark(self, cpu) -> None:
        """Start counting the next step here."""
        self._stats, self._before = (cpu.stats, self._count(cpu)) if cpu is not None else (None, 0)

    def end_step(self, cpu, streamed: int) -> Optional[float]:
        """At a step's end: record its share (None without a CPU optimizer) and start the next step's count."""
        if cpu is None or not streamed:
            return None
        count = self._count(cpu)
        if cpu.stats is not self._stats:
            # Replaced since the mark: only between steps (the counts grow inside step()), so the new statistics
            # hold this whole step, and the steps before belong to the report that was reset.
            self.shares.clear()
            self._before = 0
        share = min(1.0, (count - self._before) / streamed)
        self.shares.append(share)
        self.mark(cpu)
        return share

    def typical(self) -> Optional[float]:
        """The median share of the steps recorded (None before the first)."""
        return statistics.median(self.shares) if self.shares else None

    @staticmethod
    def _count(cpu) -> int:
        return cpu.stats.deferred_blocks + cpu.stats.redo_blocks
