"""The first optimizer step's host time by phase: each micro-step's forward and backward and the step() calls, with
when each began, so that a first step much longer than a steady one can be placed from the report alone (the
compile, the first forward's promotion and the placement after the step fall in known phases; the gaps between
phases are the caller's own work: data, the loss, the training loop). Host seconds: the GPU runs behind, and what it
owes shows up in the phase that next waits for it."""
from __future__ import annotations

import time
from contextlib import contextmanager


class FirstStepClock:
    def __init__(self):
        self.phases: list[tuple[str, float, float]] = []
        """(phase, its start, its seconds), the starts counted from the first phase's."""
        self.complete = False
        """The first optimizer step has ended; nothing more is recorded."""
        self._origin: float | None = None

    @contextmanager
    def phase(self, name: str):
        if self.complete:
            yield
            return
        start = time.perf_counter()
        if self._origin is None:
            self._origin = start
        try:
            yield
        finally:
            self.phases.append((name, start - self._origin, time.perf_counter() - start))

    def step_ended(self, mid_step: bool) -> None:
        """After a step() call: the first optimizer step is complete unless that call ended a micro-step only."""
        self.complete = self.complete or (not mid_step and bool(self.phases))

    def report(self) -> dict:
        return {"complete": self.complete,
                "phases_s": [{"phase": name, "start": round(start, 4), "seconds": round(seconds, 4)}
                             for name, start, seconds in self.phases]}
