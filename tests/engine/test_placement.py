"""Automatic placement on the CPU: the planner's inputs from a live model, the construction-time plan
on synthetic budgets, and `runtime.promote` (streamed blocks made resident between steps) against
plain PyTorch. The measured first step and the promotion it triggers need a GPU (test_gpu.py).

fp32 tolerance as in test_equivalence.py (1e-5 whole-model relative): a promoted block's master,
moments and step counter move to the device unchanged, so what remains is the rounding difference
between the C kernel and torch's AdamW, as in every equivalence test.
"""
import time
from typing import Optional

import pytest
import torch

from stronghold.planning import initial_plan, placement

from stronghold.planning import plan_inputs

from stronghold.planning import planner
from stronghold.config import parse_stronghold_section, resolve
from stronghold.integrations.discovery import find_blocks

from .helpers import batches, ds_config, relative_error, run_steps, tiny_gpt2, tiny_llama, train_reference

TOL = 1e-5
LR = 3e-3
GIB = planner.GIB


def _engine(model, config):
    import stronghold
    engine, _, _, _ = stronghold.initialize(model=model, config=config)
    return engine


@pytest.mark.parametrize("gas,clip", [(1, 0.0), (2, 0.5)])
def test_promotion_between_steps_matches_pytorch(gas, clip):
    """Blocks 1 and 2 become resident after two optimizer steps, with clipping that triggers."""
    model, data = tiny_gpt2(4), batches(8)
    reference, _ = train_reference(model, data, lr=LR, gas=gas, clip=clip)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR, gas=gas, clip=clip))
    runtime = engine.stronghold_runtime
    run_steps(engine, data[:4])
    parts = runtime.promote(3, 2)
    assert runtime.resident_count == 3 and sorted(runtime.stores) == [3] and runtime.window_size == 1
    assert list(parts) == ["settle_s", "move_s", "release_s", "window_s"] and min(parts.values()) >= 0
    run_steps(engine, data[4:])
    assert relative_error(engine.module, reference) <= TOL


@pytest.mark.parametrize("gas", [1, 2])
def test_promoted_blocks_host_buffers_go_back_on_the_releasers_thread(gas):
    """A promoted block's host buffers are dropped on the releaser's thread (release.py), not in the promotion: each
    store's master, moments, working copy and gradient buffer is freed there, and the host meter's live bytes fall by
    what they held once the releaser has drained."""
    import threading
    import weakref

    model, data = tiny_llama(4), batches(4)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR, gas=gas))
    runtime = engine.stronghold_runtime
    run_steps(engine, data[:2 * gas])
    freed: dict[tuple[int, str], str] = {}
    held: dict[int, int] = {}  # by data pointer: in fp32 the master is the working copy
    for index in (1, 2):
        store = runtime.stores[index]
        for name in ("master", "exp_avg", "exp_avg_sq", "working", "grad"):
            storage = getattr(store, name).untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()
            weakref.finalize(storage, lambda key=(index, name): freed.setdefault(key, threading.current_thread().name))
        del store, storage
    live = runtime.host_bytes.live
    runtime.promote(3, 2)
    runtime.releaser.drain()
    assert sorted(freed) == sorted((i, n) for i in (1, 2) for n in ("master", "exp_avg", "exp_avg_sq", "working", "grad"))
    assert set(freed.values()) == {"stronghold-host-release"}
    assert live - runtime.host_bytes.live >= sum(held.values())
    engine.destroy()
    assert runtime.releaser._thread is None


