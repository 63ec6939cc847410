"""Whether the blockwise backward (engine/blockwise.py) takes over from host accumulation after the first step
(`"blockwise_backward": "auto"`, placement.py). Pure.

The plan after the first step is made a second time, with the same measured rates and activations, as the blockwise
backward would run: its GPU transients (activation_estimate.blockwise: the walk's fp32 sums, the kept inputs in
flight), its host stores (plan_bytes: fp32 gradient buffers, no accumulators) and the kept inputs' host slots. Each
plan is weighed by its own schedule's floor (plan_floor.py for host accumulation, plan_blockwise.py), and the blockwise
plan is taken where its floor is at most 1/MARGIN of host accumulation's.

Why a margin: a move is worth it only where the blockwise step is clearly shorter, as it costs a relayout between
steps, and the floors' ratio has overstated the measured steps' ratio somewhat where both were measured at one
placement (docs/results.md, "The blockwise floor against the measured steps"): MARGIN lies above that error and below
the ratio of the shapes where the blockwise backward measured clearly faster.

A plan that sums on the GPU ("gpu_accumulation", every block's fp32 sums resident) is kept: it moves the least.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from stronghold.planning import activation_estimate, plan_blockwise, planner
from stronghold.planning.plan_types import Activations, ModelSpec, Rates

MARGIN = 1.2
"""Host accumulation's floor over the blockwise floor at which the blockwise backward is taken (see above)."""


@dataclasses.dataclass(frozen=True)
class Weighed:
    """What the choice weighed, for the placement's report."""

    host_accumulation_s: float
    blockwise_s: Optional[float]
    """None where no blockwise plan fits."""
    blockwise_window: Optional[int]
    blockwise: bool
    """The blockwise plan was taken."""


def kept_bytes(spec: ModelSpec, block_input_bytes: int, on_host: bool) -> int:
    """The kept inputs a step, each way (engine/kept_inputs.py): every block's but the first's, of every micro-batch;
    0 where they stay on the GPU."""
    return (len(spec.blocks) - 1) * spec.accumulation_steps * block_input_bytes if on_host else 0


def blockwise_activations(measured: Activations, spec: ModelSpec, block_input_bytes: int,
                          cached: frozenset[str], on_host: bool, ahead: bool = False) -> Activations:
    """The activations measured in a step of host accumulation, as the blockwise backward would use the GPU: the
    measured peak plus the walk's transients and the kept inputs on the GPU (activation_estimate.blockwise, with one
    block's input as `block_input_bytes`). The measured peak holds a micro-batch's checkpointed block inputs, which the
    blockwise forward sends to the host where `on_host`: they come off it, and no per-block term goes on top."""
    if not on_host:
        return activation_estimate.blockwise(
            dataclasses.replace(measured, per_block_bytes=block_input_bytes), spec, cached, False, ahead)
    fixed = max(0, measured.fixed_peak_bytes - len(spec.blocks) * block_input_bytes)
    estimate = activation_estimate.blockwise(
        Activations(fixed_peak_bytes=fixed, per_block_bytes=block_input_bytes,
                    allocator_gap_bytes=min(measured.allocator_gap_bytes, fixed)), spec, cached, True, ahead)
    return dataclasses.replace(estimate, per_block_bytes=measured.per_block_bytes)


def weigh(spec: ModelSpec, budget: planner.Budgets, rates: Rates, host: planner.Plan, measured: Activations,
          block_input_bytes: int, on_host: bool, fixed: dict, resident: Optional[int],
          least_resident: int, ahead: bool = False) -> tuple[planner.Plan, Activations, Weighed]:
    """(the plan to run, its activations, what was weighed). `host`: the plan with host accumulation (or GPU
    accumulation), made from `measured` with the planner arguments `fixed` and `resident` (None: the planner's
    choice, then at least `least_resident`, as blocks only ever move onto the GPU)."""
    if host.gpu_accumulation:
        return host, measured, Weighed(host.floor.step_s, None, None, False)
    activations = blockwise_activations(measured, spec, block_input_bytes, host.cached_parts, on_host, ahead)
    args = dict(fixed, gpu_accumulation=False, pooled_grads=False, blockwise=True)
    kept = kept_bytes(spec, block_input_bytes, on_host)
    beside_kept = beside_kept_inputs(budget, kept, window_rows_numel(spec, block_input_bytes))
    try:
        if kept >= budget.host_bytes:
            raise MemoryError("the kept inputs alone fill the host budget")
        plan = planner.plan(spec, activations, beside_kept, rates, resident_blocks=resident, **args)
        if resident is None and plan.resident_blocks < least_resident:
            plan = planner.plan(spec, activations, beside_kept, rates, resident_blocks=least_resident, **args)
    except MemoryError:
        return host, measured, Weighed(host.floor.step_s, None, None, False)
    plan = with_blockwise_floor(dataclasses.replace(plan, host_budget_bytes=budget.host_bytes), spec, rates, kept,
                                block_input_bytes, ahead)
    taken = host.floor.step_s >= MARGIN * plan.floor.step_s
    weighed = Weighed(host.floor.step_s, plan.floor.step_s, plan.window_size, taken)
    return (plan, activations, weighed) if taken else (host, measured, weighed)


def window_rows_numel(spec: ModelSpec, block_input_bytes: int) -> int:
    """The input table's rows a window's walk lands at most (engine/embedding_rows.py): its tokens x the hidden size,
    every micro-batch's block input over the compute dtype's bytes (the rows' ids, 8 bytes a row, left out)."""
    return spec.accumulation_steps * block_input_bytes // spec.compute_bytes


def beside_kept_inputs(budget: planner.Budgets, kept: int, window_rows: Optional[int] = None) -> planner.Budgets:
    """`budget` for a blockwise plan whose kept inputs take `kept` bytes of page-locked host slots
    (kept_inputs.py): the planner's host stores leave them out, so they come off the host budget. `window_rows`: its
    input table's gradient as the window's rows (`window_rows_numel`), where a training forward has shown them."""
    return dataclasses.replace(budget, host_bytes=max(1, budget.host_bytes - kept), window_rows_numel=window_rows)


def with_blockwise_floor(plan: planner.Plan, spec: ModelSpec, rates: Rates, kept: int,
                         block_input_bytes: int = 0, ahead: bool = False) -> planner.Plan:
    """A blockwise plan with its own schedule's floor and copy bytes (plan_blockwise.py) in place of the planner's,
    which are host accumulation's; `kept`: the kept inputs a step, each way; `block_input_bytes`: one block's input of
    a micro-batch (0: not known); `ahead`: the window's forwards block by block (engine/block_major.py)."""
    terms, h2d, d2h = plan_blockwise.floor_terms(spec, rates, plan.resident_blocks, plan.window_size,
                                                 plan.cached_parts, kept, block_input_bytes, ahead)
    return dataclasses.replace(plan, floor=terms, h2d_bytes_per_step=h2d, d2h_bytes_per_step=d2h)
