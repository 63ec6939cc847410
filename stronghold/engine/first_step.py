"""The first optimizer steps' host time by phase: each micro-step's forward and backward and the step() calls, with
when each began, so that a first step much longer than a steady one can be placed from the report alone (the
compile, the first forward's promotion and the placement after the step fall in known phases; the gaps between
phases are the caller's own work: data, the loss, the training loop). The steps after it are clocked too
(STEPS_CLOCKED in all): the first one's deferred CPU updates and the placement's changes land in the second, and the
third is a steady one to compare with. Host seconds: the GPU runs behind, and what it
owes shows up in the phase that next waits for it."""
from __future__ import annotations

import time
from contextlib import contextmanager

STEPS_CLOCKED = 3


class FirstStepClock:
    def __init__(self):
        self.phases: list[tuple[int, str, float, float]] = []
        """(optimizer step from 1, phase, its start, its seconds), the starts counted from the first phase's."""
        self.steps_done = 0
        self._origin: float | None = None

    @property
    def complete(self) -> bool:
        """The clocked optimizer steps have ended; nothing more is recorded."""
        return self.steps_done >= STEPS_CLOCKED

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
            self.phases.append((self.steps_done + 1, name, start - self._origin, time.perf_counter() - start))

    def step_ended(self, mid_step: bool) -> None:
        """After a step() call: an optimizer step is complete unless that call ended a micro-step only."""
        if not mid_step and self.phases and not self.complete:
            self.steps_done += 1

    def report(self) -> dict:
        return {"complete": self.complete,
                "phases_s": [{"step": step, "phase": name, "start": round(start, 4), "seconds": round(seconds, 4)}
                             for step, name, start, seconds in self.phases]}
