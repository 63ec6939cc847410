"""Weights first (weights_first.py): a deferred update in two passes, the next forward's bf16 weights first
(the kernel's `preview`), the fp32 state after. The arithmetic is the one-pass update's, so a run with it on is
bit-identical to the same run with it off (masters and module weights, torch.equal); the one-pass run itself
matches plain PyTorch (test_exactness.py, test_speculation.py). Clipping at 1e-4 clips every step, so every
streamed update after the first step is deferred: the case weights first is for."""
import copy
import threading

import pytest
import torch

import stronghold
from stronghold.optim.weights_first import CPU_SLACK, PREVIEW_SHARE, WeightsFirst

from .helpers import batches, ds_config, tiny_gpt2, tiny_llama
from .test_step_state import _nan_loss

LR = 3e-3


def _engine(model, **cfg):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        lr=LR, window=2, resident=1, bf16=True, **cfg))
    return engine


def _train(engine, data, nan_at: int = -1):
    for i, batch in enumerate(data):
        loss = _nan_loss(engine, batch, "everywhere") if i == nan_at else engine(**batch).loss
        engine.backward(loss)
        engine.step()
    engine.synchronize_host()


def _assert_identical(a, b):
    ma, mb = (e.stronghold_runtime.master_params() for e in (a, b))
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(ma[id(pa)], mb[id(pb)]), f"{name}: fp32 master"
        assert torch.equal(pa.detach(), pb.detach()), f"{name}: bf16 weights"


@pytest.mark.parametrize("make,gas", [(tiny_llama, 1), (tiny_llama, 2), (tiny_gpt2, 2)])
def test_weights_first_is_bit_identical_to_the_one_pass_update(make, gas):
    model, data = make(4), batches(6)
    first, plain = _engine(model, gas=gas, clip=1e-4, weights_first=True), _engine(model, gas=gas, clip=1e-4,
                                                                                     weights_first=False)
    _train(first, data)
    _train(plain, data)
    _assert_identical(first, plain)
    split = first.stronghold_runtime.cpu.stats
    assert split.weights_first_blocks == split.deferred_blocks > 0, "every deferred update went weights first"
    assert plain.stronghold_runtime.cpu.stats.weights_first_blocks == 0
    assert first.stronghold_report()["overlap"]["weights_first_blocks_per_step"] > 0


@pytest.mark.parametrize("gas", [1, 2])
def test_compact_masters_go_halves_first_when_asked_and_stay_bit_identical(gas):
    """A compact master's working copy is its high half, which no preview may write alone: asked for, the first pass
    writes both halves and the second the moments (cpu_final.py), bit-identical to the one-pass update, moments and
    low halves included. "auto" leaves compact masters to the one-pass update, however much room the CPU has."""
    model, data = tiny_llama(4), batches(6)
    first = _engine(model, gas=gas, clip=1e-4, compact_master=True, weights_first=True)
    plain = _engine(model, gas=gas, clip=1e-4, compact_master=True, weights_first=False)
    _train(first, data)
    _train(plain, data)
    _assert_identical(first, plain)
    stores = [(first.stronghold_runtime.stores[i], plain.stronghold_runtime.stores[i])
              for i in first.stronghold_runtime.stores]
    assert stores and all(a.master_lo is not None for a, _ in stores)
    for a, b in stores:
        for name in ("master_lo", "exp_avg", "exp_avg_sq", "working"):
            assert torch.equal(getattr(a, name), getattr(b, name)), f"block {a.index}: {name}"
    split = first.stronghold_runtime.cpu.stats
    assert split.weights_first_blocks == split.deferred_blocks > 0, "every deferred update went halves first"
    auto = _engine(model, gas=2, clip=1e-4, compact_master=True)
    auto.stronghold_runtime.cpu.weights_first.decide = lambda: True  # as if the CPU had all the room
    _train(auto, batches(6))
    stats = auto.stronghold_runtime.cpu.stats
    assert stats.deferred_blocks > 0 and stats.weights_first_blocks == 0


def test_a_skipped_step_after_a_weights_first_step():
    """Step 2's deferred updates go weights first, step 3's gradients are NaN (skipped), step 4 trains on: the
    skip must see step 2's second passes done and restore nothing of them."""
    model, data = tiny_llama(4), batches(4)
    first, plain = _engine(model, clip=1e-4, weights_first=True), _engine(model, clip=1e-4, weights_first=False)
    _train(first, data, nan_at=2)
    _train(plain, data, nan_at=2)
    assert first.skipped_steps == plain.skipped_steps == 1
    _assert_identical(first, plain)


def test_fp32_has_no_working_copy_to_write_first():
    model, data = tiny_llama(4), batches(3)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        lr=LR, window=2, resident=1, clip=1e-4, weights_first=True))
    _train(engine, data)
    stats = engine.stronghold_runtime.cpu.stats
    assert stats.deferred_blocks > 0 and stats.weights_first_blocks == 0


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _step(policy: WeightsFirst, clock: _Clock, wall: float, busy: float, deferred: float, preview: float = 0.0):
    """One step's worth of worker time, then step()'s decision."""
    clock.now += wall
    policy.count(busy_s=busy + preview, preview_s=preview, deferred_s=deferred)
    return policy.decide()


