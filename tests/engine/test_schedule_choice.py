"""The blockwise backward's "auto" (planning/schedule_choice.py, placement.py, relayout.backward_block_by_block): the
plan after the first step takes it where host accumulation's floor is at least MARGIN times the blockwise floor; a
runtime built with host accumulation moves to it between steps and trains exactly as one built with it (bit for bit
without clipping, as the blockwise backward matches host accumulation)."""
import dataclasses

import pytest
import torch

from stronghold.planning import plan_blockwise, planner, schedule_choice
from stronghold.planning.planner import Activations, BlockSpec, Budgets, ModelSpec, PartSpec, Rates

from .helpers import batches, engine_for, named_params, on_device, run_steps, tiny_gpt2, tiny_llama

N = 1_000_000
BUDGETS = Budgets(gpu_bytes=2 ** 40, host_bytes=2 ** 40, gpu_margin_bytes=0, host_margin_bytes=0)
NONE = Activations(fixed_peak_bytes=0, per_block_bytes=0)
# The GPU is fast and the CPU slow: host accumulation's passes over every micro-step's gradients bound its step.
HOST_BOUND = Rates(h2d_bytes_per_s=5e10, d2h_bytes_per_s=5e10, cpu_adam_params_per_s=2e7, gpu_s_per_block=0.001,
                   gpu_s_fixed=0.001)
# The GPU bounds both schedules.
GPU_BOUND = dataclasses.replace(HOST_BOUND, cpu_adam_params_per_s=1e11, gpu_s_per_block=0.05)


def spec(passes=8):
    parts = (PartSpec(name="input", numel=N, trainable_numel=N),
             PartSpec(name="output", numel=N, trainable_numel=N, before_blocks=False))
    return ModelSpec(blocks=(BlockSpec(numel=N, trainable_numel=N),) * 8, rest_numel=2 * N, rest_trainable_numel=2 * N,
                     compute_bytes=2, accumulation_steps=passes, rest_parts=parts)


def _weigh(rates, **fixed):
    model = spec()
    args = dict(window_size=4, gpu_accumulation=False, **fixed)
    host = planner.plan(model, NONE, BUDGETS, rates, resident_blocks=2, **args)
    return host, schedule_choice.weigh(model, BUDGETS, rates, host, NONE, 4096, True, args, None, 2)


def test_host_bound_takes_the_blockwise_plan_and_gpu_bound_keeps_host_accumulation():
    host, (plan, _, weighed) = _weigh(HOST_BOUND)
    terms, _, _ = plan_blockwise.floor_terms(spec(), HOST_BOUND, plan.resident_blocks, plan.window_size,
                                             plan.cached_parts, schedule_choice.kept_bytes(spec(), 4096, True))
    assert weighed.blockwise and plan.blockwise_backward and not host.blockwise_backward
    assert weighed.host_accumulation_s == host.floor.step_s >= schedule_choice.MARGIN * terms.step_s
    assert weighed.blockwise_s == terms.step_s and plan.resident_blocks >= 2
    assert plan.floor == terms and plan.predicted_step_s == terms.step_s  # its own schedule's floor, not the planner's
    host, (plan, _, weighed) = _weigh(GPU_BOUND)
    assert not weighed.blockwise and plan is host and weighed.blockwise_s is not None
    assert weighed.host_accumulation_s < schedule_choice.MARGIN * weighed.blockwise_s


def test_the_margin_decides_between_floors_closer_than_it(monkeypatch):
    _, (_, _, weighed) = _weigh(HOST_BOUND)
    ratio = weighed.host_accumulation_s / weighed.blockwise_s
    monkeypatch.setattr(schedule_choice, "MARGIN", ratio * 1.01)
    assert not _weigh(HOST_BOUND)[1][2].blockwise
    monkeypatch.setattr(schedule_choice, "MARGIN", ratio * 0.99)
    assert _weigh(HOST_BOUND)[1][2].blockwise


