"""Taking a step's CPU updates back: a skipped step (a non-finite global norm) and an aborted micro-step (an
exception between backward and step()). A mixin of cpu_optim.CpuOptimizer, whose state it reads (records, micro
accumulations, the kernel, the worker's queue); the rules are cpu_optim's docstring's.
"""
from __future__ import annotations

from stronghold.optim.cpu_records import MicroAccum, UpdateRecord, contiguous_ranges
from stronghold.optim.grad_pieces import grad_pieces


class Rollback:
    def _undo(self, record: UpdateRecord) -> None:
        """Restore a block's state from before its early update (worker or caller thread; the block
        must be idle: no job of this step still running on it)."""
        store, grad = record.store, record.grad
        with store.states() as (master, exp_avg, exp_avg_sq):
            for i, s, g in grad_pieces(store, grad, record.segments):
                self.kernel.undo(master[s], exp_avg[s], exp_avg_sq[s], g, self._out(store, s.start, s.stop),
                                 record.segments[i].coeffs, record.unscale)

    def _skip(self, record: UpdateRecord) -> None:
        """Drop this step's update of one block: undo it if it ran, rewind the step counters."""
        store = record.store
        for entry in record.entries:
            entry.step -= 1
        # The weights go back to before the step: every GPU copy made since its boundary is stale.
        if record.applied:  # an undo job rewrites them from the gradients
            store.life.update_begins()
            store.life.grads_claimed()

            def undo():
                self._undo(record)
                store.life.settled()

            self._submit_for(store, undo)
            return
        store.life.weights_replaced()
        if store.lean:
            def restore():  # its gradients overwrote the weights in the working copy
                store.restore_working()
                store.life.settled()

            self._submit(restore)
        else:
            store.life.settled()

    def abort(self) -> None:
        """Discard what the current micro-step handed over, wherever it stopped (before a gradient copy, after it,
        before its job's record, in a job): wait for its jobs, undo early updates, restore every step counter noted at
        `begin_micro_step`, take the failed micro-step's gradients back out of the accumulators and a lean store's
        weights back from its master. Then no job is left to release a gradient buffer or publish weights, so every
        store's are released here, including a buffer taken by a hand-off that never made a record.
        The caller has let every gradient copy land (a lean store's copy writes into its weights).

        A job that failed in an earlier micro-step of the window surfaces here only if the worker reached it after that
        micro-step returned, which depends on timing: its micro-step's later jobs never ran and nothing records what
        they would have summed, so the window is lost (its step skipped, as a pooled block's is) whenever the failure
        surfaces. A failed job of a step already made leaves that step half applied: the optimizer breaks for good.
        Raises the worker's own failure, if it had one, after restoring what can be restored."""
        self._join("the CPU jobs of the failed micro-step to finish")
        self._state_jobs_settled()
        failure, lost_from = self.take_failure()
        broken = self._breaks_if_made(lost_from, failure)
        if broken is None and lost_from is not None and lost_from < self._micro_start:
            self.window_lost = ("the CPU optimizer failed and lost jobs of an earlier micro-step of this window, "
                                "whose sums cannot be made whole")
        for record in self.records:
            if record.applied and record.done.is_set():
                self._undo(record)
        for entry, step in self._before:
            entry.step = step
        for micro in self.micro:
            if micro.done.is_set():
                self._unaccumulate(micro)
        touched = {id(store): store for store in [r.store for r in self.records] + self.taken}
        for store in touched.values():
            if store.lean:  # never updated early (cpu_optim.py): its working copy holds gradients, if anything
                store.restore_working()
            store.life.weights_replaced()  # a slot may hold an early update's weights
        for store in self._stores:
            if store.pool is not None:  # a pooled buffer still lent was taken for a copy whose sum never ran
                store.pool.release(store)
            store.life.settled()
        self._end_step()
        if broken is not None:
            raise broken from failure
        if failure is not None:
            raise RuntimeError("stronghold's CPU optimizer failed; the step was discarded") from failure

    def _unaccumulate(self, micro: MicroAccum) -> None:
        store = micro.store
        if micro.held:  # parked, never added: dropping it is the whole undo
            store.life.drop_held(micro)
            return
        if store.pool is not None and not micro.first:
            # Its landing buffer went back to the pool once summed (grad_pool.py): the gradients cannot be taken back
            # out of the earlier micro-steps' sum, so the window's sums are lost and step() skips its step. (A first
            # micro-step's sum is only zeroed: the next one starts the window again.)
            self.window_lost = ("a backward failed after some blocks' gradients were summed into pooled gradient "
                                "buffers' accumulators (grad_pool.py), which cannot take them back out")
            return
        for start, stop in store.local_ranges(contiguous_ranges(micro.present)):
            if micro.first:
                store.accum[start:stop].zero_()
            else:
                store.accum[start:stop].sub_(store.grad[start:stop].float())
