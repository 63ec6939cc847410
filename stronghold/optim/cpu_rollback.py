"""Taking a step's CPU updates back: a skipped step (a non-finite global norm) and an aborted micro-step (an
exception between backward and step()). A mixin of cpu_optim.CpuOptimizer, whose state it reads (records, micro
accumulations, the kernel, the worker's queue); the rules are cpu_optim's docstring's.
"""
from __future__ import annotations

from stronghold.optim.cpu_records import MicroAccum, UpdateRecord, contiguous_ranges


class Rollback:
    def _undo(self, record: UpdateRecord) -> None:
        """Restore a block's state from before its early update (worker or caller thread; the block
        must be idle: no job of this step still running on it)."""
        store, grad = record.store, record.grad
        for seg in record.segments:
            s = slice(seg.start, seg.stop)
            self.kernel.undo(store.master[s], store.exp_avg[s], store.exp_avg_sq[s], grad[s],
                             self._out(store, seg.start, seg.stop), seg.coeffs, record.unscale)

    def _skip(self, record: UpdateRecord) -> None:
        """Drop this step's update of one block: undo it if it ran, rewind the step counters."""
        store = record.store
        for entry in record.entries:
            entry.step -= 1
        store.version += 1  # the slot copies made of the early update are stale
        if record.applied:
            store.updated.clear()
            store.grad_free.clear()

            def undo():
                self._undo(record)
                store.updated.set()
                store.grad_free.set()

            self._submit(undo)
        elif store.lean:
            def restore():  # its gradients overwrote the weights in the working copy
                store.restore_working()
                store.updated.set()
                store.grad_free.set()

            self._submit(restore)
        else:
            store.updated.set()
            store.grad_free.set()

    def abort(self) -> None:
        """Discard what the current micro-step handed over: wait for its jobs, undo early updates,
        rewind step counters and take the failed micro-step's gradients back out of the accumulators.
        Raises the worker's own failure, if it had one, after restoring what can be restored."""
        self._queue.join()
        failure = self._error
        self._error = None
        for record in self.records:
            if record.applied and record.done.is_set():
                self._undo(record)
            for entry in record.entries:
                entry.step -= 1
            record.store.version += 1
        for micro in self.micro:
            if micro.done.is_set():
                self._unaccumulate(micro)
        for record in self.records:
            if record.store.lean and not record.applied:
                if record.landed is not None:  # a failed worker skipped the jobs that wait for it
                    record.landed.synchronize()
                record.store.restore_working()
        for record in self.records:
            record.store.updated.set()
            record.store.grad_free.set()
        for micro in self.micro:
            micro.store.grad_free.set()
        self._end_step()
        if failure is not None:
            raise RuntimeError("stronghold's CPU optimizer failed; the step was discarded") from failure

    def _unaccumulate(self, micro: MicroAccum) -> None:
        store = micro.store
        if micro.held:  # parked, never added: dropping it is the whole undo
            if store.held is micro:
                store.held = None
            return
        for start, stop in store.local_ranges(contiguous_ranges(micro.present)):
            if micro.first:
                store.accum[start:stop].zero_()
            else:
                store.accum[start:stop].sub_(store.grad[start:stop].float())
