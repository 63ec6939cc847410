"""CPU AdamW of the streamed blocks: a worker thread that updates each block as soon as its gradients
reach the host, overlapped with the rest of backward.

Exact global-norm clipping with early per-block updates ("speculate, then validate"): each block is
updated with its unclipped gradient while backward goes on, and the kernel returns the sum of
squares of that gradient. At `step()` the global norm is known; if clipping applies (or the learning
rate / weight decay changed between backward and step), each speculative update is replaced in one
pass by the exact one (`redo`). A redo inverts the speculative step, which loses the low bits of a
state that the unclipped gradient dominated, so it is exact only to rounding of the speculative
values. Clipping tends to persist from step to step, so after a step that clipped (or whose norm
came within 80% of the limit) the next one *defers*: backward only sums the squares, and `step()` runs the one exact update with the clip
coefficient. Deferred and redone updates run in forward order, so the next forward can start on the
first block while the CPU works on the later ones. Until a block's final weights are in its working
copy its `updated` event stays clear, and the next forward's H2D of that block waits for it, only it.

The worker is one Python thread; the parallelism is inside the kernel (OpenMP), which runs with
the GIL released, so the main thread keeps launching GPU work.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .cpu_adam import AdamWCoeffs, AdamWKernel
from .store import BlockStore, ParamEntry


@dataclass(frozen=True)
class Segment:
    """A contiguous range of a block's trainable elements that shares one set of AdamW coefficients."""

    start: int
    stop: int
    coeffs: AdamWCoeffs
    group: int


@dataclass
class UpdateRecord:
    """One block's update in the current step, kept until `finish_step` validates it."""

    store: BlockStore
    segments: list[Segment]
    from_accum: bool
    final: bool
    """Speculation is off (no clipping): the update is the real one."""
    deferred: bool
    """Backward only summed the squares; `finish_step` makes the update."""
    sq: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


def group_coeffs(group: dict, step: int) -> AdamWCoeffs:
    beta1, beta2 = group["betas"]
    return AdamWCoeffs(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                       float(group["weight_decay"]), step)


def contiguous_ranges(entries: list[ParamEntry]) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for entry in entries:
        if ranges and ranges[-1][1] == entry.offset:
            ranges[-1] = (ranges[-1][0], entry.offset + entry.numel)
        else:
            ranges.append((entry.offset, entry.offset + entry.numel))
    return ranges


def segments_of(entries: list[ParamEntry], coeffs: Callable[[ParamEntry], AdamWCoeffs]) -> list[Segment]:
    """Merge adjacent entries with the same coefficients into one kernel call each."""
    segments: list[Segment] = []
    for entry in entries:
        c = coeffs(entry)
        last = segments[-1] if segments else None
        if last is not None and last.stop == entry.offset and last.coeffs == c:
            segments[-1] = Segment(last.start, entry.offset + entry.numel, c, entry.group)
        else:
            segments.append(Segment(entry.offset, entry.offset + entry.numel, c, entry.group))
    return segments


@dataclass
class CpuStats:
    busy_s: float = 0.0
    """Worker time spent in kernels (accumulate, update, redo), not counting `landed_wait_s`."""
    landed_wait_s: float = 0.0
    """Worker time waiting for a block's gradients to land on the host (the GPU had not produced them)."""
    wait_step_s: float = 0.0
    """Host time `step()` waited for the last speculative updates (the CPU tail)."""
    redo_blocks: int = 0
    deferred_blocks: int = 0


