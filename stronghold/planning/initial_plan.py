"""The construction-time plan: before any batch is seen, the GPU budget less a reserve for activations (the first
fraction of ACTIVATION_RESERVES whose plan also fits host memory) decides how many blocks start resident. Only where
no reserve fits host memory are the spare gradient buffers dropped, then lean blocks planned (planner Tier.LEAN,
store.py). placement.py re-plans at the first forward and after the first step.

On a CPU device there is no device memory to plan: the settings hold numbers there (config.CPU_DEFAULTS), and the
engine builds its runtime from them without a plan.
"""
from __future__ import annotations

from typing import Optional

import torch

from stronghold.config import Settings
from stronghold.planning import plan_inputs, planner

ACTIVATION_RESERVES = (0.5, 0.4, 0.3, 0.2, 0.1)
"""Fractions of the GPU budget held back for the first step's activations, tried in order until the
plan fits host memory too (fewer resident blocks need more host). Half the card is far more than
the activations of a checkpointed transformer at the usual batch sizes, and a first step that
streams more blocks than needed only costs that one step."""
FIRST_WINDOW = 4
"""Window of the first step where the window is left to stronghold: the compute time per block is not known yet. Four
slots hid the loads in every configuration the benchmark sweeps measured."""
DEFAULT_RATES = planner.Rates(h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, cpu_adam_params_per_s=2e9,
                              gpu_s_per_block=1e-3, gpu_s_fixed=0.0)
"""Stand-ins for the construction-time plan, which only uses them for its prediction (its window is
FIRST_WINDOW); the plan after the first step uses measured rates."""

def initial_plan(spec: planner.ModelSpec, budget: planner.Budgets, settings: Settings) -> planner.Plan:
    """The construction-time plan (see the module docstring); numbers in the settings are kept. Where the parts outside
    the blocks go ("rest_placement") is decided here, for good: the plans after the first step keep it.

    With a drive ("nvme_path") and "nvme_blocks" left to stronghold, the drive is the last resort: a block's states on
    the drive are read and written every step (24 blocks of a Llama-3-8B shape, 58 GiB: 65 s a step at 1.9 GB/s), far
    more than any host saver costs, so every saver is tried without the drive first; where the drive is needed, the
    saver that puts the fewest blocks on it, and of those that tie the one with the least drive traffic (compact masters
    keep 2 bytes a parameter of the drive's files in the working copy), then the cheapest."""
    savers = _savers(spec, budget, settings)
    if settings.nvme_blocks is not None or budget.drive is None:
        return _fewest_reloads(spec, budget, settings, savers,
                               _first_fit(spec, budget, settings, savers, settings.nvme_blocks))
    try:
        return _first_fit(spec, budget, settings, savers, 0)
    except MemoryError as err:
        error = err
    fitting = []
    for saver in savers:
        try:
            fitting.append(_first_fit(spec, budget, settings, [saver], None))
        except (MemoryError, ValueError) as err:  # ValueError: a drive too slow for this saver's many drive blocks
            error = err
    if not fitting:
        raise error
    return min(fitting, key=lambda chosen: (chosen.nvme_blocks, chosen.nvme_bytes_per_step))


def _first_fit(spec: planner.ModelSpec, budget: planner.Budgets, settings: Settings,
               savers: list[tuple[bool, bool]], nvme: Optional[int]) -> planner.Plan:
    """The first plan that fits, host savers in `savers`' order, with `nvme` blocks on the drive (None: the fewest
    that fit)."""
    resident = settings.resident_blocks
    tiers = plan_inputs.rest_tiers(settings, spec)
    window = FIRST_WINDOW if settings.window_size is None else settings.window_size
    lean = settings.lean_blocks
    # Left to stronghold, accumulation starts on the host: the choice needs measured rates (DEFAULT_RATES are guesses,
    # and the GPU way lost on a Llama 2.70 B with accumulation 8 under 32 GiB); the plan after the first step may move
    # it.
    accumulation = settings.gpu_accumulation is True
    spares = settings.gradient_spares
    error: Optional[MemoryError] = None
    if resident is not None:
        for compact_rule, pooled_rule in savers:
            try:
                return planner.plan(spec, planner.Activations(fixed_peak_bytes=0, per_block_bytes=0), budget,
                                    DEFAULT_RATES, resident_blocks=resident, window_size=window, lean_blocks=lean,
                                    gpu_accumulation=accumulation, rest_tiers=tiers,
                                    gradient_spares=False if pooled_rule else spares, nvme_blocks=nvme,
                                    compact_master=compact_rule, pooled_grads=pooled_rule,
                                    blockwise=settings.blockwise_backward is True)
            except MemoryError as err:
                error = err
        raise error
    # Lean blocks, or no spare gradient buffers, only where no reserve fits without: they cost every step, a
    # smaller reserve only the first. Then the largest reserve that fits: lean blocks are the first streamed
    # ones, the first promoted after the first step. Blocks on the NVMe drive are the fewest at the first reserve that
    # fits (the planner's choice): a smaller reserve would risk the first step's activations on the GPU, and the
    # drive's blocks are the last streamed ones, the last a promotion reaches. Compact masters and pooled gradient
    # buffers come last of all (`_savers`), where nothing else fits.
    for compact_rule, pooled_rule in savers:
        for lean_rule in ((0, None) if lean is None else (lean,)) if not (compact_rule or pooled_rule) else (0,):
            for spare_rule in ((True, False) if spares is None else (spares,)) if not pooled_rule else (False,):
                for fraction in ACTIVATION_RESERVES:
                    reserve = planner.Activations(fixed_peak_bytes=int(fraction * budget.gpu_bytes), per_block_bytes=0)
                    try:
                        return planner.plan(spec, reserve, budget, DEFAULT_RATES, window_size=window,
                                            lean_blocks=lean_rule, gpu_accumulation=accumulation, rest_tiers=tiers,
                                            gradient_spares=spare_rule, nvme_blocks=nvme, compact_master=compact_rule,
                                            pooled_grads=pooled_rule, blockwise=settings.blockwise_backward is True)
                    except MemoryError as err:
                        error = err
    raise error


