"""The CPU optimizer's worker thread: one Python thread that runs submitted jobs in order, surfaces a job's
failure on the caller's thread, bounds every wait for it, and is joined at `close()` and at interpreter exit.

The parallelism is inside the jobs (the native AdamW kernel's pthreads, with the GIL released), so the thread that
launches GPU work keeps going while a job runs. cpu_optim.CpuOptimizer is the one user: its jobs accumulate and
apply each streamed block's gradients.

Jobs run in submission order, except that an *urgent* job runs before every ordinary one not yet begun: the sums of
squares that step() waits for are urgent, and a micro-step's sum whose block has no update queued; the early updates
that may run behind them are not (cpu_optim.py). The
caller keeps each block's own jobs in order (a block's next job is submitted only once its previous one released
the block's buffers), so only jobs of different blocks are reordered.

A Ctrl-C can land anywhere on the submitting thread and lose nothing. Its KeyboardInterrupt surfaces on the main
thread between two bytecodes, most often right after the main thread woke the worker (waking it hands the worker the
GIL; the signal is handled as the main thread takes it back). With `queue.Queue`, whose put is Python code around a
`threading.Condition`, it could land inside `notify` after the worker's waiter was released and before it was removed
from the condition's list: that stale waiter swallowed the next wake-up, so a job, or close()'s stop mark, sat in the
queue while the worker slept (and close() waited out its join timeout); or between the item going in and the count of
unfinished tasks going up, after which the worker's `task_done` raised and the thread died. So:
- jobs go through a `queue.SimpleQueue`, whose put is one C call (no signal splits it, and it keeps no list of
  waiters); the worker moves them into its own heap for the priorities;
- `drain` waits for a marker that the worker sets after every job submitted before it, not for a count of tasks;
- the calling thread never calls `Thread.is_alive` or `Thread.join` (a KeyboardInterrupt inside either can mark the
  live thread stopped: CPython 3.11's `_wait_for_tstate_lock`); the events it sets and waits on are `Flag`s
  (streaming/flag.py: a `threading.Event` is Python code around a lock, which an interrupt can leave held); close()
  touches none: the stop flag is a plain attribute, and the worker holds a raw lock while it runs, which close()
  acquires with a timeout;
- the worker never sleeps unboundedly: it looks at the stop flag every `POLL_S`, so a close() interrupted before its
  stop mark went in still stops it.
"""
from __future__ import annotations

import atexit
import heapq
import itertools
import queue
import threading
import time
import warnings
import weakref
from typing import Callable, Optional, Union

from stronghold.streaming.flag import Flag

POLL_S = 0.05
"""Longest the worker waits for a job before it looks at the stop flag again; also the period of `wait`'s checks."""

URGENT, ORDINARY, STOP = 0, 1, 2
"""Priorities: urgent jobs first, then ordinary ones (and `drain`'s markers), then the stop mark."""

Item = tuple[int, int, Union[Callable[[], None], Flag, None]]
"""(priority, submission number, a job, a `drain` marker to set, or None: the stop mark)."""