def test_gpu_accumulation_plans_are_kept_and_a_blockwise_plan_that_does_not_fit_is_not_taken():
    model = spec()
    host = planner.plan(model, NONE, BUDGETS, HOST_BOUND, resident_blocks=2, window_size=4, gpu_accumulation=True)
    plan, acts, weighed = schedule_choice.weigh(model, BUDGETS, HOST_BOUND, host, NONE, 4096, True,
                                                dict(window_size=4), None, 2)
    assert plan is host and acts is NONE and weighed.blockwise_s is None
    # The walk's transients do not fit beside the placement host accumulation runs in.
    huge = 2 ** 38
    host = planner.plan(model, NONE, BUDGETS, HOST_BOUND, resident_blocks=2, window_size=4, gpu_accumulation=False)
    tight = dataclasses.replace(BUDGETS, gpu_bytes=host.gpu.needed + 1)
    plan, _, weighed = schedule_choice.weigh(model, tight, HOST_BOUND, host, NONE, huge, True,
                                             dict(window_size=4, gpu_accumulation=False), 2, 2)
    assert plan is host and weighed.blockwise_s is None and not weighed.blockwise
    # Nor where the kept inputs' host slots leave the blockwise stores no room.
    blockwise = planner.plan(model, NONE, BUDGETS, HOST_BOUND, resident_blocks=2, window_size=4, blockwise=True)
    kept = schedule_choice.kept_bytes(model, 4096, True)
    for room, taken in ((kept, True), (kept - 1, False)):
        host_tight = dataclasses.replace(BUDGETS, host_bytes=blockwise.host.needed + room)
        plan, _, weighed = schedule_choice.weigh(model, host_tight, HOST_BOUND, host, NONE, 4096, True,
                                                 dict(window_size=4, gpu_accumulation=False), 2, 2)
        assert weighed.blockwise is taken and (weighed.blockwise_s is not None) is taken
        assert plan.host_budget_bytes == host_tight.host_bytes if taken else plan is host


def test_the_kept_inputs_count_on_the_gpu_only_as_the_walk_holds_them_on_the_host():
    from stronghold.planning.plan_types import FP32_BYTES, KEPT_PENDING, STREAMED_GRADS_IN_FLIGHT
    model, measured = spec(passes=4), Activations(fixed_peak_bytes=10_000, per_block_bytes=0)
    on_host = schedule_choice.blockwise_activations(measured, model, 64, frozenset(), True)
    on_gpu = schedule_choice.blockwise_activations(measured, model, 64, frozenset(), False)
    walk = N * (FP32_BYTES - 2) * STREAMED_GRADS_IN_FLIGHT
    # On the host: the measured micro-batch's 8 checkpointed inputs come off; the first block's of each micro-batch,
    # two blocks' in the walk and those in flight go on.
    assert on_host.per_block_bytes == 0
    assert on_host.fixed_peak_bytes == 10_000 - 8 * 64 + walk + 64 * (3 * 4 + KEPT_PENDING)
    assert (on_gpu.per_block_bytes, on_gpu.fixed_peak_bytes) == (64 * 4, 10_000 + walk)
    assert schedule_choice.kept_bytes(model, 64, True) == 7 * 4 * 64
    assert schedule_choice.kept_bytes(model, 64, False) == 0