def test_the_policy_previews_only_where_the_cpu_has_room():
    clock = _Clock()
    policy = WeightsFirst(clock=clock)
    assert not policy.decide(), "the first step has nothing timed"
    # Llama GA 8 as measured on an H100: 1.35 s of CPU in a 2.32 s step, 0.36 s of it deferred updates.
    assert _step(policy, clock, wall=2.32, busy=1.35, deferred=0.36)
    # The same with the previews measured: 1.35 + 0.22 stays under 0.8 of the step.
    assert _step(policy, clock, wall=2.32, busy=1.35, deferred=0.36, preview=0.22)
    # Nothing deferred in the last step (clipping inactive): nothing to write first.
    assert not _step(policy, clock, wall=2.32, busy=1.35, deferred=0.0)
    # A CPU-bound step (GPT-2 8.36 B under 32 GiB: the CPU busy most of the step, most updates deferred).
    assert not _step(policy, clock, wall=2.4, busy=1.8, deferred=1.1)
    # The boundary, by the formula: busy + PREVIEW_SHARE * deferred against CPU_SLACK * wall.
    deferred, wall = 1.0, 10.0
    busy = CPU_SLACK * wall - PREVIEW_SHARE * deferred
    assert _step(policy, clock, wall=wall, busy=busy - 1e-3, deferred=deferred)
    assert not _step(policy, clock, wall=wall, busy=busy + 1e-3, deferred=deferred)


@pytest.mark.parametrize("forced", [True, False])
def test_a_forced_setting_ignores_the_timings(forced):
    clock = _Clock()
    policy = WeightsFirst(forced, clock=clock)
    assert policy.decide() is forced
    assert _step(policy, clock, wall=1.0, busy=5.0, deferred=5.0) is forced


def test_config_rejects_a_wrong_value():
    from stronghold.config import parse_stronghold_section
    with pytest.raises(ValueError, match=r"stronghold\.weights_first: should be 'auto' or a valid boolean"):
        parse_stronghold_section({"stronghold": {"weights_first": "sometimes"}})


def test_auto_keeps_to_accumulating_steps():
    """Without accumulation the second pass would hold the gradient buffer the next backward's D2H waits for, so
    "auto" never previews there, however much room the CPU has (forced on, it does: the bit-identity test above)."""
    model, data = tiny_llama(4), batches(5)
    engine = _engine(model, clip=1e-4)
    engine.stronghold_runtime.cpu.weights_first.decide = lambda: True  # as if the CPU had all the room
    _train(engine, data)
    stats = engine.stronghold_runtime.cpu.stats
    assert stats.deferred_blocks > 0 and stats.weights_first_blocks == 0
    accumulating = _engine(model, clip=1e-4, gas=2)
    accumulating.stronghold_runtime.cpu.weights_first.decide = lambda: True
    _train(accumulating, batches(6))
    assert accumulating.stronghold_runtime.cpu.stats.weights_first_blocks > 0


def test_auto_previews_the_window_sums_of_gpu_accumulation():
    """With accumulation on the GPU the update reads the window's sum, sent down once per step: its buffer is next
    written at the next boundary, so "auto" previews there too, and the result is the one-pass update's."""
    model, data = tiny_llama(4), batches(6)
    runs = {}
    for previews in (True, False):
        engine = _engine(model, clip=1e-4, gas=2, gpu_accumulation=True)
        engine.stronghold_runtime.cpu.weights_first.decide = lambda previews=previews: previews
        _train(engine, data)
        runs[previews] = engine
    stats = runs[True].stronghold_runtime.cpu.stats
    assert stats.weights_first_blocks == stats.deferred_blocks > 0
    assert runs[False].stronghold_runtime.cpu.stats.weights_first_blocks == 0
    _assert_identical(runs[True], runs[False])


def test_an_exception_in_the_backward_after_a_weights_first_step():
    """Backward fails in the micro-step after a weights-first step (its second passes may still be queued): the
    failed micro-step is discarded and training goes on bit-identical to the same run without weights first."""
    from .test_step_state import Boom, _raise_in_backward_of
    model, data = tiny_llama(4), batches(5)
    runs = []
    for forced in (True, False):
        engine = _engine(model, clip=1e-4, gas=2, weights_first=forced)
        for batch in data[:2]:  # no synchronize_host: the step's second passes may still be queued
            engine.backward(engine(**batch).loss)
            engine.step()
        handle = _raise_in_backward_of(engine.module.model.layers[2])
        with pytest.raises(Boom):
            engine.backward(engine(**data[2]).loss)
        handle.remove()
        _train(engine, data[3:])
        runs.append(engine)
    assert runs[0].stronghold_runtime.cpu.stats.weights_first_blocks > 0
    _assert_identical(*runs)


