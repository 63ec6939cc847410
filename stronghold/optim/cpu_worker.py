"""The CPU optimizer's worker thread: one Python thread that runs submitted jobs in order, surfaces a job's
failure on the caller's thread, bounds every wait for it, and is joined at `close()` and at interpreter exit.

The parallelism is inside the jobs (the native AdamW kernel's pthreads, with the GIL released), so the thread that
launches GPU work keeps going while a job runs. cpu_optim.CpuOptimizer is the one user: its jobs accumulate and
apply each streamed block's gradients.

Jobs run in submission order, except that an *urgent* job runs before every ordinary one not yet begun: the sums of
squares that step() waits for are urgent, the early updates that may run behind them are not (cpu_optim.py). The
caller keeps each block's own jobs in order (a block's next job is submitted only once its previous one released
the block's buffers), so only jobs of different blocks are reordered.
"""
from __future__ import annotations

import atexit
import itertools
import queue
import threading
import time
import warnings
import weakref
from typing import Callable, Optional


class Worker:
    def __init__(self, join_timeout_s: float = 60.0, stall_timeout_s: float = 600.0):
        self.join_timeout_s = join_timeout_s
        self.stall_timeout_s = stall_timeout_s
        """A `wait` that takes longer raises TimeoutError naming what it waited for."""
        self._error: Optional[BaseException] = None
        self._queue: "queue.PriorityQueue[tuple[int, int, Optional[Callable[[], None]]]]" = queue.PriorityQueue()
        self._order = itertools.count()
        """Ties within a priority (0 urgent, 1 ordinary, 2 the stop mark) go in submission order."""
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
        while True:
            _, _, job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            if self._error is None:
                try:
                    self._execute(job)
                except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
                    self._error = err
            self._queue.task_done()

    def check(self) -> None:
        """Re-raise a failure of the worker on the calling thread."""
        if self._error is not None:
            raise RuntimeError("stronghold's CPU optimizer failed; the step was not applied") from self._error

    def _submit(self, job: Callable[[], None], urgent: bool = False) -> None:
        self.check()
        if not self._thread.is_alive():
            raise RuntimeError("stronghold's CPU optimizer was closed (engine.destroy()); build a new engine")
        self._queue.put((0 if urgent else 1, next(self._order), job))

    def wait(self, event: threading.Event, what: str) -> None:
        """Wait for `event` (set by a job); `what` names it in the error if it never comes."""
        # A failed worker never sets the events; poll so the failure surfaces instead of a hang. A job
        # stuck behind a copy that never lands fails at the deadline instead, naming the block and stage.
        deadline = time.monotonic() + self.stall_timeout_s
        while not event.wait(0.05):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"stronghold: waited {self.stall_timeout_s:g} s for {what}; the CPU optimizer has "
                    f"{self._queue.unfinished_tasks} unfinished jobs and its thread is "
                    f"{'alive' if self._thread.is_alive() else 'gone'}. If the host is only slow, raise "
                    f"stronghold.stall_timeout_s in ds.json")
        self.check()

    def submit_after(self, job: Callable[[], None]) -> None:
        """Run `job` on the worker after every job submitted so far (it runs them in order)."""
        self._submit(job)

    def drain(self) -> None:
        """Wait until every submitted job has run (e.g. before reading host state for a checkpoint)."""
        self._queue.join()
        self.check()

    def close(self) -> None:
        """Finish the queued jobs and join the worker (idempotent); warn if it does not stop in time."""
        atexit.unregister(self._atexit)
        if not self._thread.is_alive():
            return
        self._queue.put((2, next(self._order), None))
        self._thread.join(timeout=self.join_timeout_s)
        if self._thread.is_alive():
            warnings.warn(f"stronghold: the CPU optimizer thread did not finish its queued updates within "
                          f"{self.join_timeout_s:.0f} s; the process may abort at exit")