@pytest.mark.parametrize("gas,clip", [(1, 0.5), (2, 0.0)])
def test_promotion_waits_only_for_the_promoted_blocks_updates(gas, clip):
    """Right after a step the CPU still runs its updates. Promotion waits for the promoted blocks' own updates only:
    with a job that blocks the worker queued behind all of them it returns (a full drain would raise at the stall
    timeout), the later blocks' updates run once the job lets go, and training stays exact."""
    import threading

    model, data = tiny_llama(4), batches(8)
    reference, _ = train_reference(model, data, lr=LR, gas=gas, clip=clip)
    engine = _engine(model, ds_config(window=2, resident=0, lr=LR, gas=gas, clip=clip, stall_timeout_s=30.0))
    runtime = engine.stronghold_runtime
    run_steps(engine, data[:4])
    for index, batch in enumerate(data[4:4 + gas]):  # one more step, its updates left queued
        engine.backward(engine(**batch).loss)
        engine.step()
    gate = threading.Event()
    runtime.cpu.submit_after(lambda: gate.wait(60))
    runtime.promote(2, 2)
    assert not gate.is_set() and runtime.resident_count == 2 and sorted(runtime.stores) == [2, 3]
    gate.set()
    run_steps(engine, data[4 + gas:])
    assert relative_error(engine.module, reference) <= TOL


def test_promoting_every_block_stops_streaming_and_stays_exact():
    model, data = tiny_llama(4, tie=True, qwen2=True), batches(6)
    reference, _ = train_reference(model, data, lr=LR, clip=0.5)
    engine = _engine(model, ds_config(window=2, resident=0, lr=LR, clip=0.5))
    runtime = engine.stronghold_runtime
    run_steps(engine, data[:3])
    runtime.promote(4, 2)
    assert runtime.window is None and runtime.cpu is None and not runtime.stores and not runtime.hooks.handles
    run_steps(engine, data[3:])
    assert relative_error(engine.module, reference) <= TOL


def test_promoted_frozen_parameter_stays_frozen():
    model, data = tiny_gpt2(4), batches(4)
    model.transformer.h[1].ln_1.weight.requires_grad_(False)
    frozen = model.transformer.h[1].ln_1.weight.detach().clone()
    reference, _ = train_reference(model, data, lr=LR)
    engine = _engine(model, ds_config(window=2, resident=0, lr=LR))
    run_steps(engine, data[:2])
    engine.stronghold_runtime.promote(2, 2)
    run_steps(engine, data[2:])
    assert torch.equal(engine.module.transformer.h[1].ln_1.weight.detach().cpu(), frozen)
    assert relative_error(engine.module, reference) <= TOL


def test_checkpoint_after_promotion_loads_into_the_original_placement(tmp_path):
    model, data = tiny_gpt2(4), batches(6)
    reference, _ = train_reference(model, data, lr=LR, clip=0.5)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR, clip=0.5))
    run_steps(engine, data[:2])
    engine.stronghold_runtime.promote(2, 2)
    run_steps(engine, data[2:4])
    engine.save_checkpoint(tmp_path, tag="t")
    resumed = _engine(tiny_gpt2(4, seed=5), ds_config(window=2, resident=1, lr=LR, clip=0.5))
    resumed.load_checkpoint(tmp_path, tag="t")
    run_steps(resumed, data[4:])
    assert relative_error(resumed.module, reference) <= TOL


def test_promotion_only_between_steps_and_only_upwards():
    model, data = tiny_gpt2(4), batches(2)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR))
    runtime = engine.stronghold_runtime
    with pytest.raises(ValueError, match="can only grow"):
        runtime.promote(0, 2)

    def promote_mid_step(engine, i):
        with pytest.raises(RuntimeError, match="between optimizer steps"):
            engine.stronghold_runtime.promote(2, 2)

    run_steps(engine, data, before_step=promote_mid_step)
    assert runtime.resident_count == 1


def test_auto_on_cpu_streams_all_but_one_block_without_warning(recwarn):
    engine = _engine(tiny_gpt2(4), {**ds_config(lr=LR), "stronghold": {"kernels": False}})
    runtime = engine.stronghold_runtime
    assert (runtime.resident_count, runtime.window_size) == (1, 3)
    assert runtime.placement is None  # nothing to measure on a CPU
    assert not [w for w in recwarn if "window_size" in str(w.message)]