@pytest.mark.parametrize("bf16,pooled", [(False, False), (True, False), (True, True)])
def test_a_runtime_moved_to_the_blockwise_backward_trains_as_host_accumulation(bf16, pooled):
    """Host accumulation for a step, the blockwise backward after it: bit for bit host accumulation's masters (no
    clipping), the accumulators now the fp32 gradient buffers (pooled landing buffers let go) and one fp32 D2H a block
    a step."""
    from stronghold.streaming.cached import INDEX_OF
    model, data = tiny_llama(4), batches(12)
    pooling = dict(pooled_grads=True, gradient_spares=False) if pooled else {}
    runs = {}
    for move in (False, True):
        engine = engine_for(model, lr=3e-3, gas=4, bf16=bf16, rest_placement="host", **pooling)
        runtime = engine.stronghold_runtime
        assert runtime.pooled_grads is pooled
        run_steps(engine, data[:4])
        if move:
            runtime.backward_block_by_block()
            assert runtime.pooled_grads is False
            for store in runtime.stores.values():
                assert store.accum is None and store.grad_spare is None and store.pool is None
                assert store.grad.dtype == torch.float32 and store.grad.numel() == store.trainable_numel
        runtime.transfers.d2h_bytes = 0
        run_steps(engine, data[4:])
        # Two steps of four micro-batches. Host accumulation: every gradient down every micro-step in the compute
        # dtype. Blockwise: the streamed blocks' once a step in fp32, the input table's as the fp32 rows of the
        # window's tokens with their int64 ids (embedding_rows.py); the head's as before.
        units = {name: runtime.cached.units[INDEX_OF[name]].store.trainable_numel for name in ("input", "output")}
        streamed = sum(s.trainable_numel for s in runtime.stores.values())
        cb = 2 if bf16 else 4
        head = 2 * 4 * units["output"] * cb
        if move:
            row = 4 * model.config.hidden_size + 8
            rows = runtime.transfers.d2h_bytes - head - 2 * 4 * streamed
            assert rows % row == 0 and 0 < rows // row <= 2 * model.config.vocab_size
        else:
            assert runtime.transfers.d2h_bytes == head + 2 * 4 * (streamed + units["input"]) * cb
        if move:
            assert engine.stronghold_report()["blockwise_backward"] is True and runtime.blockwise.walks == 2
        runs[move] = named_params(engine.module)
    for name in runs[False]:
        assert torch.equal(runs[False][name], runs[True][name]), name


def test_only_between_steps_and_what_rules_it_out_is_seen():
    from stronghold.engine.layout_rules import blockwise_possible
    engine = engine_for(tiny_llama(4), lr=3e-3, gas=4)
    runtime = engine.stronghold_runtime
    settings = runtime.settings
    assert blockwise_possible(settings, runtime, 4)
    assert not blockwise_possible(settings, runtime, 1)
    loss = engine(**on_device(engine, batches(1))[0]).loss
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="between optimizer steps"):
        runtime.backward_block_by_block()
    engine.step()
    # GPT-2's head is tied to its input embedding: in the cached tier its gradient would arrive outside the walk.
    tied = engine_for(tiny_gpt2(2), lr=3e-3, gas=2, rest_placement="host").stronghold_runtime
    assert "input" in tied.cached_parts and not blockwise_possible(tied.settings, tied, 2)
    untied_on_gpu = engine_for(tiny_gpt2(2), lr=3e-3, gas=2).stronghold_runtime
    assert blockwise_possible(untied_on_gpu.settings, untied_on_gpu, 2)


@pytest.mark.gpu
def test_on_cuda_auto_moves_after_the_first_step_and_trains_as_host_accumulation(monkeypatch):
    """The window left to stronghold, so the placement plans again after the first step; with the margin at 0 every
    blockwise plan that fits wins, and the run ends bit for bit as host accumulation's (bf16, no clipping)."""
    monkeypatch.setattr(schedule_choice, "MARGIN", 0.0)
    model, data = tiny_llama(4), batches(12)
    runs = {}
    for setting in ("auto", False):
        # GPU accumulation off: the tiny model's fp32 sums would fit on the GPU, and that plan is kept.
        engine = engine_for(model, lr=3e-3, gas=4, bf16=True, window="auto", resident=1, compile=False,
                            gpu_accumulation=False, blockwise_backward=setting)
        run_steps(engine, data)
        report = engine.stronghold_report()
        assert report["blockwise_backward"] is (setting == "auto")
        if setting == "auto":
            assert report["placement"]["measured"]["schedules"]["blockwise"] is True
            assert report["placement"]["plan"]["blockwise_backward"] is True
            # The switch's wait for the first step's CPU work is timed apart from the switch.
            parts = report["placement"]["measured"]["placement_parts_s"]
            assert {"cpu_wait_s", "blockwise_s", "relayout_s"} <= parts.keys()
            assert engine.stronghold_runtime.blockwise.walks == 2
        runs[setting] = named_params(engine.module)
        engine.destroy()
    for name in runs[False]:
        assert torch.equal(runs[False][name], runs["auto"][name]), name
