"""A Ctrl-C during step(), caught by the script, which then trains on: the result equals a run that was never
interrupted (1e-6, the tolerance of tests/engine/test_handoff.py's clean runs).

step() first waits (`StrongholdRuntime.prepare_step`: the window closed, the CPU's gradient sums), then folds the
resident gradients into the norm and updates. An interrupt in the waits leaves the step to do: calling step() again
does it. An interrupt during the rest is held until it is complete (engine/interrupts.py) and raised as step()
returns: the step is done, and the script goes on with the next batch. The waits are hit at every line by
`InterruptAt` (until a run's waits end before the interrupt: how many lines they run depends on the worker's
progress); the rest by a real SIGINT that the process sends itself from inside it (the handler that holds it is a
signal handler, which a traced exception would bypass).
"""
import os
import signal
import threading

import pytest

from stronghold.engine.interrupts import deferred_interrupt
from stronghold.engine.runtime import StrongholdRuntime
from stronghold.optim.cpu_optim import CpuOptimizer

from .helpers import batches, engine_for, relative_error, tiny_llama
from .interrupts import InterruptAt

TOL = 1e-6
CFG = dict(window=2, resident=1, clip=1.0, stall_timeout_s=10, gas=2)


def _micro_steps(engine, data):
    for batch in data:
        engine.backward(engine(**batch).loss)
        engine.step()


@pytest.fixture(scope="module")
def setup():
    model, data = tiny_llama(4), batches(6)
    reference = engine_for(model, **CFG)
    _micro_steps(reference, data)
    reference.synchronize_host()
    return model, data, reference.module


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt here as in a terminal (a shell without job control starts background jobs with
    it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


WAITS = [StrongholdRuntime._close_window, CpuOptimizer.grad_sq_sum]
"""What prepare_step waits for (with data parallel also the resident reductions, not run here)."""


MAX_LINES = 10_000
"""A bound on the lines of the waits: their count depends on how far the CPU worker got (a block's sum is claimed or
waited for), so the test walks every line of each run until a run ends before its interrupt."""


def test_an_interrupt_in_the_waits_leaves_the_step_to_do_again(setup):
    model, data, reference = setup
    for n in range(1, MAX_LINES):
        engine = engine_for(model, **CFG)
        _micro_steps(engine, data[:1])
        engine.backward(engine(**data[1]).loss)
        interrupted = True
        try:
            with InterruptAt(WAITS, n=n) as probe:
                engine.step()
            interrupted = False
        except KeyboardInterrupt:
            assert probe.fired_at is not None
            assert engine.global_steps == 0, f"nothing of the step was done (interrupted at {probe.fired_at})"
            engine.step()
        assert engine.global_steps == 1
        _micro_steps(engine, data[2:])
        engine.synchronize_host()
        assert relative_error(engine.module, reference) <= TOL, f"interrupted at line {n} of the waits"
        engine.destroy()
        if not interrupted:  # this run's waits had fewer than n lines: every line before was hit
            assert probe.fired_at is None and n > 10, f"only {n - 1} lines in the waits: the probe missed them"
            return
    pytest.fail(f"the waits ran over {MAX_LINES} lines")


@pytest.mark.parametrize("where", ["cpu", "resident"])
def test_a_ctrl_c_during_the_update_is_held_until_it_is_complete(setup, ctrl_c_raises, monkeypatch, where):
    model, data, reference = setup
    engine = engine_for(model, **CFG)
    runtime = engine.stronghold_runtime
    _micro_steps(engine, data[:1])
    engine.backward(engine(**data[1]).loss)
    owner = runtime.cpu if where == "cpu" else runtime.resident
    name = "finish_step" if where == "cpu" else "step"
    original = getattr(owner, name)

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # handled at the interpreter's next check, inside the update
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    assert engine.global_steps == 1, "the step was completed before the interrupt was raised"
    _micro_steps(engine, data[2:])
    engine.synchronize_host()
    assert relative_error(engine.module, reference) <= TOL
    engine.destroy()


def test_the_held_signal_goes_to_the_scripts_own_handler():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the interpreter checks for signals between these calls: none may reach it
                len(seen)
            assert seen == [], "held while the block runs"
        assert seen == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is not None and signal.getsignal(signal.SIGINT)(0, None) is None
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_sigint_and_other_threads_are_left_alone():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred_interrupt():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    handlers = []

    def elsewhere():
        with deferred_interrupt():
            handlers.append(signal.getsignal(signal.SIGINT))

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(timeout=60)  # a hang guard
    assert handlers == [before]
