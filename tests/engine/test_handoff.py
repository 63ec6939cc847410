"""A failure, or a Ctrl-C the script catches, at each point where backward hands a streamed block's gradients to the
CPU optimizer: the engine goes on as if that micro-batch had never run.

The hand-off of block 2 (the middle streamed block; backward reaches 3, 2, 1) is: take the block's host gradient
buffer (`take_grad_buffer`), copy the gradients into it (`Transfers.offload`), record the job (`UpdateRecord` at a
boundary, `MicroAccum` between boundaries), queue it (`Worker._send`), run it on the worker. An exception is raised
right after the buffer is taken ("before_copy"), after the copy ("after_copy"), as the record is made, after the
block's step counters advanced ("before_record"), after the job went into the queue ("after_queue") and in the job
itself ("in_worker": the test lets the worker fail before backward goes on, so the next hand-off raises it). Before
the fix the buffer stayed taken
for good, and the next backward waited `stall_timeout_s` for it. Each case then trains 5 more steps and must equal a
clean run that never saw the micro-batch (1e-6, as tests/engine/test_step_state.py: undoing an early update rounds
once in fp32), which itself matches plain PyTorch AdamW (1e-5). `stall_timeout_s` is short only so that a regression
fails instead of hanging; the verdict is the equality.

A job can also fail after its micro-step returned (the worker behind): the window is then lost and its step skipped,
and a failed job of a step already made breaks the optimizer for good (cpu_rollback.py). The tests hold the failing
job until the main thread is where each case needs it.
"""

import threading
import time

import pytest

from stronghold.optim import cpu_optim

from .helpers import batches, engine_for, relative_error, tiny_llama, train_loop, train_reference

LR = 3e-3
TOL = 1e-6
REF_TOL = 1e-5
TARGET = 2
POINTS = ["before_copy", "after_copy", "before_record", "after_queue", "in_worker"]
POOLED = {"gas": 2, "pooled_grads": True, "gradient_spares": False}
"""Pooled landing buffers (grad_pool.py): block 3's sum has given its buffer back before block 2's hand-off fails, so
a failure after the window's first micro-step cannot be taken back out: the window is skipped, as if it never ran."""


class Boom(RuntimeError):
    pass


def _engine(model, **cfg):
    return engine_for(model, lr=LR, **cfg)


def _inject(monkeypatch, engine, point: str, exc: type[BaseException]) -> None:
    """Arm the failure at `point` of block TARGET's next hand-off (armed as its gradient buffer is taken)."""
    runtime = engine.stronghold_runtime
    cpu, target = runtime.cpu, runtime.stores[TARGET]
    armed = {"on": False, "fired": False}

    def fire():
        armed["on"], armed["fired"] = False, True
        raise exc(f"injected {point}")

    take = cpu.take_grad_buffer

    def take_grad_buffer(store):
        take(store)
        if store is target and not armed["fired"]:
            armed["on"] = True
            if point == "before_copy":
                fire()

    monkeypatch.setattr(cpu, "take_grad_buffer", take_grad_buffer)
    offload = runtime.transfers.offload

    def copy_then_fail(*args):
        offload(*args)
        if armed["on"] and point == "after_copy":
            fire()

    monkeypatch.setattr(runtime.transfers, "offload", copy_then_fail)
    for name in ("UpdateRecord", "MicroAccum"):
        real = getattr(cpu_optim, name)

        def record(store, *args, real=real, **kwargs):
            if armed["on"] and point == "before_record" and store is target:
                fire()
            return real(store, *args, **kwargs)

        monkeypatch.setattr(cpu_optim, name, record)
    send = cpu._send
    release = armed["release"] = threading.Event()

    def fail_when_released():
        assert release.wait(WAIT_S), "the test never released the failing job"
        raise exc("injected in_worker_late")

    def queue_then_fail(item):
        if armed["on"] and point in ("in_worker", "in_worker_late"):
            armed["on"], armed["fired"] = False, True
            if point == "in_worker_late":  # the block's job raises on the worker once the test lets it
                send((item[0], item[1], fail_when_released))
                return
            send((item[0], item[1], lambda: fire()))  # the block's job raises on the worker, before backward goes on
            deadline = time.monotonic() + WAIT_S
            while not cpu.failed:
                assert time.monotonic() < deadline, "the worker never ran the failing job"
                time.sleep(0.001)
            return
        send(item)
        if armed["on"] and point == "after_queue":
            fire()

    monkeypatch.setattr(cpu, "_send", queue_then_fail)
    engine.injected = armed


WAIT_S = 60.0
"""Bounds the test's own waits for the worker, so that a regression fails instead of hanging."""


CASES = [(point, exc, {}, 0) for point in POINTS for exc in (Boom, KeyboardInterrupt)]
CASES += [(point, KeyboardInterrupt, {"gas": 2}, micro) for point in POINTS for micro in (0, 1)]
CASES += [(point, KeyboardInterrupt, {"gas": 2, "gpu_accumulation": True}, 1) for point in POINTS]
CASES += [(point, KeyboardInterrupt, POOLED, micro) for point in POINTS for micro in (0, 1)]
_clean = {}


