"""The step state machine: exceptions in backward, forwards out of order, non-finite steps, shutdown.

Each case is compared with a clean stronghold run that never saw the failed or skipped batch, at
1e-6 whole-model relative error (fp32, CPU): undoing an early update inverts the AdamW step in fp32,
about one rounding (~6e-8 relative) per state element. The model is Llama-shaped: it has no
parameter whose true gradient is zero (GPT-2's key bias is one), where Adam turns a one-ulp change
of a pure-noise gradient into a full-size update and 1e-6 would not hold for any two runs. The clean
run itself matches plain PyTorch AdamW to 1e-5 (REF_TOL, the equivalence tests' bar), checked too.
"""
import gc
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import stronghold

from .helpers import batches, ds_config, engine_for, relative_error, tiny_gpt2, tiny_llama, train_loop, train_reference

LR = 3e-3
TOL = 1e-6
REF_TOL = 1e-5


class Boom(RuntimeError):
    pass


def _raise_in_backward_of(module: torch.nn.Module):
    """Make the next backward through `module` raise (once)."""
    state = {"armed": True}

    def forward_hook(mod, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and tensor.requires_grad:
            def explode(grad):
                if state["armed"]:
                    state["armed"] = False
                    raise Boom("injected failure in backward")
            tensor.register_hook(explode)

    return module.register_forward_hook(forward_hook)


def _engine(model, **cfg):
    return engine_for(model, lr=LR, **cfg)


def _fail_in_block_2(engine, data, failed: int):
    """Train on data[:failed], then let micro-batch `failed` raise in block 2's backward."""
    train_loop(engine, data[:failed])
    handle = _raise_in_backward_of(engine.module.model.layers[2])
    loss = engine(**data[failed]).loss
    with pytest.raises(Boom):
        engine.backward(loss)
    handle.remove()
    return engine


def _check(engine, model, kept, **cfg):
    """`engine` equals a clean stronghold run on `kept` (TOL) and plain PyTorch (REF_TOL)."""
    engine.synchronize_host()
    clean = _engine(model, **cfg)
    train_loop(clean, kept)
    clean.synchronize_host()
    assert relative_error(engine.module, clean.module) <= TOL
    reference, _ = train_reference(model, kept, lr=LR, clip=cfg.get("clip", 0.0), gas=cfg.get("gas", 1))
    assert relative_error(engine.module, reference) <= REF_TOL


# Where backward fails: the last streamed block (first in backward), a middle one, the resident
# block 0, and the embeddings (after every streamed block has been updated early).
FAIL_AT = {"last_streamed": lambda m: m.model.layers[3], "middle_streamed": lambda m: m.model.layers[2],
           "resident": lambda m: m.model.layers[0], "embeddings": lambda m: m.model.embed_tokens}


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("where", sorted(FAIL_AT))
def test_exception_in_backward_discards_the_step(where, clip):
    model, data = tiny_llama(4), batches(7)
    failed = 1
    engine = _engine(model, window=2, resident=1, clip=clip)
    train_loop(engine, data[:failed])
    handle = _raise_in_backward_of(FAIL_AT[where](engine.module))
    loss = engine(**data[failed]).loss
    with pytest.raises(Boom):
        engine.backward(loss)
    handle.remove()
    train_loop(engine, data[failed + 1:])
    _check(engine, model, data[:failed] + data[failed + 1:], window=2, resident=1, clip=clip)


@pytest.mark.parametrize("gpu_accumulation", [False, True])
@pytest.mark.parametrize("failing_micro", [0, 1])
def test_exception_in_backward_with_accumulation_keeps_the_earlier_micro_steps(failing_micro, gpu_accumulation):
    """Accumulation 2: the failed micro-batch is replaced by the next one, as if it never ran. With the
    streamed gradients accumulated on the device (device_accum.py) too: there a failed micro-step never
    reached the accumulators (exact), on the host it is subtracted back out (fp32 rounding)."""
    model, data = tiny_llama(4), batches(7)
    failed = 2 + failing_micro
    cfg = dict(window=2, resident=1, gas=2, clip=1.0, gpu_accumulation=gpu_accumulation)
    engine = _fail_in_block_2(_engine(model, **cfg), data, failed)
    train_loop(engine, data[failed + 1:])
    assert engine.global_steps == 3
    _check(engine, model, data[:failed] + data[failed + 1:], **cfg)


def test_save_after_a_failed_backward(tmp_path):
    engine = _engine(tiny_llama(4), window=2, resident=1, clip=1.0)
    data = batches(2)
    train_loop(engine, data[:1])
    handle = _raise_in_backward_of(engine.module.model.layers[2])
    with pytest.raises(Boom):
        engine.backward(engine(**data[1]).loss)
    handle.remove()
    engine.save_checkpoint(str(tmp_path))
    assert (tmp_path / "latest").read_text().strip() == "global_step1"


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_forward_between_boundary_backward_and_step_raises_and_training_goes_on(clip):
    model, data = tiny_llama(4), batches(3)
    engine = _engine(model, window=2, resident=1, clip=clip)
    for batch in data:
        engine.backward(engine(**batch).loss)
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"before step\(\).*Call engine.step\(\)"):
            engine(**batch)
        engine.step()
    _check(engine, model, data, window=2, resident=1, clip=clip)


