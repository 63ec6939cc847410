"""The CPU optimizer's worker thread: one Python thread that runs submitted jobs in order, surfaces a job's
failure on the caller's thread, bounds every wait for it, and is joined at `close()` and at interpreter exit.

The parallelism is inside the jobs (the native AdamW kernel's pthreads, with the GIL released), so the thread that
launches GPU work keeps going while a job runs. cpu_optim.CpuOptimizer is the one user: its jobs accumulate and
apply each streamed block's gradients.

Jobs run in submission order, except that an *urgent* job runs before every ordinary one not yet begun: the sums of
squares that step() waits for are urgent, the early updates that may run behind them are not (cpu_optim.py). The
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
  live thread stopped: CPython 3.11's `_wait_for_tstate_lock`), nor sets or waits on a `threading.Event` in close()
  (Python code around a lock, which an interrupt can leave held): the stop flag is a plain attribute, and the worker
  holds a raw lock while it runs, which close() acquires with a timeout;
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

POLL_S = 0.05
"""Longest the worker waits for a job before it looks at the stop flag again; also the period of `wait`'s checks."""

URGENT, ORDINARY, STOP = 0, 1, 2
"""Priorities: urgent jobs first, then ordinary ones (and `drain`'s markers), then the stop mark."""

Item = tuple[int, int, Union[Callable[[], None], threading.Event, None]]
"""(priority, submission number, a job, a `drain` marker to set, or None: the stop mark)."""


class Worker:
    def __init__(self, join_timeout_s: float = 60.0, stall_timeout_s: float = 600.0):
        self.join_timeout_s = join_timeout_s
        self.stall_timeout_s = stall_timeout_s
        """A `wait` that takes longer raises TimeoutError naming what it waited for."""
        self._error: Optional[BaseException] = None
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
            _, _, job = heapq.heappop(waiting)
            self._queued = len(waiting)
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()  # a drain marker: every job submitted before it has run (or been skipped)
            elif self._error is None:
                try:
                    self._execute(job)
                except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
                    self._error = err

    def check(self) -> None:
        """Re-raise a failure of the worker on the calling thread."""
        if self._error is not None:
            raise RuntimeError("stronghold's CPU optimizer failed; the step was not applied") from self._error

    @property
    def failed(self) -> bool:
        """A job raised: the worker skips every later job until `abort` (cpu_rollback.py) takes the failure."""
        return self._error is not None

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

    def _wait(self, event: threading.Event, what: str, check: bool) -> None:
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

    def wait(self, event: threading.Event, what: str) -> None:
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
        marker = threading.Event()
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