# The planner's inputs and the construction-time plan ------------------------------------------
def test_model_spec_counts_tied_weights_once_and_frozen_ones_as_untrainable():
    model = tiny_gpt2(4)
    model.transformer.h[2].mlp.c_fc.weight.requires_grad_(False)
    parts = find_blocks(model, None, None)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    spec = plan_inputs.model_spec(model, parts, trainable, torch.bfloat16, 3)
    block_numel = sum(p.numel() for p in model.transformer.h[0].parameters())
    assert [b.numel for b in spec.blocks] == [block_numel] * 4
    frozen = model.transformer.h[2].mlp.c_fc.weight.numel()
    assert [b.trainable_numel for b in spec.blocks] == [block_numel] * 2 + [block_numel - frozen, block_numel]
    unique = {id(p): p.numel() for p in model.parameters()}  # wte and lm_head are one tensor
    assert spec.rest_numel == sum(unique.values()) - 4 * block_numel == spec.rest_trainable_numel
    assert (spec.compute_bytes, spec.accumulation_steps) == (2, 3)


def _spec(blocks: int = 8, numel: int = 100 * 2 ** 20) -> planner.ModelSpec:
    return planner.ModelSpec(blocks=tuple(planner.BlockSpec(numel=numel, trainable_numel=numel) for _ in range(blocks)),
                             rest_numel=numel, rest_trainable_numel=numel, compute_bytes=2)


def _config(**section):
    return parse_stronghold_section({"stronghold": section})


def _settings(**section):
    return resolve(_config(**section), torch.device("cuda"))


def test_initial_plan_holds_half_the_gpu_back_for_the_first_step():
    spec, budget = _spec(), planner.Budgets(gpu_bytes=20 * GIB, host_bytes=200 * GIB)
    plan = initial_plan.initial_plan(spec, budget, _settings())
    assert plan.gpu.activations == 10 * GIB and plan.window_size == initial_plan.FIRST_WINDOW
    # 1.6 GiB per resident block (16 bytes per parameter): 3 fit beside the reserve, not 4.
    assert plan.resident_blocks == 3
    assert plan.gpu.needed <= budget.gpu_bytes


def test_initial_plan_shrinks_the_reserve_until_the_host_holds_the_streamed_blocks():
    spec = _spec()
    # Each streamed block needs 100 Mi x 16 bytes = 1.56 GiB of host (fp32 master 4, moments 8, bf16
    # working copy 2, bf16 gradient 2), plus the 4 GiB minimum margin. With half the GPU reserved only
    # 3 blocks are resident: 5 streamed need 11.8 GiB, over 9. With 40% (the next reserve tried) 5 are,
    # and 3 streamed need 8.69.
    budget = planner.Budgets(gpu_bytes=20 * GIB, host_bytes=9 * GIB)
    plan = initial_plan.initial_plan(spec, budget, _settings())
    assert plan.gpu.activations == int(0.4 * 20 * GIB) and plan.resident_blocks == 5 and plan.lean_blocks == 0
    assert plan.host.needed <= budget.host_bytes and plan.gpu.needed <= budget.gpu_bytes
    with pytest.raises(MemoryError, match="host memory"):
        initial_plan.initial_plan(spec, planner.Budgets(gpu_bytes=8 * GIB, host_bytes=8 * GIB), _settings())


def test_initial_plan_uses_lean_blocks_only_when_no_reserve_fits_without():
    """An 8 GiB GPU holds 2 resident blocks at the smallest reserve; 6 streamed blocks of 100 Mi need 9.38
    GiB of host with their gradient buffers, each lean block 0.195 GiB less, plus the 4 GiB margin:
    13.5 GiB of host fits with no lean block (13.375 needed); 13 needs 2 (13.18 with one, 12.98 with two);
    and "lean_blocks": 0 turns the tier off."""
    spec, gpu = _spec(), 8 * GIB
    roomy = initial_plan.initial_plan(spec, planner.Budgets(gpu_bytes=gpu, host_bytes=int(13.5 * GIB)), _settings())
    assert (roomy.resident_blocks, roomy.lean_blocks) == (2, 0)
    tight = initial_plan.initial_plan(spec, planner.Budgets(gpu_bytes=gpu, host_bytes=13 * GIB), _settings())
    assert (tight.resident_blocks, tight.lean_blocks) == (2, 2) and tight.host.needed <= 13 * GIB
    with pytest.raises(MemoryError, match="host memory"):
        initial_plan.initial_plan(spec, planner.Budgets(gpu_bytes=gpu, host_bytes=13 * GIB), _settings(lean_blocks=0))


