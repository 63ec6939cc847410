"""The optimizer step at an accumulation boundary: a mixin of runtime.StrongholdRuntime, whose state it reads and
moves (the step state, both optimizers, the data-parallel reductions, the window).

step() first waits (`prepare_step`: the window closed, the CPU's sums of squares, the resident reductions), then
folds the resident gradients into the global norm, agrees on it across ranks and updates with a Ctrl-C held until
the end (engine/interrupts.py): the waits change nothing a second call would not redo, the update is all or nothing.
Clipping is exact: one global norm, one coefficient for both optimizers.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from stronghold.engine.interrupts import deferred_interrupt
from stronghold.engine.step_state import StepState
from stronghold.optim.cpu_records import norm_and_clip_coef

logger = logging.getLogger(__name__)


class OptimizerStep:
    def step(self) -> bool:
        """The optimizer step at an accumulation boundary: exact global clipping, then both optimizers.
        A non-finite global gradient norm skips the step everywhere; returns True when skipped. From every state
        (IDLE, ACCUMULATING, UPDATING) as step_state.py's docstring says. The waits (`prepare_step`) change nothing
        that a second call would not redo; the update after them is all or nothing (the engine defers a Ctrl-C
        over it: engine/interrupts.py)."""
        if self.state is StepState.IDLE:
            self._last_norm = 0.0
            self.steps += 1
            return False
        coef, skip = self._prepared if self._prepared is not None else self.prepare_step()
        self._prepared = None
        if self.cpu is not None:
            try:
                self.cpu.finish_step(coef, skip=skip, total_sq=self._last_norm ** 2)
            except BaseException as err:
                if self.cpu.failed:  # a job failed while the step's updates were being queued: half of it is made
                    raise self.cpu.break_for_good(f"while it applied optimizer step {self.steps + 1}", err) from err
                raise
            if self.data_parallel is not None:
                self.data_parallel.publish(self)
        if skip:
            self.resident.zero_grad()
            self.skipped_steps += 1
            # With fp16, an overflow is how dynamic loss scaling finds the largest scale that fits: routine.
            level = logging.INFO if self.compute_dtype == torch.float16 else logging.WARNING
            logger.log(level, f"step {self.steps + 1} skipped: the global gradient norm is "
                              f"{self._last_norm} (inf/NaN in the gradients, loss scale {self.loss_scale}); no "
                              "parameter was updated")
        else:
            self.resident.step(coef / self.loss_scale)
        self.steps += 1
        self.state = StepState.IDLE
        if self.window is not None:
            self.window.forget_cached()
        self.cached.prefetch()
        return skip

    def prepare_step(self) -> tuple[float, bool]:
        """What step() waits for before it updates anything: the window closed, the gradients' global norm (the
        CPU's sums, then the resident part and the ranks' agreement). Returns (clip coefficient, skip) and keeps them
        for step(); interrupted in its waits and called again, it does the same and returns the same."""
        if self.state is StepState.ACCUMULATING:
            self._close_window()
        self.finish_promotion()  # the update reads the promoted blocks' states
        if self.resident_reductions is not None:
            self.resident_reductions.finish()
        try:
            streamed = self.cpu.grad_sq_sum() if self.cpu is not None else 0.0
        except BaseException:
            if self.cpu.failed:  # the worker lost a job of this micro-step: its gradients cannot be summed
                self.abort_backward()  # raises the worker's failure
            raise
        # After the one wait that can fail: the resident sums add the boundary's gradients into the resident
        # accumulators, which a discarded micro-step could not take back out (on a GPU they queue behind the
        # resident blocks' backward, so launching them here rather than first costs no overlap unless the CPU's
        # sums arrive after that backward is done). Done once, whole: a Ctrl-C is held over it (engine/interrupts.py).
        with deferred_interrupt():
            resident_sq = self.resident.grad_sq_sum()
            # The update's host work before the sync below, while the GPU still runs what is queued.
            self.resident.prepare_update()
            # One device sync per step: whether to skip must be known before the resident update.
            resident = float(resident_sq) if resident_sq is not None else 0.0
            if self.data_parallel is not None:
                total = self.data_parallel.agree_sq(streamed, resident)
            else:
                total = streamed + resident
            self._last_norm, coef = norm_and_clip_coef(total, self.max_grad_norm, self.loss_scale)
            lost = self.cpu is not None and self.cpu.window_lost is not None
            if lost:
                logger.warning(f"stronghold: {self.cpu.window_lost}: this accumulation window's step is skipped")
            self._prepared = (coef, lost or not math.isfinite(total))
        return self._prepared

    def _close_window(self) -> None:
        """End the accumulation window at step() without its boundary backward: as a boundary backward that produced
        no gradient would, so each streamed block's update takes the window's gradients so far (from the host or
        GPU accumulator) and no part of the model is left out."""
        self._begin_micro_step(boundary=True, loss_scale=self.loss_scale)
        try:
            self.end_backward()
        except BaseException:
            self.abort_backward()
            raise

    def grad_norm(self) -> Optional[float]:
        """The last step's global gradient norm."""
        return self._last_norm

    def restore_steps(self, steps: int) -> None:
        """The optimizer steps taken so far, as a checkpoint recorded them (checkpoint/load.py, which has checked that
        no step is in progress)."""
        self.steps = steps