class Worker:
    def __init__(self, join_timeout_s: float = 60.0, stall_timeout_s: float = 600.0):
        self.join_timeout_s = join_timeout_s
        self.stall_timeout_s = stall_timeout_s
        """A `wait` that takes longer raises TimeoutError naming what it waited for."""
        self._error: Optional[BaseException] = None
        self._lost_from: Optional[int] = None
        """The least submission number of the job that raised `_error` and of the jobs skipped after it
        (cpu_rollback.py: whose micro-steps and steps lost work); `take_failure` clears it."""
        self._made_below = 0
        """Jobs numbered below it belong to optimizer steps already made (`step_made`)."""
        self._broken: Optional[str] = None
        """Set by `break_for_good`: a job of an optimizer step already made failed, so the weights and states are partly
        of that step; every later call raises this, from `_broken_by` (the job's own exception)."""
        self._broken_by: Optional[BaseException] = None
        self._inbox: "queue.SimpleQueue[Item]" = queue.SimpleQueue()
        self._order = itertools.count()
        """Ties within a priority go in submission order."""
        self._queued = 0
        """Items the worker has taken from the inbox and not yet begun (for the stall message)."""
        self._stopping = False
        """Set by `close()` before it sends the stop mark: the worker also stops once nothing is left to run, so a stop
        mark that an interrupt kept from being sent still stops it; submitting after it is an error."""
        self._running = threading.Lock()
        """Held while the worker runs: taken here, released by the worker as it returns (no job runs after)."""
        self._running.acquire()
        self._thread = threading.Thread(target=self._run, name="stronghold-cpu-adamw", daemon=True)
        self._thread.start()
        # A daemon thread still inside the native kernel when the interpreter tears down aborts the
        # process ("terminate called without an active exception"): drain and join it at exit.
        ref = weakref.ref(self)
        self._atexit = lambda: (ref() is not None and ref().close())
        atexit.register(self._atexit)

    def _execute(self, job: Callable[[], None]) -> None:
        """Run one job on the worker thread (a subclass times it)."""
        job()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._running.release()

    def _serve(self) -> None:
        waiting: list[Item] = []  # taken from the inbox, not yet begun: a heap, most urgent first
        while True:
            try:
                # Everything submitted so far joins the heap before the next item is chosen, so an urgent job
                # overtakes every ordinary one not yet begun.
                heapq.heappush(waiting, self._inbox.get(block=not waiting, timeout=POLL_S))
                self._queued = len(waiting)
                continue
            except queue.Empty:
                if not waiting:
                    if self._stopping:
                        return
                    continue
            _, order, job = heapq.heappop(waiting)
            self._queued = len(waiting)
            if job is None:
                return
            if isinstance(job, Flag):
                job.set()  # a drain marker: every job submitted before it has run (or been skipped)
            elif self._error is None:
                try:
                    self._execute(job)
                except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
                    self._lost_from, self._error = order, err
            else:  # skipped: an urgent job may have failed before earlier ordinary ones ran
                self._lost_from = min(self._lost_from, order)

    def check(self) -> None:
        """Re-raise a failure of the worker on the calling thread; one that lost a job of a step already made breaks
        the optimizer for good (`break_for_good`)."""
        self._breaks_if_made(self._lost_from, self._error)
        if self._broken is not None:
            raise RuntimeError(self._broken) from self._broken_by
        if self._error is not None:
            raise RuntimeError("stronghold's CPU optimizer failed; the step was not applied") from self._error

    @property
    def failed(self) -> bool:
        """A job raised: the worker skips every later job until `abort` (cpu_rollback.py) takes the failure."""
        return self._error is not None

    def step_made(self) -> None:
        """Every job submitted so far belongs to optimizer steps made: none of them can be taken back."""
        self._made_below = next(self._order)

    def take_failure(self) -> tuple[Optional[BaseException], Optional[int]]:
        """The worker's failure and the least submission number of the jobs it lost, both cleared: the worker runs
        jobs again. The caller has joined it (no job is running)."""
        failure, lost_from = self._error, self._lost_from
        self._error = self._lost_from = None
        return failure, lost_from

    def _breaks_if_made(self, lost_from: Optional[int], cause: Optional[BaseException]) -> Optional[RuntimeError]:
        """Break for good where the failure lost a job of a step already made (numbered below `_made_below`); the
        error every later call raises, or None."""
        if self._broken is None and lost_from is not None and lost_from < self._made_below:
            self.break_for_good("in a job of an optimizer step already made", cause)
        return RuntimeError(self._broken) if self._broken is not None else None

    def break_for_good(self, what: str, cause: Optional[BaseException]) -> RuntimeError:
        """A job of a step that was already made failed (`what` says which, `cause` is its exception): no later call can
        put the weights and states back together, so every one raises (the error returned), naming the way out."""
        self._broken_by = cause
        self._broken = (f"stronghold's CPU optimizer failed {what}: the model's weights and optimizer states are "
                        "partly of that step and cannot be used. Build the engine again and load the last checkpoint "
                        "(engine.load_checkpoint)")
        return RuntimeError(self._broken)

    def _send(self, item: Item) -> None:
        self._inbox.put(item)  # one C call: done or not, never half (see the module docstring)

    def _submit(self, job: Callable[[], None], urgent: bool = False) -> None:
        self.check()
        if self._stopping:
            raise RuntimeError("stronghold's CPU optimizer was closed (engine.destroy()); build a new engine")
        self._send((URGENT if urgent else ORDINARY, next(self._order), job))

    def _stalled(self, what: str) -> TimeoutError:
        queued = self._inbox.qsize() + self._queued
        return TimeoutError(
            f"stronghold: waited {self.stall_timeout_s:g} s for {what}; the CPU optimizer has {queued} jobs queued "
            f"behind the one it is running, and its thread is {'alive' if self._running.locked() else 'gone'}. If "
            "the host is only slow, raise stronghold.stall_timeout_s in ds.json")

    def _wait(self, event: Flag, what: str, check: bool) -> None:
        # A failed worker never sets the events; poll so the failure surfaces instead of a hang (`check`). A job
        # stuck behind a copy that never lands fails at the deadline instead, naming the block and stage.
        deadline = time.monotonic() + self.stall_timeout_s
        while not event.wait(POLL_S):
            if check:
                self.check()
            if time.monotonic() > deadline:
                raise self._stalled(what)
        if check:
            self.check()

    def wait(self, event: Flag, what: str) -> None:
        """Wait for `event` (set by a job); `what` names it in the error if it never comes."""
        self._wait(event, what, check=True)

    def submit_after(self, job: Callable[[], None]) -> None:
        """Run `job` on the worker after every job submitted so far (it runs them in order)."""
        self._submit(job)

    def _join(self, what: str) -> None:
        """Wait until every job submitted so far has run, or been skipped after a failure (which this does not
        raise); bounded like `wait`."""
        if not self._running.locked():
            return  # the worker has stopped: nothing runs and nothing will
        marker = Flag()
        self._send((ORDINARY, next(self._order), marker))
        self._wait(marker, what, check=False)

    def drain(self) -> None:
        """Wait until every submitted job has run (e.g. before reading host state for a checkpoint)."""
        self._join("every queued CPU job to finish")
        self.check()

    def close(self) -> None:
        """Finish the queued jobs and join the worker (idempotent); warn if it does not stop in time."""
        self._stopping = True  # first: interrupted before it, close() changed nothing and exit calls it again
        atexit.unregister(self._atexit)
        self._send((STOP, next(self._order), None))
        if self._running.acquire(timeout=self.join_timeout_s):
            self._running.release()  # for a later close(), which then returns at once
        else:
            warnings.warn(f"stronghold: the CPU optimizer thread did not finish its queued updates within "
                          f"{self.join_timeout_s:.0f} s; the process may abort at exit")