def test_numbers_in_the_config_are_kept_and_checked():
    spec, budget = _spec(), planner.Budgets(gpu_bytes=20 * GIB, host_bytes=200 * GIB)
    plan = initial_plan.initial_plan(spec, budget, _settings(resident_blocks=6, window_size=2))
    assert (plan.resident_blocks, plan.window_size) == (6, 2) and plan.gpu.activations == 0
    # All 8 blocks and the rest resident: 9 x 1.56 GiB = 14 GiB, more than a 10 GiB card.
    with pytest.raises(MemoryError, match="resident_blocks=8 needs 1[45].* lower \"resident_blocks\""):
        initial_plan.initial_plan(spec, planner.Budgets(gpu_bytes=10 * GIB, host_bytes=200 * GIB),
                               _settings(resident_blocks=12))


def test_auto_and_numbers_in_the_config():
    assert (_config().resident_blocks, _config().window_size) == ("auto", "auto")
    assert _config(resident_blocks=3).resident_blocks == 3
    with pytest.raises(ValueError, match=r"stronghold.resident_blocks: should be 'auto' or greater than or equal to 0"):
        _config(resident_blocks=-1)
    with pytest.raises(ValueError, match=r"stronghold.window_size: should be 'auto' or greater than or equal to 2"):
        _config(window_size=1)


def test_a_report_during_the_first_step_leaves_the_measurements_alone():
    """The main job logs `stronghold_report()` every step; what the report's reader adds to its
    "measured" part must not reach the placement's own record, which after_step re-plans from."""
    spec, budget = _spec(), planner.Budgets(gpu_bytes=20 * GIB, host_bytes=200 * GIB)
    settings = _settings()
    placed = placement.Placement(runtime=None, spec=spec, budget=budget, settings=settings,
                                 plan=initial_plan.initial_plan(spec, budget, settings))
    placed.report()["measured"]["gpu_peak_allocated_bytes_now"] = 1
    assert placed.measured == {}


@pytest.mark.parametrize("gas", [2, 3])
def test_without_spare_gradient_buffers_accumulation_stays_exact(gas):
    """"gradient_spares": false (what "auto" picks where host memory is short): every micro-step's gradients are
    added as they land, in one buffer a block; the sums, and so training, are those of torch's AdamW."""
    model, data = tiny_llama(4), batches(3 * gas)
    reference, _ = train_reference(model, data, lr=LR, gas=gas, clip=0.5)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR, gas=gas, clip=0.5, gradient_spares=False))
    runtime = engine.stronghold_runtime
    assert runtime.stores and all(s.grad_spare is None and s.accum is not None for s in runtime.stores.values())
    run_steps(engine, data)
    assert relative_error(engine.module, reference) <= TOL
    spared = _engine(tiny_llama(4), ds_config(window=2, resident=1, lr=LR, gas=gas))
    assert all(s.grad_spare is not None for s in spared.stronghold_runtime.stores.values())


def _first_forward_rank(rank: int, out: str, port: int) -> None:
    """One of two gloo ranks: the first-forward target for each case, this rank's plan given as (resident, window) or
    None (no plan: the estimate left less room than the reserve)."""
    import os
    from types import SimpleNamespace

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.distributed.init_process_group("gloo")
    cases = [({0: (6, 1), 1: None}, (2, 4)), ({0: (6, 3), 1: (5, 2)}, (2, 4)), ({0: (1, 2), 1: (7, 3)}, (2, 4))]
    results = []
    for plans, (resident, window) in cases:
        mine = plans[rank]
        plan = None if mine is None else SimpleNamespace(resident_blocks=mine[0], window_size=mine[1])
        results.append(initial_plan.first_forward_target(plan, resident, window, data_parallel=True))
    results.append(sorted(initial_plan.agree_cached(frozenset({"input"} if rank == 0 else {"output"}))))
    results.append(sorted(initial_plan.agree_cached(frozenset())))
    torch.distributed.destroy_process_group()
    torch.save(results, f"{out}/rank{rank}.pt")


