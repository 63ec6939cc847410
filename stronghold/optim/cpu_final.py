"""The jobs that make a step's deferred and redone CPU updates final: a mixin of cpu_optim.CpuOptimizer, whose
`finish_step` queues them (weights first where it decides so: weights_first.py); the rules are cpu_optim's docstring's.
"""
from __future__ import annotations

import time
from typing import Callable

from stronghold.optim.cpu_records import Segment, UpdateRecord
from stronghold.optim.grad_pieces import grad_pieces


class FinalJobs:
    def _preview_job(self, record: UpdateRecord, final: list[Segment], clip_coef: float) -> Callable[[], None]:
        """The first pass of a deferred update, weights first: the block's final compute-dtype weights into its
        working copy, which releases its next load; `_final_job(weights_written=True)` makes the step."""
        store, grad = record.store, record.grad
        scale = clip_coef * record.unscale

        def run():
            start = time.perf_counter()
            if store.compact:
                # The working copy is the master's high half: this pass writes both halves (the next weights), the
                # second the moments.
                high = store.working[store.shard_start:store.shard_stop]
                with store.halves() as (low, exp_avg, exp_avg_sq):
                    for i, s, g in grad_pieces(store, grad, final):
                        self.kernel.step_compact_master(high[s], low[s], exp_avg[s], exp_avg_sq[s], g,
                                                        final[i].coeffs, scale)
            else:
                # Read only: the preview writes the next weights; the state changes in the second pass.
                with store.states(write=False) as (master, exp_avg, exp_avg_sq):
                    for i, s, g in grad_pieces(store, grad, final):
                        self.kernel.preview(master[s], exp_avg[s], exp_avg_sq[s], g,
                                            self._out(store, s.start, s.stop), final[i].coeffs, scale)
            self.weights_first.count(preview_s=time.perf_counter() - start)
            store.life.update_done()
            if record.from_accum:  # the second pass reads the accumulator, not the buffer the next D2H fills
                store.life.grads_released()

        return run

    def _final_job(self, record: UpdateRecord, final: list[Segment], clip_coef: float,
                   redo: bool, weights_written: bool = False) -> Callable[[], None]:
        store, grad = record.store, record.grad
        # One coefficient for the kernel: a power-of-two unscale times the clip coefficient rounds once
        # in fp32, as unscaling and then clipping would.
        scale = clip_coef * record.unscale

        def run():
            start = time.perf_counter()
            if not redo and not weights_written:
                self._step(store, grad, [(spec, fin.coeffs) for spec, fin in zip(record.segments, final)], scale)
            else:
                self._redo_or_complete(record, final, scale, redo, weights_written)
            if not redo:
                self.weights_first.count(deferred_s=time.perf_counter() - start)
            if not weights_written:  # else the preview set it, and by now a later step may have cleared it
                store.life.update_done()
            store.life.grads_released()

        return run

    def _redo_or_complete(self, record: UpdateRecord, final: list[Segment], scale: float, redo: bool,
                          weights_written: bool) -> None:
        """A redo of an early update, or the step after a weights-first preview (which leaves the working copy as
        the preview wrote it; after a compact master's first pass, its moments alone)."""
        store, grad = record.store, record.grad
        if weights_written and store.compact:  # the first pass made the master's halves: the moments are left
            with store.halves() as (_, exp_avg, exp_avg_sq):
                for i, s, g in grad_pieces(store, grad, record.segments):
                    self.kernel.moments(exp_avg[s], exp_avg_sq[s], g, final[i].coeffs, scale)
            return
        with store.states() as (master, exp_avg, exp_avg_sq):
            for i, s, g in grad_pieces(store, grad, record.segments):
                spec, fin = record.segments[i], final[i]
                # After a preview the working copy already holds these weights, and the next forward may be copying
                # it to the GPU: the step leaves it alone.
                out = None if weights_written else self._out(store, s.start, s.stop)
                state = (master[s], exp_avg[s], exp_avg_sq[s], g, out)
                if redo:
                    self.kernel.redo(*state, spec.coeffs, fin.coeffs, scale, spec_scale=record.unscale)
                else:
                    self.kernel.step(*state, fin.coeffs, scale)