def _clean_run(model, kept, failed, cfg):
    """A stronghold run on `kept` (checked against plain PyTorch AdamW), cached per configuration and failed index."""
    key = (failed, *sorted(cfg.items()))
    if key not in _clean:
        engine = _engine(model, **cfg)
        train_loop(engine, kept)
        engine.synchronize_host()
        reference, _ = train_reference(model, kept, lr=LR, clip=cfg["clip"], gas=cfg.get("gas", 1))
        assert relative_error(engine.module, reference) <= REF_TOL
        _clean[key] = engine.module
    return _clean[key]


@pytest.mark.parametrize("point,exc,extra,micro", CASES,
                         ids=[f"{p}-{e.__name__}-{'-'.join(f'{k}{v}' for k, v in x.items()) or 'gas1'}-micro{m}"
                              for p, e, x, m in CASES])
def test_a_failed_hand_off_leaves_nothing_taken(monkeypatch, point, exc, extra, micro):
    cfg = dict(window=2, resident=1, clip=1.0, stall_timeout_s=10, **extra)
    gas = cfg.get("gas", 1)
    model = tiny_llama(4)
    failed = gas + micro  # a micro-batch of the second window
    data = batches(failed + 1 + 5 * gas - micro)  # then the rest of its window and 5 more steps
    kept = data[:failed] + data[failed + 1:]
    window_lost = extra is POOLED and micro > 0
    if window_lost:  # the window: its micro-batches before the failed one, and as many after it as it lacked
        kept = data[:gas] + data[failed + 1 + gas - micro:]
    engine = _engine(model, **cfg)
    train_loop(engine, data[:failed])
    with monkeypatch.context() as patches:
        _inject(patches, engine, point, exc)
        loss = engine(**data[failed]).loss
        with pytest.raises((exc, RuntimeError)) as raised:
            engine.backward(loss)
            engine.step()  # at a boundary, a job's failure on the worker may surface here
        assert engine.injected["fired"], "the failure was injected"
        if raised.type is RuntimeError and exc is not RuntimeError:
            assert "CPU optimizer failed" in str(raised.value) and point == "in_worker"
    train_loop(engine, data[failed + 1:])
    assert engine.global_steps == 1 + 5
    assert engine.skipped_steps == int(window_lost)
    engine.synchronize_host()
    assert relative_error(engine.module, _clean_run(model, kept, -1 if window_lost else failed, cfg)) <= TOL


LATE = [({"gas": 2}, Boom), ({"gas": 2}, KeyboardInterrupt), (POOLED, Boom)]


@pytest.mark.parametrize("extra,exc", LATE, ids=[f"{'pooled' if x is POOLED else 'spares'}-{e.__name__}" for x, e in LATE])
def test_a_job_that_fails_after_its_micro_step_loses_the_window(monkeypatch, extra, exc):
    """Block 2's job of the second window's first micro-step fails only after that micro-step's backward and step()
    returned: the next backward raises it and is discarded, and the window, whose sums lack that job and the ones
    after it, is skipped; training then goes on exactly as if the window had held none of the failed micro-batch."""
    cfg = dict(window=2, resident=1, clip=1.0, stall_timeout_s=10, **extra)
    gas = cfg["gas"]
    model = tiny_llama(4)
    failed = gas
    data = batches(failed + 3 + 4 * gas)  # the failed micro-batch, the one whose backward raises, the window's last
    engine = _engine(model, **cfg)
    train_loop(engine, data[:failed])
    with monkeypatch.context() as patches:
        _inject(patches, engine, "in_worker_late", exc)
        train_loop(engine, data[failed:failed + 1])
        assert engine.injected["fired"], "the failure was injected"
        engine.injected["release"].set()
        loss = engine(**data[failed + 1]).loss
        with pytest.raises(RuntimeError, match="CPU optimizer failed"):
            engine.backward(loss)
    train_loop(engine, data[failed + 2:])
    assert (engine.global_steps, engine.skipped_steps) == (1 + 5, 1)
    engine.synchronize_host()
    kept = data[:gas] + data[failed + 3:]
    assert relative_error(engine.module, _clean_run(model, kept, -1, cfg)) <= TOL


def test_a_job_that_fails_after_its_step_was_made_breaks_the_optimizer(monkeypatch, tmp_path):
    """Block 2's update of a step that step() has made fails on the worker afterwards: the step is half applied, so
    every later call raises, naming the way out, and no checkpoint of the broken state is written."""
    engine = _engine(tiny_llama(4), window=2, resident=1, clip=1.0, stall_timeout_s=10)
    data = batches(3)
    train_loop(engine, data[:1])
    with monkeypatch.context() as patches:
        _inject(patches, engine, "in_worker_late", Boom)
        train_loop(engine, data[1:2])
        assert engine.injected["fired"], "the failure was injected"
        engine.injected["release"].set()
        for _ in range(2):
            with pytest.raises(RuntimeError, match="load the last checkpoint") as raised:
                train_loop(engine, data[2:])
            assert isinstance(raised.value.__cause__, Boom), "the job's own failure is the cause"
        with pytest.raises(RuntimeError, match="load the last checkpoint"):
            engine.save_checkpoint(str(tmp_path))
    assert not any(tmp_path.iterdir())