def test_first_forward_target_alone_and_agreed_by_data_parallel_ranks(tmp_path):
    """One process takes its plan where it promotes and keeps its placement otherwise. Data-parallel ranks each
    propose that, and all take the fewest resident blocks, with a rank that has no plan (or one that would not
    promote) holding the present placement: every rank runs the collective whatever it planned. The parts outside
    the blocks that any rank planned cached are cached on every rank."""
    from types import SimpleNamespace

    from .helpers import spawn_ranks

    target = initial_plan.first_forward_target
    assert target(SimpleNamespace(resident_blocks=6, window_size=1), 2, 4, data_parallel=False) == (6, 2)
    assert target(SimpleNamespace(resident_blocks=1, window_size=3), 2, 4, data_parallel=False) == (2, 4)
    assert target(None, 2, 4, data_parallel=False) == (2, 4)
    spawn_ranks(_first_forward_rank, (str(tmp_path),), nprocs=2, timeout_s=120)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert ranks[0] == ranks[1] == [(2, 4), (5, 2), (2, 4), ["input", "output"], []], "cached parts: any rank's"


def test_a_failing_hand_over_is_reported_and_never_blocks_the_drain():
    """What the releaser runs after dropping a hand-over may fail (an allocator call): the drain still returns, the
    next hand-over still goes, and the reason is kept for the engine's report."""
    import threading
    import weakref

    from stronghold.streaming.release import HostReleaser

    def fail():
        raise RuntimeError("no host cache here")

    releaser = HostReleaser(torch.device("cpu"))
    freed: list[str] = []
    held = [torch.zeros(4)]  # the list's is the tensor's only reference, whichever thread lets go of the list first
    weakref.finalize(held[0], lambda: freed.append(threading.current_thread().name))
    releaser.release(held, then=fail)
    del held
    releaser.drain()
    releaser.release([], then=lambda: freed.append("then"))
    releaser.close()
    assert freed == ["stronghold-host-release", "then"]
    assert releaser.errors == ["RuntimeError: no host cache here"]


@pytest.mark.parametrize("configured", [False, True])
def test_a_first_step_over_the_built_placement_runs_on_and_says_what_fits(configured, caplog):
    """The start-up placement kept more resident blocks than the first step's measured activations leave room for
    (they cannot go back to the host): the run goes on as built, and the warning names the residency that fits, or,
    where the config fixed the number, asks to lower it."""
    import dataclasses
    import logging
    from types import SimpleNamespace

    spec, budget = _spec(), planner.Budgets(gpu_bytes=20 * GIB, host_bytes=400 * GIB)
    rates = planner.Rates(h2d_bytes_per_s=5e10, d2h_bytes_per_s=5e10, cpu_adam_params_per_s=1e9,
                          gpu_s_per_block=0.05, gpu_s_fixed=0.0)
    activations = 9 * GIB
    fitting = planner.plan(spec, planner.Activations(fixed_peak_bytes=activations, per_block_bytes=0), budget,
                           rates).resident_blocks
    built = fitting + 2
    with pytest.raises(MemoryError):
        planner.plan(spec, planner.Activations(fixed_peak_bytes=activations, per_block_bytes=0), budget, rates,
                     resident_blocks=built)
    settings = dataclasses.replace(_settings(), resident_blocks=built if configured else None)
    runtime = SimpleNamespace(resident=SimpleNamespace(params=[]), device_accum=None, blockwise=None, activations=None,
                              resident_count=built, window_size=2, stores=dict.fromkeys(range(built, 8)), lean_until=0,
                              nvme_from=8, gradient_spares=True, compact_master=False, pooled_grads=False,
                              data_parallel=None, runs_ahead=False)
    placed = placement.Placement(runtime=runtime, spec=spec, budget=budget, settings=settings,
                                 plan=initial_plan.initial_plan(spec, budget, _settings()))
    placed._rates = lambda: rates
    placed.measured.update(peak_allocated_bytes=activations, peak_reserved_bytes=activations)
    with caplog.at_level(logging.WARNING, logger="stronghold.planning.placement"):
        plan = placed._replan()
    assert plan.resident_blocks == built and plan.gpu.needed > budget.gpu_bytes, "as built, over the budget"
    assert placed.measured["over_budget"] == {"resident_blocks": built,
                                              "resident_blocks_fitting": None if configured else fitting}
    assert f"its {built} resident blocks" in caplog.text
    if configured:
        assert 'lower "resident_blocks"' in caplog.text
    else:
        assert f'"resident_blocks": {fitting} in the stronghold section' in caplog.text


