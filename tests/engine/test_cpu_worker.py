"""The CPU optimizer's worker thread: jobs in submission order, urgent ones before ordinary ones not yet begun, and
no wake-up lost to a Ctrl-C."""
import contextlib
import itertools
import sys
import threading
import warnings

from stronghold.optim.cpu_worker import Worker

from .interrupts import InterruptAt, wait_until


def test_urgent_jobs_overtake_waiting_ordinary_ones_and_ties_keep_their_order():
    worker = Worker()
    gate, began, ran = threading.Event(), threading.Event(), []
    try:
        worker._submit(lambda: (began.set(), gate.wait(10), ran.append("running")))
        assert began.wait(10)
        for name, urgent in (("a", False), ("b", False), ("sum1", True), ("c", False), ("sum2", True)):
            worker._submit(lambda name=name: ran.append(name), urgent=urgent)
        gate.set()
        done = threading.Event()
        worker.submit_after(done.set)
        worker.wait(done, "the last job")
        # The running job is never interrupted; then both urgent jobs in their order, then the ordinary ones in theirs.
        assert ran == ["running", "sum1", "sum2", "a", "b", "c"]
    finally:
        worker.close()


def _asleep(worker: Worker) -> bool:
    """The worker thread waits for a job, so that the next submit has to wake it: its innermost Python frame is its
    loop or a wait (sys._current_frames; this only aims the interrupts at a wake-up, no verdict reads it)."""
    frame = sys._current_frames().get(worker._thread.ident)
    return frame is not None and frame.f_code.co_name in ("_serve", "_run", "get", "wait")


def _close_without_warning(worker: Worker) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "did not finish its queued updates" fails the test
        worker.close()
    assert not worker._thread.is_alive()


def test_an_interrupt_anywhere_in_a_submit_loses_no_wake_up():
    """A KeyboardInterrupt at each line that a submit runs on the calling thread, with the worker asleep. The defect
    it guards against: one inside `queue.Queue.put`'s `Condition.notify`, after it released the worker's waiter and
    before it removed it, left a stale waiter that swallowed the next wake-up, so the next job and close()'s stop mark
    sat in the queue while the worker slept out the join timeout; one between the item going in and the queue's count
    of unfinished tasks going up killed the worker (`task_done() called too many times`). Afterwards the interrupted
    job ran at most once, the next job runs, and close() stops the worker without its warning. The 10 s timeouts only
    turn a regression into a failure instead of a hang."""
    for n in itertools.count(1):
        worker = Worker(join_timeout_s=10, stall_timeout_s=10)
        ran = []
        try:
            wait_until(lambda: _asleep(worker), "the worker waiting for a job")
            with InterruptAt([Worker._submit], n) as trap:
                with contextlib.suppress(KeyboardInterrupt):
                    worker._submit(lambda: ran.append("interrupted"))
            wait_until(lambda: _asleep(worker), "the worker waiting for a job")
            after = threading.Event()
            worker.submit_after(lambda: (ran.append("after"), after.set()))
            worker.wait(after, "the job submitted after the interrupted one")
            assert ran in (["after"], ["interrupted", "after"])
            worker.drain()
        finally:
            _close_without_warning(worker)
        if trap.fired_at is None:
            break
    assert n > 2, "the submit path has lines to interrupt"


def test_an_interrupt_anywhere_in_close_still_stops_the_worker():
    """A KeyboardInterrupt at each line of close() (a second Ctrl-C at exit): once close() has asked for the stop, the
    worker stops all the same, after the jobs queued before, even if the stop mark never went in; before, close()
    has changed nothing and stops it when called again (as the exit handler, still registered then, does)."""
    for n in itertools.count(1):
        worker = Worker(join_timeout_s=10, stall_timeout_s=10)
        ran = []
        wait_until(lambda: _asleep(worker), "the worker waiting for a job")
        worker._submit(lambda: ran.append("queued"))
        with InterruptAt([Worker.close], n) as trap:
            with contextlib.suppress(KeyboardInterrupt):
                worker.close()
        if worker._stopping:  # the stop was asked for: the worker stops on its own
            worker._thread.join(timeout=10)
        else:  # interrupted before close() changed anything: the exit handler's close() stops it
            _close_without_warning(worker)
        assert not worker._thread.is_alive() and ran == ["queued"]
        if trap.fired_at is None:
            break
    assert n > 2, "close() has lines to interrupt"