def test_eval_forward_between_micro_steps_is_allowed():
    model, data = tiny_llama(4), batches(4)
    engine = _engine(model, window=2, resident=1, gas=2, clip=1.0)
    for i, batch in enumerate(data):
        engine.backward(engine(**batch).loss)
        if i % 2 == 0:
            with torch.no_grad():
                engine(**batch)
        engine.step()
    _check(engine, model, data, window=2, resident=1, gas=2, clip=1.0)


def _nan_loss(engine_or_model, batch, where):
    model = getattr(engine_or_model, "module", engine_or_model)
    loss = engine_or_model(**batch).loss
    if where == "everywhere":
        return loss * float("nan")
    # Only the embedding's gradient is NaN: every streamed block is finite and updated early.
    return loss + float("nan") * model.model.embed_tokens.weight.sum()


@pytest.mark.parametrize("clip", [0.0, 1.0])
@pytest.mark.parametrize("where", ["everywhere", "embeddings_only"])
def test_non_finite_step_is_skipped_fp32(where, clip):
    model, data = tiny_llama(4), batches(5)
    bad = 2
    engine = _engine(model, window=2, resident=1, clip=clip)
    for i, batch in enumerate(data):
        loss = _nan_loss(engine, batch, where) if i == bad else engine(**batch).loss
        engine.backward(loss)
        engine.step()
        if i == bad:
            assert not math.isfinite(engine.get_global_grad_norm())
    assert engine.skipped_steps == 1
    engine.synchronize_host()
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
    _check(engine, model, data[:bad] + data[bad + 1:], window=2, resident=1, clip=clip)


def test_non_finite_step_is_skipped_bf16():
    model, data = tiny_llama(4), batches(4)
    engine = _engine(model, window=2, resident=1, clip=1.0, bf16=True)
    train_loop(engine, data[:2])
    engine.synchronize_host()
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    masters_before = {k: v.clone() for k, v in engine.stronghold_runtime.master_params().items()}
    engine.backward(_nan_loss(engine, data[2], "everywhere"))
    engine.step()
    engine.synchronize_host()
    assert engine.skipped_steps == 1
    for name, param in engine.module.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
    masters = engine.stronghold_runtime.master_params()
    # Undoing an early update is one inversion of the AdamW step in fp32: ~1 rounding per element.
    num = sum(float((masters[k].double() - v.double()).square().sum()) for k, v in masters_before.items())
    den = sum(float(v.double().square().sum()) for v in masters_before.values())
    assert (num / den) ** 0.5 <= 1e-6
    train_loop(engine, data[3:])
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


def test_meta_device_model_names_a_parameter_and_the_fix():
    with torch.device("meta"):
        model = tiny_gpt2(2)
    with pytest.raises(ValueError, match=r"'transformer\.wte\.weight' is on the meta device.*to_empty"):
        stronghold.initialize(model=model, config=ds_config())


SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading
    sys.path.insert(0, {root!r})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # a free port of its own, not the test process's
    from stronghold.engine.launch import single_process_env
    single_process_env()
    from tests.engine.helpers import batches, ds_config, tiny_gpt2
    import stronghold

    def check():  # registered first, so it runs after stronghold's own exit handler
        workers = [t for t in threading.enumerate() if t.name == "stronghold-cpu-adamw"]
        print("WORKERS_ALIVE", sum(t.is_alive() for t in workers), flush=True)
    atexit.register(check)
    engine, _, _, _ = stronghold.initialize(model=tiny_gpt2(4), config=ds_config(window=2, resident=0))
    for batch in batches(2):
        engine.backward(engine(**batch).loss)
        engine.step()
""")


@pytest.mark.parametrize("runs", [1, pytest.param(20, marks=pytest.mark.slow)])
def test_script_ending_right_after_step_exits_cleanly(tmp_path, runs):
    """The worker thread is drained and joined at interpreter exit (never left inside native code). A race at exit
    shows only now and then: the slow run tries it 20 times."""
    import pathlib
    root = str(pathlib.Path(__file__).resolve().parents[2])
    script = tmp_path / "end_after_step.py"
    script.write_text(SCRIPT.format(root=root))
    for _ in range(runs):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
        assert "WORKERS_ALIVE 0" in done.stdout, done.stdout[-500:]


def test_a_destroyed_engine_is_freed_with_its_runtime_and_worker():
    """README: an engine keeps its memory and CPU optimizer thread until `destroy()`; after it, dropping the engine
    frees everything it built (a second engine in the same process then gets the whole budget)."""
    import gc
    import threading
    import weakref

    engine = engine_for(tiny_llama(2), lr=1e-3, gas=2)
    train_loop(engine, batches(4))
    worker = engine.stronghold_runtime.cpu._thread
    freed = weakref.ref(engine), weakref.ref(engine.stronghold_runtime)
    engine.destroy()
    del engine
    gc.collect()
    assert [ref() for ref in freed] == [None, None]
    assert not worker.is_alive() and worker not in threading.enumerate()


@pytest.mark.parametrize("config", [
    {},
    {"clip": 1.0, "blockwise_backward": True, "rest_placement": "host"},
], ids=["default", "blockwise-rest-on-host"])
def test_an_engine_dropped_without_destroy_is_freed(config):
    """A sweep that builds engine after engine in one process and never calls destroy(): each engine, once nothing of
    the user's holds it or its model, is freed by the garbage collector (its memory, its CPU optimizer and that
    thread), as after destroy(), at the latest when the next engine is built. Parameters keep their hooks on torch's
    C++ side, where the collector cannot see a cycle through them: they reach the engine weakly. The join's timeout
    only turns a regression into a failure instead of a hang."""
    import weakref

    engine = engine_for(tiny_llama(2), lr=1e-3, gas=2, **config)
    train_loop(engine, batches(4))
    worker = engine.stronghold_runtime.cpu._thread
    freed = weakref.ref(engine), weakref.ref(engine.stronghold_runtime), weakref.ref(engine.module)
    del engine
    # Building the next engine frees it: its plan must count the dropped engine's memory as free.
    following = engine_for(tiny_llama(2), lr=1e-3, gas=2, **config)
    assert [ref() is None for ref in freed] == [True] * 3
    worker.join(timeout=30)
    assert not worker.is_alive()
    following.destroy()


def test_an_engine_collected_on_its_own_cpu_thread_closes_without_waiting_for_itself():
    """With "garbage_collection": "python" the interpreter's collections run on whatever thread allocates, the CPU
    optimizer's included: a dropped engine collected there is destroyed there, and its close, which waits for that
    thread's jobs, hands over to a new thread instead of waiting out its join timeout (and warning). The collection
    here is the worker's job, so the engine is collected on its own worker; the joins' timeouts only bound a hang."""
    import threading
    import weakref
    import warnings

    from stronghold.engine.engine import CLOSE_THREAD

    engine = engine_for(tiny_llama(3), lr=1e-3, gas=2)
    train_loop(engine, batches(4))
    cpu = engine.stronghold_runtime.cpu
    cpu.join_timeout_s = 5.0  # the failure this guards against waits it out, then warns
    freed, go, done, seen = weakref.ref(engine), threading.Event(), threading.Event(), {}

    def collect() -> None:
        go.wait()
        gc.collect()
        seen["collected"] = freed() is None
        seen["closers"] = [t for t in threading.enumerate() if t.name == CLOSE_THREAD]
        done.set()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu._submit(collect)
        del engine
        go.set()
        assert done.wait(timeout=60)
        for closer in seen["closers"]:
            closer.join(timeout=60)
        cpu._thread.join(timeout=60)
    assert seen["collected"] and len(seen["closers"]) == 1
    assert not cpu._thread.is_alive()
    assert not [w for w in caught if "did not finish" in str(w.message)]


def test_a_stalled_cpu_update_fails_naming_the_block_and_stage():
    """A CPU job that never finishes (here: one stuck ahead of the block updates) makes step() fail with
    a TimeoutError naming the block and what it waited for, instead of hanging. With accumulation on the host
    step() needs the worker's sums of squares (no claim is possible, test_claims.py). Nothing was applied, so
    once the stall clears, calling step() again finishes the step and training equals a clean run."""
    import threading
    model = tiny_llama(4)
    engine = _engine(model, clip=1.0, gas=2, stall_timeout_s=0.5)
    cpu = engine.stronghold_runtime.cpu
    data = batches(4)
    engine.backward(engine(**data[0]).loss)
    engine.step()  # the first micro-step, accumulated on the host
    cpu.drain()
    release = threading.Event()
    cpu._submit(release.wait)  # occupies the single worker: every later job queues behind it
    engine.backward(engine(**data[1]).loss)
    with pytest.raises(TimeoutError, match=r"waited 0.5 s for the gradients of block 3 to reach the host"):
        engine.step()
    release.set()
    cpu.stall_timeout_s = 600.0  # the rest must not depend on how fast a loaded 2-core CI box schedules the worker
    engine.step()
    train_loop(engine, data[2:])
    _check(engine, model, data, clip=1.0, gas=2)


def test_a_stalled_worker_behind_claimed_updates_fails_at_the_next_load():
    """Without host accumulation step() claims the updates the stuck worker has not begun and returns; their
    exact updates queue behind the stuck job, so the next forward's load of the first streamed block times out,
    naming it, instead of hanging."""
    import threading
    model = tiny_llama(4)
    engine = _engine(model, clip=1.0, stall_timeout_s=0.5)
    cpu = engine.stronghold_runtime.cpu
    release = threading.Event()
    cpu._submit(release.wait)
    data = batches(2)
    engine.backward(engine(**data[0]).loss)
    engine.step()
    assert cpu.stats.claimed_blocks == 3, "every streamed block's update was claimed"
    try:
        with pytest.raises(TimeoutError, match=r"waited 0.5 s for the CPU update of block 1 before its load"):
            engine(**data[1])
    finally:
        release.set()
        cpu.drain()


@pytest.mark.parametrize("failing_micro", [1, 2])
def test_a_failed_micro_step_of_a_pair_or_a_parked_one(failing_micro):
    """Accumulation 4 on the host: micro-steps 0 and 2 park their gradients in the spare buffer, 1 and 3 add two
    micro-steps' at once (cpu_optim._accumulate). A failure in micro-step 1 takes its own gradients back out of the
    pair's sum (fp32 rounding); one in micro-step 2 drops the parked gradients. Either way the run equals one that
    never saw the failed micro-batch."""
    model, data = tiny_llama(4), batches(9)
    failed = 4 + failing_micro
    cfg = dict(window=2, resident=1, gas=4, clip=1.0)
    engine = _fail_in_block_2(_engine(model, **cfg), data, failed)
    # Micro-step 1 failed in block 2: blocks 1 and 2 never sent theirs, so micro-step 0's stay parked; block 3's pair
    # sum lost micro-step 1's again. Micro-step 2 failed: block 3's parked gradients were dropped.
    held = {i for i, store in engine.stronghold_runtime.stores.items() if store.life.held is not None}
    assert held == ({1, 2} if failing_micro == 1 else set())
    train_loop(engine, data[failed + 1:])
    assert engine.global_steps == 2
    _check(engine, model, data[:failed] + data[failed + 1:], **cfg)