def _first_forward_placement(budget_gib: float, accumulation: int, built: int = 1, **section):
    """A Placement at its first forward on a stand-in runtime: 32 blocks of 25 M parameters, `built` resident."""
    import dataclasses
    from types import SimpleNamespace
    spec = dataclasses.replace(_spec(blocks=32, numel=25 * 2 ** 20), accumulation_steps=accumulation)
    budget = planner.Budgets(gpu_bytes=int(budget_gib * GIB), host_bytes=400 * GIB)
    runtime = SimpleNamespace(resident_count=built, lean_until=0, nvme_from=32, device_accum=None, blockwise=None,
                              gradient_spares=True, compact_master=False, pooled_grads=False, runs_ahead=False)
    return placement.Placement(runtime=runtime, spec=spec, budget=budget, settings=_settings(**section),
                               plan=initial_plan.initial_plan(spec, budget, _settings(**section))), spec, budget


def _most_resident(placed, window: int, activations: int) -> int:
    """The most resident blocks that fit beside `window` slots, planned as the first forward plans."""
    return _plan_as_placed(placed, window, activations).resident_blocks


def _plan_as_placed(placed, window: int, activations: int) -> planner.Plan:
    estimate = planner.Activations(fixed_peak_bytes=activations, per_block_bytes=0)
    return planner.plan(placed.spec, estimate, placed.budget, initial_plan.DEFAULT_RATES, window_size=window,
                        rest_tiers=plan_inputs.built_tiers(placed.spec, placed.initial.cached_parts))


def _reloads(placed, resident: int) -> Optional[int]:
    """Streamed blocks outside the largest window that fits beside `resident` blocks (no activations), the windows
    tried one by one from every streamed block down; None where none fits."""
    blocks = len(placed.spec.blocks)
    for window in range(blocks - resident, 1, -1):
        try:
            planner.plan(placed.spec, planner.Activations(fixed_peak_bytes=0, per_block_bytes=0), placed.budget,
                         initial_plan.DEFAULT_RATES, resident_blocks=resident, window_size=window,
                         rest_tiers=plan_inputs.built_tiers(placed.spec, placed.initial.cached_parts))
        except MemoryError:
            continue
        return blocks - resident - window
    return None


