"""The CPU optimizer's worker thread: jobs in submission order, urgent ones before ordinary ones not yet begun."""
import threading

from stronghold.optim.cpu_worker import Worker


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