def _fewest_reloads(spec: planner.ModelSpec, budget: planner.Budgets, settings: Settings,
                    savers: list[tuple[bool, bool]], plan: planner.Plan) -> planner.Plan:
    """With gradient accumulation and the residency and window left to stronghold, no more resident blocks than the
    residency whose largest window leaves the fewest streamed blocks outside it (no activations counted; ties to more
    resident blocks), as the first forward caps its promotion (placement.py `_fewest_reloads`): blocks only move onto
    the GPU, so a block built resident here stays resident, though every resident block takes the GPU room of several
    slots, and with accumulation a streamed block outside the window is copied in every micro-step. Where the host
    holds the fewer resident blocks only with a later host saver of `savers` (a Qwen2.5-7B shape under 24 GiB: pooled
    gradient buffers beside the compact masters), that saver is taken: the plans after the first step drop pooled
    buffers for the blockwise backward. Keeps `plan` where lean blocks or the drive are in it."""
    if (spec.accumulation_steps == 1 or settings.resident_blocks is not None or settings.window_size is not None
            or plan.resident_blocks == 0 or plan.lean_blocks or plan.nvme_blocks):
        return plan
    later = savers[savers.index((plan.compact_master, plan.pooled_grads)):]
    tiers = plan_inputs.built_tiers(spec, plan.cached_parts)

    def at(resident: int, window: Optional[int], reserve: planner.Activations, saver: tuple[bool, bool]):
        compact, pooled = saver
        return planner.plan(spec, reserve, budget, DEFAULT_RATES, resident_blocks=resident, window_size=window,
                            lean_blocks=0, gpu_accumulation=plan.gpu_accumulation, rest_tiers=tiers,
                            gradient_spares=False if pooled else plan.gradient_spares, nvme_blocks=0,
                            compact_master=compact, pooled_grads=pooled, blockwise=settings.blockwise_backward is True)
    none, best = planner.Activations(fixed_peak_bytes=0, per_block_bytes=0), None
    for resident in range(plan.resident_blocks + 1):
        for saver in later:
            try:
                window = at(resident, None, none, saver).window_size
            except MemoryError:
                continue
            reloads = max(0, len(spec.blocks) - resident - window)
            if best is None or reloads <= best[0]:
                best = (reloads, resident)
            break
    if best is None or best[1] >= plan.resident_blocks:
        return plan
    for saver in later:
        for fraction in ACTIVATION_RESERVES:
            reserve = planner.Activations(fixed_peak_bytes=int(fraction * budget.gpu_bytes), per_block_bytes=0)
            try:
                return at(best[1], FIRST_WINDOW, reserve, saver)
            except MemoryError:
                pass
    return plan


def _savers(spec: planner.ModelSpec, budget: planner.Budgets, settings: Settings) -> list[tuple[bool, bool]]:
    """(compact_master, pooled_grads) in the order tried: as set, else the cheapest first. Compact masters cost a redone
    or undone update a merge and a split pass over the master (the update itself, none); pooled buffers hold backward to
    a few blocks ahead of the CPU's sums, which can stall it: so compact masters alone, then pooled buffers alone, then
    both."""
    compact = [settings.compact_master] if settings.compact_master is not None else (
        [False, True] if planner.compact_possible(spec, budget) else [False])
    pooled = [settings.pooled_grads] if settings.pooled_grads is not None else (
        [False, True] if planner.pooled_possible(spec, budget) and settings.gpu_accumulation is not True
        and settings.gradient_spares is not True and not settings.blockwise_backward else [False])
    ladder = [(False, False), (True, False), (False, True), (True, True)]
    return [(c, p) for c, p in ladder if c in compact and p in pooled]


def agree(resident: int, window: int) -> tuple[int, int]:
    """Every data-parallel rank must place the blocks the same way (data_parallel.py checks it), but
    each plans from its own free memory: all take the placement with the fewest resident blocks."""
    return min(_every_rank((resident, window)))


def agree_cached(cached: frozenset[str]) -> frozenset[str]:
    """The parts outside the blocks in the cached tier, the same on every data-parallel rank (their collectives differ
    by tier: a unit's gradients are reduce-scattered, a resident part's all-reduced), though each plans from its own
    free memory: all take every part any rank cached, which needs less GPU memory than keeping it resident."""
    return frozenset(name for choice in _every_rank(sorted(cached)) for name in choice)


def _every_rank(value) -> list:
    """Every data-parallel rank's `value` (this one's alone without data parallel)."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    choices: list = [None] * dist.get_world_size()
    dist.all_gather_object(choices, value)
    return choices


def first_forward_target(plan: Optional[planner.Plan], resident: int, window: int,
                         data_parallel: bool) -> tuple[int, int]:
    """(resident blocks, window) to place at the first forward: the plan's where it promotes, the present placement
    where there is no plan or it would not promote (placement never demotes). With data parallel every rank reaches
    this whatever its own plan, so the ranks' collective always runs: each takes the fewest resident blocks of all
    (`agree`), as after the first step."""
    if plan is not None and plan.resident_blocks > resident:
        resident, window = plan.resident_blocks, max(2, plan.window_size)
    return agree(resident, window) if data_parallel else (resident, window)