def test_with_accumulation_the_first_forward_leaves_room_for_a_window_of_every_streamed_block():
    """Blocks only move onto the GPU: with gradient accumulation the first forward keeps no more resident blocks
    than a window of every streamed block could leave room for (no activations counted), so the plan after the first
    step can still take that layout (weights once a step); never fewer than were built. Where no such window fits at
    all, the residency whose largest window leaves the fewest streamed blocks out. Without accumulation or with the
    window configured, the most that fit beside the first step's window."""
    estimate = planner.Activations(fixed_peak_bytes=GIB // 4, per_block_bytes=0)
    placed, _, _ = _first_forward_placement(5, accumulation=4)
    beside_first_window = _most_resident(placed, initial_plan.FIRST_WINDOW, GIB // 4)
    beside_all = _most_resident(placed, 32, 0)
    assert 1 < beside_all < beside_first_window, "the case in question"
    plan = placed._first_plan(estimate)
    assert (plan.resident_blocks, plan.window_size) == (beside_all, initial_plan.FIRST_WINDOW)
    built_more, _, _ = _first_forward_placement(5, accumulation=4, built=beside_all + 1)
    assert built_more._first_plan(estimate).resident_blocks == beside_all + 1, "what was built stays, no more"
    one_pass, _, _ = _first_forward_placement(5, accumulation=1)
    assert one_pass._first_plan(estimate).resident_blocks == _most_resident(one_pass, initial_plan.FIRST_WINDOW,
                                                                            GIB // 4)
    configured, _, _ = _first_forward_placement(5, accumulation=4, window_size=4)
    assert configured._first_plan(estimate).resident_blocks == beside_first_window
    small, _, _ = _first_forward_placement(2, accumulation=4, built=0)
    with pytest.raises(MemoryError):
        _plan_as_placed(small, 32, 0)
    assert _most_resident(small, initial_plan.FIRST_WINDOW, GIB // 4) == 1, "the case in question: one fits"
    assert 0 < _reloads(small, 0) < _reloads(small, 1), "no window of every streamed block, fewer reloads at 0"
    assert small._first_plan(estimate).resident_blocks == 0
    small_built, _, _ = _first_forward_placement(2, accumulation=4, built=1)
    assert small_built._first_plan(estimate).resident_blocks == 1, "what was built stays"


BLOCKWISE_ESTIMATE = planner.Activations(fixed_peak_bytes=GIB // 4, per_block_bytes=0)


def _blockwise_first_plan(host_gib: float, block_input_bytes, to_host: bool = True):
    """`_first_plan` of a Placement on a stand-in runtime built with the blockwise backward (32 blocks of 25 M
    parameters, accumulation 4, a 5 GiB GPU, the start-up plan of a 16 GiB host) whose host budget is `host_gib`."""
    import dataclasses
    from types import SimpleNamespace
    spec = dataclasses.replace(_spec(blocks=32, numel=25 * 2 ** 20), accumulation_steps=4)
    settings = _settings(blockwise_backward=True)
    built = initial_plan.initial_plan(spec, planner.Budgets(gpu_bytes=5 * GIB, host_bytes=16 * GIB), settings)
    runtime = SimpleNamespace(resident_count=built.resident_blocks, window_size=built.window_size, lean_until=0,
                              nvme_from=32, device_accum=None,
                              blockwise=SimpleNamespace(kept=SimpleNamespace(to_host=to_host)),
                              gradient_spares=False, compact_master=False, pooled_grads=False, runs_ahead=False)
    budget = planner.Budgets(gpu_bytes=5 * GIB, host_bytes=int(host_gib * GIB))
    placed = placement.Placement(runtime=runtime, spec=spec, budget=budget, settings=settings, plan=built)
    placed._block_input_bytes = block_input_bytes
    return placed._first_plan(BLOCKWISE_ESTIMATE)


@pytest.mark.parametrize("to_host", [True, False])
def test_a_blockwise_runtimes_plans_leave_its_kept_inputs_host_slots_room(to_host):
    """A runtime built with the blockwise backward keeps every block's input of every micro-batch in page-locked host
    slots (engine/kept_inputs.py), which the planner's host stores leave out: its plans take them off the host
    budget, so a tight host promotes more blocks at the first forward (each resident block frees its host stores),
    and the plan reports the whole budget. Kept on the GPU, they take no host memory."""
    unknown, kept = _blockwise_first_plan(16, None, to_host), _blockwise_first_plan(16, 4 * 2 ** 20, to_host)
    slots = 31 * 4 * 4 * 2 ** 20
    assert unknown.host.needed + slots > 16 * GIB, "the case in question: the slots do not fit beside it"
    if to_host:
        assert kept.resident_blocks > unknown.resident_blocks
        assert kept.host.needed + slots <= 16 * GIB
    else:
        assert kept.resident_blocks == unknown.resident_blocks
    assert kept.host_budget_bytes == unknown.host_budget_bytes == 16 * GIB


def test_a_blockwise_runtime_whose_kept_inputs_fit_no_placement_is_warned_of_before_they_are_made(caplog):
    """Forced on, the blockwise backward's kept inputs are sized only at the first forward: where the runtime as built
    fits the host without their slots but no placement fits beside them, the log says so, with the bytes and the fix;
    where the host is short without them too, or they fit, it does not."""
    import logging

    def warned(block_input_bytes, host_gib):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stronghold.planning.placement"):
            plan = _blockwise_first_plan(host_gib, block_input_bytes)
        return plan, caplog.text

    plan, text = warned(16 * 2 ** 20, 16)
    assert plan is None and "keeps 1.94 GiB of block inputs" in text and '"blockwise_backward" to "auto"' in text
    plan, text = warned(4 * 2 ** 20, 16)
    assert plan is not None and not text
    plan, text = warned(16 * 2 ** 20, 8)
    assert plan is None and not text, "short of host without the slots too"


def test_the_cpu_probe_records_each_repeat_beside_the_median_the_plans_take():
    """measure_rates keeps every repeat of the CPU AdamW probe and the host's load in the report
    (`measured["cpu_adam_probe"]`), and the rate the plans take is the repeats' median."""
    import statistics
    from types import SimpleNamespace

    class Steps:
        """A stand-in kernel whose calls take longer each time: the repeats differ."""
        calls = 0

        def step(self, *args):
            Steps.calls += 1
            total = 0
            for i in range(20_000 * Steps.calls):
                total += i

    placed, _, _ = _first_forward_placement(40.0, 1)
    placed.runtime.cpu = SimpleNamespace(kernel=Steps())
    placed.runtime.compute_dtype, placed.runtime.device = torch.bfloat16, torch.device("cpu")
    placed.measure_rates()
    probe = placed.measured["cpu_adam_probe"]
    assert len(probe["params_per_s"]) == 3 and all(rate > 0 for rate in probe["params_per_s"])
    assert placed._cpu_rate == statistics.median(probe["params_per_s"])
    assert probe["process_threads"] >= 1 and probe["process_cpus_busy"] > 0
    assert probe["host_cpus_busy"] >= 0 and isinstance(probe["other_processes"], list), "what else the host ran"
    assert probe["wall_params_per_s"] == probe["params_per_s"], "a kernel without a clock of its own: the wall's"


def test_the_cpu_probe_times_each_repeat_by_the_kernels_own_clock_bounded_by_the_wall():
    """Where the kernel keeps a clock of its own (the native build's time inside its threads), the probe's rates come
    from it, not from the calling thread's wall, which also counts the wait for the GIL after the kernel returns;
    the clock counts every caller in the process, so a repeat never takes less than the wall's rate."""
    from types import SimpleNamespace

    from stronghold.engine.telemetry import cpu_adam_probe

    class Clocked:
        """A stand-in kernel whose calls take a few milliseconds of wall time and `inside` seconds of its clock."""

        def __init__(self, inside: float):
            self.inside, self.total = inside, 0.0

        def kernel_seconds(self):
            return self.total

        def step(self, *args):
            self.total += self.inside
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass

    numel, tick = 2 ** 10, 2.0 ** -20  # a power of two: the clock's differences are exact
    probe = cpu_adam_probe(Clocked(inside=tick), numel=numel, dtype=torch.bfloat16)
    assert probe.kernel == [numel / tick] * 3 and probe.params_per_s == probe.kernel
    assert all(rate < numel / 0.002 for rate in probe.wall), "the wall counts the whole call"
    crowded = cpu_adam_probe(Clocked(inside=10.0), numel=numel, dtype=torch.bfloat16)
    assert crowded.params_per_s == crowded.wall, "another caller's time on the clock is not this call's"

    placed, _, _ = _first_forward_placement(40.0, 1)
    placed.runtime.cpu = SimpleNamespace(kernel=Clocked(inside=tick))
    placed.runtime.compute_dtype, placed.runtime.device = torch.bfloat16, torch.device("cpu")
    placed.measure_rates()
    recorded = placed.measured["cpu_adam_probe"]
    assert placed._cpu_rate == recorded["params_per_s"][1] == 16 * 2 ** 20 / tick
    assert len(recorded["wall_params_per_s"]) == 3 and max(recorded["wall_params_per_s"]) < placed._cpu_rate