def test_a_checkpoint_saved_right_after_a_weights_first_step(tmp_path):
    """save_checkpoint straight after step() (second passes possibly queued) writes the finished state: loaded into
    a fresh engine and trained on, it ends bit-identical to the run that never stopped."""
    model, data = tiny_llama(4), batches(6)
    saved = _engine(model, clip=1e-4, gas=2, weights_first=True)
    for batch in data[:4]:
        saved.backward(saved(**batch).loss)
        saved.step()
    saved.save_checkpoint(str(tmp_path))
    assert saved.stronghold_runtime.cpu.stats.weights_first_blocks > 0
    resumed = _engine(model, clip=1e-4, gas=2, weights_first=True)
    resumed.load_checkpoint(str(tmp_path))
    _train(resumed, data[4:])
    whole = _engine(model, clip=1e-4, gas=2, weights_first=False)
    _train(whole, data)
    _assert_identical(resumed, whole)


@pytest.mark.parametrize("gas", [2, 3, 4])
def test_two_micro_steps_summed_in_one_pass_are_bit_identical(gas):
    """Host accumulation parks every other micro-step's gradients and adds two micro-steps' in one pass
    (cpu_optim._accumulate, csrc/adamw.c accumulate_chunk): the same fp32 additions in the same order as one pass a
    micro-step, which a run without the spare buffers makes. Clipping off: the sums of squares, reduced in another
    vector order, may differ in their last bits, and with clipping on they would set the clip coefficient."""
    model, data = tiny_llama(4), batches(2 * gas)
    paired, single = _engine(model, gas=gas, clip=0.0), _engine(model, gas=gas, clip=0.0)
    for store in single.stronghold_runtime.stores.values():
        store.grad_spare = None
    kernel, pairs = paired.stronghold_runtime.cpu.kernel, []
    one_pass = kernel.accumulate2
    kernel.accumulate2 = lambda *args: pairs.append(1) or one_pass(*args)  # this engine's kernel object only
    _train(paired, data)
    _train(single, data)
    assert len(pairs) >= 2 * 3 * (gas // 2)  # 2 steps, 3 streamed blocks, gas // 2 pairs each (one range a block)
    _assert_identical(paired, single)


def test_the_second_passes_go_in_the_next_backwards_order():
    """The fp32 state after the previews in the order the next backward wants the buffers back: the output part (the
    LM head, whose gradients come first) first, then the last block first, the input part last."""
    model, data = tiny_llama(4), batches(4)
    engine = _engine(model, gas=2, clip=1e-4, weights_first=True, rest_placement="host")
    cpu = engine.stronghold_runtime.cpu
    order, final_job = [], cpu._final_job

    def noting(record, final, clip_coef, redo, weights_written=False):
        if weights_written:
            order.append(record.store.index)
        return final_job(record, final, clip_coef, redo, weights_written)

    cpu._final_job = noting
    _train(engine, data)
    streamed = [i for i in range(len(engine.stronghold_runtime.blocks)) if i in engine.stronghold_runtime.stores]
    expected = [-2] + streamed[::-1] + [-1]
    assert sorted(engine.stronghold_runtime.cached_parts) == ["input", "output"]
    assert order, "clipping every step defers every update: weights first splits them"
    assert len(order) % len(expected) == 0
    assert order == expected * (len(order) // len(expected))


def test_a_micro_steps_sum_overtakes_the_backlog_only_with_its_own_update_done():
    """A non-boundary micro-step's sum runs before other blocks' queued updates (urgent) where no job of its own
    block's fp32 state is queued or running (`_state_idle`): after a drain, every one; while a state job of the block
    holds the worker, not that block's. Bit-identical to the run without the drain."""
    model, data = tiny_llama(4), batches(8)
    drained, plain = (_engine(model, gas=4, clip=1e-4, weights_first=True, rest_placement="host") for _ in range(2))
    cpu = drained.stronghold_runtime.cpu
    flags, pending, submit, submit_grads = [], [], cpu._submit, cpu.submit_grads

    def noting_submit(job, urgent=False):
        if pending:  # the job a non-boundary submit_grads queues: its sum
            flags.append((pending.pop(), urgent))
        return submit(job, urgent)

    def noting_grads(store, present, landed, boundary, *args, **kwargs):
        if not boundary:
            pending.append(store.index)
        return submit_grads(store, present, landed, boundary, *args, **kwargs)

    cpu._submit, cpu.submit_grads = noting_submit, noting_grads
    for i, batch in enumerate(data):
        drained.backward(drained(**batch).loss)
        drained.step()
        if i % 4 == 3:
            drained.synchronize_host()  # the step's deferred updates done before the next window's sums
    _train(plain, data)
    _assert_identical(drained, plain)
    assert flags and all(flag for _, flag in flags), flags
    assert -2 in {index for index, _ in flags}, "the cached head's sums are among them"

    store = next(iter(drained.stronghold_runtime.stores.values()))
    release = threading.Event()
    cpu._submit_for(store, lambda: release.wait(60))
    assert not cpu._state_idle(store)
    release.set()
    drained.synchronize_host()
    assert cpu._state_idle(store)
