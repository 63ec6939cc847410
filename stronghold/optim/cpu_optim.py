"""CPU AdamW of the streamed blocks: a worker thread that updates each block as soon as its gradients
reach the host, overlapped with the rest of backward.

Exact global-norm clipping with early per-block updates ("speculate, then validate"). Each block's
sum of squared gradients arrives with its gradients (computed on the GPU as backward produces them,
or by the accumulation pass). The worker keeps this step's running sum and updates a block early,
with its unclipped gradient, only while the step's predicted global sum (the running sum plus the
last step's sums of the blocks not seen yet, speculation.py) stays within 0.9^2 max_norm^2: so a block
is never updated with a gradient that is clipped hard, a non-finite gradient is never applied, and a
run that clips every step defers rather than redoes. Other blocks are *deferred*: `step()`, which
knows the global norm, runs their one exact update with the clip coefficient. If the rest of the
model (resident blocks, embeddings) then pushes the norm over the limit, or the learning rate changed,
the early updates are redone in one pass (`redo`): the kernel inverts the early step and applies the
exact one. Inverting loses only the low bits of the state, because the inverted gradients are bounded
by max_norm (a first step restores m = v = 0 exactly). Deferred and redone updates run in forward order,
so the next forward can start on the first block while the CPU works on later ones. A block whose job the
worker has not begun when step() runs (the CPU's backlog, when its updates take longer than backward) is
*claimed* by step() and joins them, with its exact update, so the backlog too is cleared in forward order.
With host accumulation a block's boundary work is two jobs: its sum (accumulate and sum of squares), urgent, so
step() never waits behind early updates for the global norm; then its early update, which step() claims if the
worker has not begun it. A micro-step's sum before the boundary is urgent too where no job of its block's fp32 state is
queued or running: the block's next gradient copy waits for it, not for other blocks' updates. An early update that
the final norm leaves standing is never waited for: whichever of its job and step() comes second releases the block
(`UpdateRecord.finish` / `confirm`).
Until a block's final weights are in its working copy its `updated` event stays clear, and the next
forward's H2D of that block waits for it, only it.

With fp16 loss scaling the gradients arrive multiplied by the loss scale S: every update multiplies
them by `unscale` = 1/S (folded into the kernel's one gradient coefficient, with the clip coefficient:
exact for the power-of-two scales of dynamic scaling), and the running sum of squares is unscaled by
1/S^2 before it is compared with max_norm^2.

A step whose global norm is not finite is skipped (`finish_step(skip=True)`): early updates are
undone, per-parameter step counts restored. An exception between backward and step (`abort`)
drains the worker and rolls back the same way, and also the accumulation of the failed micro-step.

The jobs run on one worker thread (cpu_worker.py), in order; the parallelism is inside the kernel (pthreads),
which runs with the GIL released, so the main thread keeps launching GPU work.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Optional

import torch

from stronghold.optim.cpu_accumulate import Accumulation
from stronghold.optim.adamw_kernel import AdamWCoeffs, AdamWKernel
from stronghold.optim.cpu_final import FinalJobs
from stronghold.optim.cpu_records import (CpuStats, MicroAccum, Segment, UpdateRecord, group_coeffs, local_segments,
                                          segments_of)
from stronghold.optim.cpu_rollback import Rollback
from stronghold.optim.grad_pieces import grad_pieces
from stronghold.optim.cpu_worker import Worker
from stronghold.engine.ranges import timed
from stronghold.optim.speculation import Forecast
from stronghold.streaming.cached import OUTPUT_INDEX
from stronghold.streaming.store import BlockStore, ParamEntry
from stronghold.optim.weights_first import WeightsFirst


class CpuOptimizer(Accumulation, FinalJobs, Rollback, Worker):
    def __init__(self, kernel: AdamWKernel, param_groups: list[dict], write_working: bool, max_grad_norm: float,
                 join_timeout_s: float = 60.0, stall_timeout_s: float = 600.0, weights_first: Optional[bool] = None):
        self.kernel = kernel
        self.param_groups = param_groups
        self.write_working = write_working
        """The working copy is a separate bf16/fp16 buffer the kernel writes (in fp32 mode it is the master)."""
        self.max_grad_norm = max_grad_norm
        self.unscale = 1.0
        """1 / the loss scale the current backward's gradients carry (1.0 without fp16 loss scaling)."""
        self.forecast = Forecast()
        """Last step's sums of squares, which decide early vs deferred updates with clipping (speculation.py)."""
        self.records: list[UpdateRecord] = []
        self.micro: list[MicroAccum] = []
        self.taken: list[BlockStore] = []
        """The stores whose gradient buffer this micro-step took (`take_grad_buffer`), whatever became of it."""
        self._before: list[tuple[ParamEntry, int]] = []
        """Every streamed entry's AdamW step count when this micro-step began (`abort` restores them)."""
        self._stores: list[BlockStore] = []
        """Every streamed store, as of this micro-step (`abort` releases each one's buffer and weights)."""
        self.stats = CpuStats()
        self.window_lost: Optional[str] = None
        """Why the accumulation window's sums cannot be made whole again (cpu_rollback.py): its step is skipped
        (stepping.py); `finish_step` clears it."""
        self._micro_start = 0
        """The submission number at which this micro-step began (`abort` tells by it whose job failed)."""
        self.weights_first = WeightsFirst(weights_first)
        self.split_last_step = False
        """The last step's deferred updates went weights first: a block's `updated` then precedes its fp32 state."""
        """Whether a step's deferred updates write the next forward's weights first (weights_first.py)."""
        self._state_jobs: dict[int, int] = {}
        self._state_jobs_done: dict[int, int] = {}
        """Per store (by id): jobs that read or write its fp32 state, submitted (`_submit_for`) and finished. Each
        dict is written by one thread only (the caller's, the worker's), so a stale read only overstates what is
        pending (`_state_idle`)."""
        self._running_sq = 0.0
        """Worker-side, with clipping only: sum of squares of this step's blocks seen so far (decides early
        vs deferred). Every job that adds to it (a block's sum, run before its `sq_ready`) has run when finish_step
        resets it: grad_sq_sum waited for them."""
        super().__init__(join_timeout_s, stall_timeout_s)  # last: it starts the worker thread

    @property
    def clipping(self) -> bool:
        return self.max_grad_norm > 0

    def reset_stats(self) -> None:
        self.stats = CpuStats()

    def _execute(self, job: Callable[[], None]) -> None:
        start, waited, kernel = time.perf_counter(), self.stats.landed_wait_s, self.kernel.kernel_seconds()
        job()
        busy = time.perf_counter() - start - (self.stats.landed_wait_s - waited)
        self.stats.busy_s += busy
        if kernel is not None:
            self.stats.kernel_s += self.kernel.kernel_seconds() - kernel
        self.weights_first.count(busy_s=busy)

    def take_grad_buffer(self, store: BlockStore) -> None:
        """Claim a block's host gradient buffer for its next D2H, once the worker has read what the last one left there
        (with host accumulation: the previous micro-step's). The thread running backward blocks here, so it is timed.
        Noted in `taken` before the claim: whatever stops the hand-off after it (before the copy, after it, before the
        job's record, in the job), `abort` gives the buffer back."""
        if not store.life.grad_free.is_set():
            self.stats.grad_buffer_wait_s += timed("wait_grad_buffer", lambda: self.wait(
                store.life.grad_free, f"the CPU optimizer to release block {store.index}'s gradient buffer"))
        self.taken.append(store)
        store.life.grads_claimed()
        if store.pool is not None:  # a shared landing buffer (grad_pool.py): the CPU's sums give them back
            if not store.pool.available.is_set():
                self.stats.grad_buffer_wait_s += timed("wait_grad_buffer", lambda: self.wait(
                    store.pool.available, "the CPU optimizer to give back a pooled gradient buffer"))
            store.pool.acquire(store)

    def _landed(self, event) -> None:
        start = time.perf_counter()
        event.synchronize()
        self.stats.landed_wait_s += time.perf_counter() - start

    def _out(self, store: BlockStore, start: int, stop: int) -> Optional[torch.Tensor]:
        """The working copy of shard range [start, stop) (the kernel writes the compute-dtype weights there)."""
        if not self.write_working:
            return None
        return store.working[store.shard_start + start:store.shard_start + stop]

    def begin_micro_step(self, stores: Iterable[BlockStore], unscale: float = 1.0) -> None:
        """A backward starts over the streamed `stores`, with gradients to be multiplied by `unscale` (1 / loss
        scale): what `abort` takes back out of the accumulators is only its own, and it restores the step counts
        noted here, so a failure between any two statements of the hand-off leaves none advanced."""
        self._micro_start = next(self._order)
        self.micro, self.taken = [], []
        self.unscale = unscale
        self._stores = list(stores)
        self._before = [(entry, entry.step) for store in self._stores for entry in store.trainable]

    def submit_grads(self, store: BlockStore, present: list[ParamEntry], landed, boundary: bool,
                     first_in_window: bool, window_sum: bool = False,
                     unpack: Optional[Callable[[], None]] = None) -> None:
        """Hand over a block whose gradients (of `present` entries) are on their way into `store.grad`
        (and, without accumulation, their sum of squares into `store.grad_sq`); `window_sum`: they are the
        accumulation window's sum from the GPU (device_accum.py); `unpack`: what puts them into `store.grad` once landed
        (they came down in another layout: embedding_rows.py), run on the worker before anything reads it.

        `landed` is the D2H event to wait on. Called on the thread that runs backward, right after the
        D2H was issued. At the accumulation boundary this schedules the update (early or deferred).
        """
        accumulate = store.accum is not None
        micro = None
        if accumulate and present:
            micro = MicroAccum(store, present, first_in_window)
            self.micro.append(micro)
        if not boundary:
            assert accumulate, "non-boundary micro-steps need an accumulation buffer"
            # Every other micro-step only parks its gradients in the spare buffer; the next one adds both in one pass:
            # 12 bytes a parameter per two micro-steps against 20, half the time the sums run beside backward, which
            # slows the thread launching it on some hosts (0.15-0.2 s a step on an H200 Llama point). `life.held` is
            # current here: the block's previous job ended before this D2H could begin (take_grad_buffer).
            hold = bool(present) and store.grad_spare is not None and store.life.held is None
            if hold:
                micro.held = True

            def accumulate_only():
                if present:
                    self._landed(landed)
                    if hold:  # the next D2H goes to the other buffer
                        store.grad, store.grad_spare = store.grad_spare, store.grad
                        store.life.hold(micro)
                    else:
                        self._accumulate(store, present, first_in_window)
                    micro.done.set()
                store.life.grads_released()

            # Where no job of the block's fp32 state is pending (its last update, which reads the accumulator, is
            # over), the sum overtakes the other blocks' queued updates: the block's next D2H waits for it
            # (take_grad_buffer), and behind a step's deferred updates that wait would hold backward for most of them
            # (a cached LM head's sums, the first of every backward). The block's own jobs stay in order: its next one
            # is submitted only once this one released the buffer.
            self._submit(accumulate_only, urgent=self._state_idle(store))
            return
        window = [e for e in store.trainable if e.grad_this_window]
        for entry in window:
            entry.step += 1
        groups = self.param_groups
        segments = segments_of(window, lambda e: group_coeffs(groups[e.group], e.step))
        record = UpdateRecord(store, window, local_segments(segments, store), from_accum=accumulate,
                              unscale=self.unscale, landed=landed if present else None, window_sum=window_sum,
                              unpack=unpack if present else None)
        store.life.update_begins()  # any GPU copy of this block is stale from now on
        self.records.append(record)
        limit_sq = self.max_grad_norm ** 2

        def decide() -> bool:
            """The block's sum of squares, then early or deferred (before `sq_ready`: step() reads both)."""
            if accumulate:
                if present:
                    self._landed(landed)
                sq = self._accumulate(store, present, first_in_window)
                if micro is not None:
                    micro.done.set()
            else:
                if present:
                    self._landed(landed)
                    if record.unpack is not None:
                        record.unpack()
                sq = float(store.grad_sq) if present else 0.0
            record.sq = sq
            finite = math.isfinite(sq)
            true_sq = sq * record.unscale ** 2
            early = finite and not self.clipping
            if finite and self.clipping:
                early = self.forecast.speculate(store.index, self._running_sq, true_sq, limit_sq)
                self._running_sq += true_sq
            # A lean store's update overwrites its gradients (store.py): never early, since an early update
            # that a later non-finite or clipped gradient invalidates could not be undone. A lost window's step is
            # skipped: nothing to update early.
            record.early = early = early and not store.lean and self.window_lost is None
            record.sq_ready.set()
            return early

        def apply(early: bool) -> None:
            if early:
                self._step(store, record.grad, [(seg, seg.coeffs) for seg in record.segments], record.unscale)
                record.applied = True
            record.done.set()
            if early and (not self.clipping or record.finish()):
                # The real update (unless a later block's gradient is not finite: step() undoes it then,
                # before anything reads the block again); with clipping, once step() has confirmed it.
                store.life.settled()

        if accumulate:
            # Two jobs: the sum, urgent, since step() waits for every block's; then the early update, which
            # step() may still claim (run it in forward order, weights first) if the worker has not begun it.
            # Urgent only behind take_grad_buffer's wait, which saw the block's earlier jobs end: a block with no
            # gradient this micro-step skipped it, and its sum must queue behind them (e.g. parked gradients).
            self._submit(decide, urgent=bool(present))
            self._submit_for(store, lambda: record.start() and apply(record.early))
        else:
            # The sum came down with the gradients: step() may claim the whole job and read it itself.
            self._submit_for(store, lambda: record.start() and apply(decide()))

    def _submit_for(self, store: BlockStore, job: Callable[[], None]) -> None:
        """Queue a job that reads or writes the block's fp32 state (or its accumulator, for the update); in the NVMe
        tier its state is read ahead. Counted until it has run (`_state_idle`)."""
        if store.tier is not None:
            store.tier.expect([store])
        key = id(store)
        self._state_jobs[key] = self._state_jobs.get(key, 0) + 1

        def counted() -> None:
            try:
                job()
            finally:
                self._state_jobs_done[key] = self._state_jobs_done.get(key, 0) + 1

        self._submit(counted)

    def _state_idle(self, store: BlockStore) -> bool:
        """No job of the store's fp32 state or accumulator is queued or running."""
        key = id(store)
        return self._state_jobs.get(key, 0) == self._state_jobs_done.get(key, 0)

    def _state_jobs_settled(self) -> None:
        """After a drain: every job submitted has run or was skipped after a failure (which never counts it)."""
        self._state_jobs_done = dict(self._state_jobs)

    def grad_sq_sum(self) -> float:
        """Sum of squares of this step's streamed gradients as they are in the buffers, loss scale included
        (waits for them to land, not for the updates)."""
        start = time.perf_counter()
        for record in self.records:
            # A block whose sum of squares came down with its gradients (no host accumulation) and whose job the
            # worker has not begun is claimed: its sum is read here, and finish_step queues its exact update in
            # forward order. Else step() would wait for the worker's backlog of early updates, which runs in
            # backward order, while the next forward needs the lowest blocks, the backlog's last, first.
            if not record.sq_ready.is_set() and not record.from_accum and record.claim():
                if record.landed is not None:
                    record.landed.synchronize()
                    if record.unpack is not None:
                        record.unpack()
                    record.sq = float(record.store.grad_sq)
                record.sq_ready.set()
                continue
            self.wait(record.sq_ready, f"the gradients of block {record.store.index} to reach the host "
                                       f"(global gradient norm at step())")
        self.stats.wait_step_s += time.perf_counter() - start
        return sum(record.sq for record in self.records)

    def finish_step(self, clip_coef: float, skip: bool = False, total_sq: float = math.nan) -> None:
        """Make this step's updates final with the gradients times `clip_coef` (and each record's unscale):
        run deferred ones, redo early ones that clipping or new hyperparameters change, or (skip) undo
        every early one. In forward order, so the next forward's first blocks are ready first.
        `total_sq`: the step's global sum of squares without loss scale, the next step's forecast."""
        self.window_lost = None  # the step that ends the window is made (or skipped) now
        if self.clipping and not skip:  # every record's sq is known: grad_sq_sum waited for them
            self.forecast.record({r.store.index: r.sq * r.unscale ** 2 for r in self.records}, total_sq)
        weights_first = self.weights_first.decide() and self.write_working
        for tier in {id(r.store.tier): r.store.tier for r in self.records if r.store.tier is not None}.values():
            # The jobs queued below supersede backward's order: each queues its block as it is submitted.
            tier.expect([], replace=True)
        second_pass = []
        for record in sorted(self.records, key=lambda r: r.store.index):
            store = record.store
            final = [Segment(s.start, s.stop, group_coeffs(self.param_groups[s.group], s.coeffs.step), s.group)
                     for s in record.segments]
            unchanged = clip_coef == 1.0 and all(f.coeffs == s.coeffs for f, s in zip(final, record.segments))
            if record.from_accum and not skip:
                # The update job behind the block's (urgent) sum has not begun: claimed, it runs with the
                # deferred ones, weights first in forward order, instead of in the backlog's backward order.
                record.claim()
            if not skip and unchanged and record.early and not record.claimed:
                # Finite and unclipped, and its job applies it early: the job marks the block updated (with
                # clipping, whichever of the job and step() comes second), so step() need not wait for the
                # backlog of early updates and the CPU keeps overlapping (waiting for it cost 0.26-0.29 s a step).
                if record.confirm():
                    store.life.settled()
                continue
            if record.claimed:
                self.stats.claimed_blocks += 1
                record.done.set()  # its queued job does nothing
            else:
                self.wait(record.done, f"the early CPU update of block {store.index} (step())")
            if skip:
                self._skip(record)
            elif not record.applied:
                self.stats.deferred_blocks += 1
                # A lean store's gradients are in its working copy, which the preview would overwrite; a sharded
                # one publishes after all of its rank's jobs (data_parallel.py), so its preview would gain nothing.
                # Without accumulation the second pass reads the gradient buffer that the next backward's D2H of the
                # block waits for (on the launching thread): "auto" keeps to accumulating steps (measured: Llama GA 8),
                # on the host or on the GPU (whose window sum is next sent down at the next boundary). A compact
                # master's high half is the working copy (compact.py): its first pass writes both halves and the second
                # the moments, more bytes than a preview's split (cpu_final.py), which "auto" leaves to `true` until
                # measured; never on a drive, whose staged halves each pass would read and write again.
                two_pass = not store.compact or (store.master_lo is not None and self.weights_first.forced is True)
                if (weights_first and not store.lean and not store.sharded and two_pass
                        and (record.from_accum or record.window_sum or self.weights_first.forced)):
                    self.stats.weights_first_blocks += 1
                    self._submit_for(store, self._preview_job(record, final, clip_coef))
                    second_pass.append((record, final))
                else:
                    self._submit_for(store, self._final_job(record, final, clip_coef, redo=False))
            elif unchanged:
                store.life.settled()
            else:
                self.stats.redo_blocks += 1
                store.life.update_begins()
                store.life.grads_claimed()
                self._submit_for(store, self._final_job(record, final, clip_coef, redo=True))
        # The fp32 state after every preview in the next backward's order, in which it wants the blocks' gradient
        # buffers (and, speculating, their states) back: the output part (the LM head) first, then the last block
        # first, the input part last.
        self.split_last_step = bool(second_pass)
        for record, final in sorted(second_pass, key=lambda pair: _backward_order(pair[0].store.index)):
            self._submit_for(record.store, self._final_job(record, final, clip_coef, redo=False, weights_written=True))
        self.step_made()
        self._end_step()

    def _end_step(self) -> None:
        self.records = []
        self.micro, self.taken, self._before, self._stores = [], [], [], []
        self._running_sq = 0.0  # every sum of this step has run (grad_sq_sum); early updates may still be running
        self.forecast.end_step()

    def _step(self, store: BlockStore, grad: torch.Tensor, segments: list[tuple[Segment, AdamWCoeffs]],
              scale: float) -> None:
        """AdamW on the store's segments with the gradient times `scale`, the compute-dtype weights into its working
        copy. A compact master (compact.py) is updated in its halves in place, in one pass, without merging it."""
        pieces = grad_pieces(store, grad, [seg for seg, _ in segments])
        if store.compact:
            high = store.working[store.shard_start:store.shard_stop]
            with store.halves() as (low, exp_avg, exp_avg_sq):
                for i, s, g in pieces:
                    self.kernel.step_compact(high[s], low[s], exp_avg[s], exp_avg_sq[s], g, segments[i][1], scale)
            return
        with store.states() as (master, exp_avg, exp_avg_sq):
            for i, s, g in pieces:
                self.kernel.step(master[s], exp_avg[s], exp_avg_sq[s], g, self._out(store, s.start, s.stop),
                                 segments[i][1], scale)


def _backward_order(index: int) -> tuple[bool, int]:
    """Sort key of a store index (cached.py's parts below the blocks') in the order backward reaches them."""
    return index != OUTPUT_INDEX, -index
