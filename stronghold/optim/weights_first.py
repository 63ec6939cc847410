"""Weights first: split a deferred CPU update into the next forward's weights now and the fp32 state later.

With clipping active every step (the global norm over max_norm), every streamed block's AdamW waits for step()
(speculation.py), and the next forward waits for them one block at a time: `wait_cpu_update`, 0.16-0.19 s a step
on an H100 for a Llama 2.70 B with accumulation 8 under a 32 GiB cap, on the thread that launches the GPU
work. That forward needs only the compute-dtype weights. The kernel's `preview` writes them alone, reading p, m, v
and the gradient (about 18 of the update's 30 bytes a parameter with an fp32 gradient), and a later `step` of the
same block writes the fp32 state (and the same weights, bit for bit: csrc/adamw.c's adamw_math). The forward is
released after ~0.6 of the update's time per block; the CPU does that ~0.6 again on top.

Without gradient accumulation the second pass reads the block's gradient buffer, which the next backward's D2H
of that block waits for on the launching thread; with host accumulation it reads the accumulator instead. So "auto"
previews only accumulating steps (the case measured), and only where the CPU has the room: `WeightsFirst.decide` turns it on for a step when the CPU's busy time
over the last step, with the previews counted (measured, or estimated as PREVIEW_SHARE of the deferred updates),
stays under CPU_SLACK of that step's wall time. A CPU-bound step (GPT-2 8.36 B under 32 GiB, whose step is its
host-DRAM floor term) keeps the one-pass update, which moves the fewest bytes.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional

PREVIEW_SHARE = 0.6
"""A preview's time over a full update's: the bytes it moves over the update's (18 of 30 with an fp32 gradient,
16 of 28 with a bf16 one); the kernel is bound by host memory bandwidth. Only used before a preview was timed."""

CPU_SLACK = 0.8
"""Preview only while the CPU's work, previews included, stays under this share of the step. Past it the CPU
becomes the step's bound, where each added second is a second of step; the fifth held back covers the step-to-step
spread of the CPU's work seen for one training point (1.35 to 2.81 s a step, from machine to machine)."""


@dataclass
class _Totals:
    wall: float = 0.0
    busy_s: float = 0.0
    preview_s: float = 0.0
    deferred_s: float = 0.0


class WeightsFirst:
    """Decides, once per optimizer step, whether its deferred updates go weights first. Counters of its own, so a
    report's reset of the optimizer's statistics does not disturb it."""

    def __init__(self, forced: Optional[bool] = None, clock: Callable[[], float] = time.perf_counter):
        self.forced = forced
        """None: decide from the last step's timings; True / False: always / never (config `weights_first`)."""
        self.clock = clock
        self.totals = _Totals()
        self._mark: Optional[_Totals] = None

    def count(self, busy_s: float = 0.0, preview_s: float = 0.0, deferred_s: float = 0.0) -> None:
        """Worker time: every job's (`busy_s`), of it the previews' and the deferred updates' (a split update's
        second pass included)."""
        self.totals.busy_s += busy_s
        self.totals.preview_s += preview_s
        self.totals.deferred_s += deferred_s

    def decide(self) -> bool:
        """At step(), before its deferred updates are submitted: whether they go weights first. The window measured
        is the last step's: from the last call to this one, which holds the last step's deferred updates and this
        step's accumulation and early updates."""
        now = dataclasses.replace(self.totals, wall=self.clock())
        last, self._mark = self._mark, now
        if self.forced is not None:
            return self.forced
        if last is None:
            return False  # the first step: nothing timed yet
        wall = now.wall - last.wall
        busy, preview, deferred = (now.busy_s - last.busy_s, now.preview_s - last.preview_s,
                                   now.deferred_s - last.deferred_s)
        if deferred <= 0.0:
            return False  # no update was deferred: nothing would go first
        cost = preview if preview > 0.0 else PREVIEW_SHARE * deferred
        return busy - preview + cost <= CPU_SLACK * wall