class CpuOptimizer:
    def __init__(self, kernel: AdamWKernel, param_groups: list[dict], bf16_working: bool, speculative: bool):
        self.kernel = kernel
        self.param_groups = param_groups
        self.bf16_working = bf16_working
        self.speculative = speculative
        self.defer_next = False
        """Set by the runtime when the last step clipped or came close: the next one defers."""
        self.records: list[UpdateRecord] = []
        self.stats = CpuStats()
        self._error: Optional[BaseException] = None
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="stronghold-cpu-adamw", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._error is None:
                try:
                    start, waited = time.perf_counter(), self.stats.landed_wait_s
                    job()
                    self.stats.busy_s += time.perf_counter() - start - (self.stats.landed_wait_s - waited)
                except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
                    self._error = err
            self._queue.task_done()

    def check(self) -> None:
        """Re-raise a failure of the worker on the calling thread."""
        if self._error is not None:
            raise RuntimeError("stronghold's CPU optimizer failed; the step was not applied") from self._error

    def _submit(self, job: Callable[[], None]) -> None:
        self.check()
        self._queue.put(job)

    def wait(self, event: threading.Event) -> None:
        # A failed worker never sets the events; poll so the failure surfaces instead of a hang.
        while not event.wait(0.05):
            self.check()
        self.check()

    def _landed(self, event) -> None:
        start = time.perf_counter()
        event.synchronize()
        self.stats.landed_wait_s += time.perf_counter() - start

    def _out(self, store: BlockStore, start: int, stop: int) -> Optional[torch.Tensor]:
        return store.working[start:stop] if self.bf16_working else None

    def _accumulate(self, store: BlockStore, present: list[ParamEntry], first: bool) -> None:
        assert store.accum is not None
        if first:  # the window starts: parameters without a gradient yet start from zero
            taken = {id(e) for e in present}
            for start, stop in contiguous_ranges([e for e in store.trainable if id(e) not in taken]):
                store.accum[start:stop].zero_()
        for start, stop in contiguous_ranges(present):
            self.kernel.accumulate(store.accum[start:stop], store.grad[start:stop], first=first)

    def submit_grads(self, store: BlockStore, present: list[ParamEntry], landed, boundary: bool,
                     first_in_window: bool) -> None:
        """Hand over a block whose gradients (of `present` entries) are on their way into `store.grad`.

        `landed` is the D2H event to wait on. Called on the thread that runs backward, right after the
        D2H was issued. At the accumulation boundary this schedules the (speculative) update.
        """
        accumulate = store.accum is not None
        if not boundary:
            assert accumulate, "non-boundary micro-steps need an accumulation buffer"

            def accumulate_only():
                if present:
                    self._landed(landed)
                    self._accumulate(store, present, first_in_window)
                store.grad_free.set()

            self._submit(accumulate_only)
            return
        window = [e for e in store.trainable if e.grad_this_window]
        for entry in window:
            entry.step += 1
        groups = self.param_groups
        deferred = self.speculative and self.defer_next
        record = UpdateRecord(store, segments_of(window, lambda e: group_coeffs(groups[e.group], e.step)),
                              from_accum=accumulate, final=not self.speculative, deferred=deferred)
        store.version += 1  # any GPU copy of this block is stale from now on
        store.updated.clear()
        self.records.append(record)

        def update():
            if present:
                self._landed(landed)
                if accumulate:
                    self._accumulate(store, present, first_in_window)
            grad = store.accum if accumulate else store.grad
            total = 0.0
            for seg in record.segments:
                s = slice(seg.start, seg.stop)
                if deferred:
                    total += self.kernel.sum_squares(grad[s])
                else:
                    total += self.kernel.step(store.master[s], store.exp_avg[s], store.exp_avg_sq[s], grad[s],
                                              self._out(store, seg.start, seg.stop), seg.coeffs)
            record.sq = total
            record.done.set()
            if record.final:
                store.updated.set()
                store.grad_free.set()

        self._submit(update)

    def grad_sq_sum(self) -> float:
        """Sum of squares of this step's streamed gradients (waits for the updates that compute it)."""
        start = time.perf_counter()
        for record in self.records:
            self.wait(record.done)
        self.stats.wait_step_s += time.perf_counter() - start
        return sum(record.sq for record in self.records)

    def finish_step(self, clip_coef: float) -> None:
        """Make this step's updates final: run deferred ones, redo speculative ones that clipping or new
        hyperparameters change. In forward order, so the next forward's first blocks are ready first."""
        for record in sorted(self.records, key=lambda r: r.store.index):
            final = [Segment(s.start, s.stop, group_coeffs(self.param_groups[s.group], s.coeffs.step), s.group)
                     for s in record.segments]
            unchanged = clip_coef == 1.0 and all(f.coeffs == s.coeffs for f, s in zip(final, record.segments))
            if record.final and unchanged and not record.deferred:
                # Its own job marks the block updated: step() need not wait, the CPU keeps overlapping.
                continue
            self.wait(record.done)
            store = record.store
            if record.deferred:
                self.stats.deferred_blocks += 1
                self._submit(self._final_job(record, final, clip_coef, redo=False))
                continue
            if unchanged:
                store.updated.set()
                store.grad_free.set()
                continue
            self.stats.redo_blocks += 1
            store.version += 1
            store.updated.clear()
            store.grad_free.clear()
            self._submit(self._final_job(record, final, clip_coef, redo=True))
        self.records = []

    def _final_job(self, record: UpdateRecord, final: list[Segment], clip_coef: float,
                   redo: bool) -> Callable[[], None]:
        store = record.store
        grad = store.accum if record.from_accum else store.grad

        def run():
            for spec, fin in zip(record.segments, final):
                s = slice(spec.start, spec.stop)
                state = (store.master[s], store.exp_avg[s], store.exp_avg_sq[s], grad[s],
                         self._out(store, spec.start, spec.stop))
                if redo:
                    self.kernel.redo(*state, spec.coeffs, fin.coeffs, clip_coef)
                else:
                    self.kernel.step(*state, fin.coeffs, clip_coef)
            store.updated.set()
            store.grad_free.set()

        return run

    def drain(self) -> None:
        """Wait until every submitted job has run (e.g. before reading host state for a checkpoint)."""
        self._queue.join()
        self.check()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)


def norm_and_clip_coef(sq_sum: float, max_norm: float) -> tuple[float, float]:
    """Global gradient norm and torch's clip coefficient min(1, max_norm / (norm + 1e-6))."""
    norm = math.sqrt(max(sq_sum, 0.0))
    if max_norm <= 0:
        return norm, 1.0
    return norm, min(1.0, max_norm / (norm + 1e-6))
