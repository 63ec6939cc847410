"""cpu_timeline: which steps it records, how it names the worker's jobs, the boundary summary, and the engine's objects
as they were once it closes."""
import threading

from examples.bench.cpu_timeline import CpuTimeline, boundary


class Store:
    master = None

    def __init__(self, index):
        self.index = index


class Record:
    def __init__(self, store):
        self.store = store


class Cpu:
    def _execute(self, job):
        job()

    def grad_sq_sum(self):
        return 1.0

    def finish_step(self, clip_coef, skip=False):
        return clip_coef


class Window:
    def __init__(self):
        self.entered = []
        self.wait = lambda event, what: event.wait(5)

    def enter(self, block):
        self.entered.append(block)


class Runtime:
    def __init__(self):
        self.cpu, self.window = Cpu(), Window()


def _jobs(store):
    def decide():
        return store

    def accumulate_only():
        return store

    def _preview_job():
        def run():
            return store
        return run

    record = Record(store)
    return [decide, accumulate_only, _preview_job(), lambda: record, lambda: None]


def test_records_only_the_chosen_steps_and_restores():
    runtime = Runtime()
    original_wait = runtime.window.wait
    timeline = CpuTimeline(runtime, {1})
    rows_per_step = []
    for timed in (False, True, True, True):
        timeline.before(timed)
        timeline.mark("first_forward")
        runtime.window.enter(7)
        for job in _jobs(Store(7)):
            runtime.cpu._execute(job)
        event = threading.Event()
        event.set()
        runtime.window.wait(event, "the CPU update of block 7 before its load")
        assert runtime.cpu.finish_step(0.5) == 0.5 and runtime.cpu.grad_sq_sum() == 1.0
        rows_per_step.append(timeline.after())
    assert rows_per_step[0] is None and rows_per_step[1] is None and rows_per_step[3] is None
    rows = rows_per_step[2]
    assert [(r[0], r[1]) for r in rows] == [
        ("mark:first_forward", -1), ("enter", 7), ("sum", 7), ("acc", 7), ("preview", 7), ("early", 7), ("early", -1),
        ("wait", 7), ("finish", -1), ("norm", -1)]
    assert all(0 <= r[2] <= r[3] for r in rows)
    timeline.close()
    assert "_execute" not in vars(runtime.cpu) and "enter" not in vars(runtime.window)
    assert runtime.window.wait is original_wait and runtime.window.entered == [7, 7, 7, 7]


def test_boundary_lines_follow_each_block_from_its_sum_to_the_next_forward():
    rows = [["mark:last_backward", -1, 100.0, 100.0], ["sum", 9, 105.0, 112.0], ["sum", 8, 112.0, 119.0],
            ["early", 9, 119.0, 137.0], ["mark:update", -1, 150.0, 150.0], ["norm", -1, 150.0, 151.0],
            ["finish", -1, 151.0, 152.0], ["preview", 8, 152.0, 163.0], ["mark:end", -1, 160.0, 160.0],
            ["mark:first_forward", -1, 170.0, 170.0], ["enter", 8, 175.0, 175.0], ["wait", 8, 175.0, 180.0],
            ["enter", 9, 182.0, 182.0], ["mark:forward", -1, 190.0, 190.0], ["enter", 8, 195.0, 195.0]]
    lines = boundary(rows)
    assert lines[0].startswith("last backward at 100.0 ms; step() at 50.0; norm waited 1.0 ms; finish_step 1.0 ms")
    assert lines[1] == "  block   8; sum    12.0-   19.0; preview    52.0-   63.0; entered    75.0; waited   5.0"
    assert lines[2] == "  block   9; sum     5.0-   12.0; early    19.0-   37.0; entered    82.0"
