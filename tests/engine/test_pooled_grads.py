"""Pooled gradient landing buffers (streaming/grad_pool.py): with host accumulation the streamed blocks share a few
landing buffers. The sums are the same additions in the same order as with a buffer per block, so training is bit for
bit the run without spares, which matches plain torch AdamW at the equivalence tests' bar. (A backward that fails
mid-way: tests/engine/test_handoff.py.)"""
import copy

import pytest
import torch

import stronghold
from stronghold.config import parse_stronghold_section, resolve
from stronghold.planning.initial_plan import initial_plan
from stronghold.planning.plan_types import GRAD_POOL_BUFFERS
from stronghold.planning.planner import Activations, BlockSpec, Budgets, ModelSpec, Rates, plan

from .helpers import batches, ds_config, relative_error, run_steps, tiny_llama, train_reference

LR = 3e-3
TOL = 1e-5
CLIP = 0.5
BLOCKS = GRAD_POOL_BUFFERS + 3  # more streamed blocks than buffers: each buffer serves several blocks a backward


def _engine(model, **config):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(lr=LR, **config))
    return engine


@pytest.mark.parametrize("bf16", [False, True])
def test_pooled_buffers_train_bit_for_bit_as_a_buffer_per_block(bf16):
    model, data = tiny_llama(BLOCKS), batches(12)
    config = dict(window=2, resident=1, gas=3, clip=CLIP, bf16=bf16, gradient_spares=False)
    pooled = _engine(model, pooled_grads=True, **config)
    run_steps(pooled, data)
    runtime = pooled.stronghold_runtime
    assert all(s.pool is not None and s.grad is None for s in runtime.stores.values()), \
        "every streamed block borrows its buffer, and every buffer is back between steps"
    assert runtime.grad_norm() > CLIP, "the steps clip"
    own = _engine(model, **config)
    run_steps(own, data)
    assert all(torch.equal(p, q) for p, q in zip(pooled.module.parameters(), own.module.parameters()))
    if not bf16:
        reference, _ = train_reference(model, data, lr=LR, gas=3, clip=CLIP)
        assert relative_error(pooled.module, reference) <= TOL


@pytest.mark.parametrize("config, needle", [
    (dict(gas=1, pooled_grads=True), "gradient accumulation"),
    (dict(gas=2, pooled_grads=True, gradient_spares=True), "gradient_spares"),
    (dict(gas=2, pooled_grads=True, gpu_accumulation=True), "gradient accumulation on the host"),
])
def test_pooled_grads_where_they_cannot_be_is_a_value_error(config, needle):
    with pytest.raises(ValueError, match=needle):
        stronghold.initialize(model=tiny_llama(3), config=ds_config(**config))


def test_the_planner_pools_landing_buffers_only_where_nothing_else_fits():
    """Pooled buffers replace the blocks' own landing buffers by GRAD_POOL_BUFFERS of the largest, without spares;
    left to the planner they come only where the full layout does not fit, and never without accumulation."""
    block = BlockSpec(numel=1_000_000, trainable_numel=1_000_000)
    spec = ModelSpec(blocks=(block,) * 10, rest_numel=100_000, rest_trainable_numel=100_000, compute_bytes=2,
                     accumulation_steps=4)
    rates = Rates(h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9, cpu_adam_params_per_s=1e8, gpu_s_per_block=0.002,
                  gpu_s_fixed=0.003)

    def at(host, model=spec, **kwargs):
        budgets = Budgets(gpu_bytes=10 ** 9, host_bytes=host, gpu_margin_bytes=0, host_margin_bytes=0)
        return plan(model, Activations(fixed_peak_bytes=0, per_block_bytes=0), budgets, rates, resident_blocks=2,
                    window_size=2, gradient_spares=False, **kwargs)
    own = at(10 ** 12, pooled_grads=None)
    assert not own.pooled_grads
    pooled = at(own.host.needed - 1, pooled_grads=None)
    assert pooled.pooled_grads and not pooled.gradient_spares
    assert own.host.grads - pooled.host.grads == (8 - GRAD_POOL_BUFFERS) * 1_000_000 * 2
    with pytest.raises(ValueError, match="pooled_grads"):
        at(10 ** 12, model=ModelSpec(blocks=(block,) * 10, rest_numel=1, rest_trainable_numel=1, compute_bytes=2),
           pooled_grads=True)


@pytest.mark.parametrize("bf16", [True, False])
def test_the_start_up_plan_saves_host_memory_in_the_cheapest_order(bf16):
    """As the host budget falls one byte under each start-up plan's need: full masters with spares, then without, then
    compact masters (bf16; with 6 streamed blocks they save more than pooled buffers, which replace 2 of 6 landing
    buffers, so pooled ones alone never come between), then both; in fp16 pooled buffers alone."""
    block = BlockSpec(numel=100 * 2 ** 20, trainable_numel=100 * 2 ** 20)
    spec = ModelSpec(blocks=(block,) * 8, rest_numel=2 ** 20, rest_trainable_numel=2 ** 20, compute_bytes=2,
                     bf16=bf16, accumulation_steps=4)
    settings = resolve(parse_stronghold_section({"stronghold": {}}), torch.device("cuda"))
    seen, host = [], 10 ** 13
    while True:
        try:
            chosen = initial_plan(spec, Budgets(gpu_bytes=8 * 2 ** 30, host_bytes=host, host_margin_bytes=0),
                                  settings)
        except MemoryError as err:
            assert "with pooled gradient buffers" in str(err)
            break
        step = (chosen.gradient_spares, chosen.compact_master, chosen.pooled_grads)
        if not seen or seen[-1] != step:
            seen.append(step)
        host = chosen.host.needed - 1
    assert seen == [(True, False, False), (False, False, False)] + (
        [(False, True, False), (False, True, True)] if bf16 else [(False, False, True)])


@pytest.mark.parametrize("host_gib,savers", [(23, (True, False)), (20, (True, True))])
def test_with_accumulation_the_start_up_plan_builds_no_block_resident_that_shortens_the_window(host_gib, savers):
    """12 blocks of 100 Mi under 5 GiB with accumulation 8. Where the host holds the streamed blocks only beside a
    smaller activation reserve, the most blocks that fit beside it are resident (one); that block's GPU room leaves a
    largest window of 10 slots for the 11 streamed blocks (one copied every micro-step), where none resident leaves 12
    slots for all 12. The start-up plan builds none (blocks only move onto the GPU later), with the host savers that
    needs, later in their order than the one resident block's: compact masters under 23 GiB (where one resident block
    needed none), both under 20 (one resident block, compact masters alone). A configured window keeps the resident
    block."""
    block = BlockSpec(numel=100 * 2 ** 20, trainable_numel=100 * 2 ** 20)
    spec = ModelSpec(blocks=(block,) * 12, rest_numel=2 ** 20, rest_trainable_numel=2 ** 20, compute_bytes=2,
                     bf16=True, accumulation_steps=8)
    budget = Budgets(gpu_bytes=5 * 2 ** 30, host_bytes=host_gib * 2 ** 30, host_margin_bytes=0)

    def start(**section):
        return initial_plan(spec, budget, resolve(parse_stronghold_section({"stronghold": section}),
                                                  torch.device("cuda")))
    chosen = start()
    assert (chosen.resident_blocks, chosen.window_size, chosen.compact_master, chosen.pooled_grads) == (0, 4, *savers)
    assert chosen.host.needed <= budget.host_bytes and chosen.gpu.needed <= budget.gpu_bytes
    assert chosen.gpu.activations >= 0.5 * budget.gpu_bytes
    assert start(window_size=4).resident_blocks == 1
