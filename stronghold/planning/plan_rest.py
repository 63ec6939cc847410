"""The parts of the model outside the blocks in the planner (planner.py asks): which tiers each may take, their bytes
in each, the step-time terms the cached tier adds, and the choice among the tier combinations.

A part (ModelSpec.rest_parts: the input embeddings, the final norm and LM head) is either RESIDENT, as the whole rest
always was (weights, gradients, fp32 master and AdamW moments on the GPU, gpu_optim.py), or CACHED (weights and
gradients on the GPU, fp32 master and moments on the host, updated by the CPU AdamW like a streamed block:
streaming/cached.py). A cached part costs per trainable parameter the compute dtype's gradient on the GPU and, on the
host, the master and moments, a working copy and, with accumulation, two gradient buffers and an fp32 accumulator (its
accumulation is always on the host: on the GPU its accumulator alone would take the 4 bytes its master gave up);
plan_bytes.store_bytes counts them. Each step it sends its gradients down every pass, the CPU sums and updates it, and its weights go back up once.
Pure: plain numbers in and out.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from stronghold.planning.plan_search import SEARCH_TOLERANCE
from stronghold.planning.plan_result import Plan
from stronghold.planning.plan_types import (ACCUMULATE_COST_VS_ADAM, ACCUMULATE_HOST_BYTES, ADAM_HOST_BYTES,
                                            ModelSpec, PartSpec, Rates, Tier, _require)

RestTiers = Union[None, Tier, Mapping[str, Optional[Tier]]]
"""The planner's `rest_tiers`: None (every part "auto"), one Tier for every part, or a tier per part name (None or a
name left out: "auto" for that part)."""

BLOCKWISE_SUMMED = frozenset({"input"})
"""The parts outside the blocks that the blockwise backward sums on the GPU like a block (engine/blockwise_walk.py): in
the cached tier one fp32 gradient buffer each, no accumulator, no spare; the others sum on the host every micro-step."""


def tier_options(model: ModelSpec, rest_tiers: RestTiers) -> list[frozenset[str]]:
    """The sets of cached parts to plan, all-resident first. A part with nothing to train stays resident, whatever it
    is given (the cached tier would only add a host copy; the runtime keeps it resident too). With data parallel a
    cached part is sharded over the ranks as a streamed block is (data_parallel.py)."""
    names = {p.name for p in model.rest_parts}
    if isinstance(rest_tiers, Mapping):
        unknown = sorted(set(rest_tiers) - names)
        _require(not unknown, f"rest_tiers names unknown parts {unknown}; the model's are {sorted(names)}")
    choices = []
    for part in model.rest_parts:
        tier = rest_tiers.get(part.name) if isinstance(rest_tiers, Mapping) else rest_tiers
        _require(tier in (None, Tier.RESIDENT, Tier.CACHED), f"part {part.name}: tier {tier} is not resident or cached")
        if part.trainable_numel == 0:
            tier = Tier.RESIDENT
        choices.append((False, True) if tier is None else (tier is Tier.CACHED,))
    parts = model.rest_parts
    return [frozenset(p.name for p, cached in zip(parts, combo) if cached) for combo in itertools.product(*choices)]


def split(model: ModelSpec, cached: frozenset[str]) -> tuple[list[PartSpec], list[PartSpec]]:
    """(resident parts, cached parts)."""
    return ([p for p in model.rest_parts if p.name not in cached], [p for p in model.rest_parts if p.name in cached])


def cached_gpu_bytes(parts: list[PartSpec], compute_bytes: int) -> int:
    """Weights and gradients, in the compute dtype."""
    return sum((p.numel + p.trainable_numel) * compute_bytes for p in parts)


@dataclass(frozen=True)
class CachedTerms:
    """What the cached parts add to one optimizer step (plan_floor.floor_terms adds them to its terms)."""

    h2d_bytes: int
    """Their weights, once a step, after their update."""
    d2h_bytes: int
    """Their gradients, every pass (the CPU accumulates them)."""
    cpu_params: float
    """CPU AdamW work in parameter updates: one update and, accumulating, one accumulation pass per pass."""
    host_memory_bytes: int
    """Host DRAM bytes of their CPU work (the copies are counted with h2d_bytes and d2h_bytes)."""
    h2d_s: float
    """Their load before the next forward, which waits for it: serial with the walk."""
    tail_s: float
    """The before-the-blocks parts' D2H and CPU update, which start after the last block's backward: nothing of the
    step overlaps them."""


def cached_terms(model: ModelSpec, rates: Rates, cached: frozenset[str]) -> CachedTerms:
    _, parts = split(model, cached)
    cb, passes = model.compute_bytes, model.accumulation_steps
    accumulate = ACCUMULATE_COST_VS_ADAM if passes > 1 else 0.0
    numel, trainable = sum(p.numel for p in parts), sum(p.trainable_numel for p in parts)
    first = sum(p.trainable_numel for p in parts if p.before_blocks)
    tail = first * cb / rates.d2h_bytes_per_s + first * (1 + accumulate) / rates.cpu_adam_params_per_s
    return CachedTerms(
        h2d_bytes=numel * cb, d2h_bytes=trainable * cb * passes,
        cpu_params=trainable * (1 + passes * accumulate),
        host_memory_bytes=trainable * (ADAM_HOST_BYTES + (passes * ACCUMULATE_HOST_BYTES if passes > 1 else 0)),
        h2d_s=numel * cb / rates.h2d_bytes_per_s, tail_s=tail if first else 0.0)


def resident_rest_numel(plan: Plan, model: ModelSpec) -> int:
    cached = plan.cached_parts
    return sum(p.numel for p in model.rest_parts if p.name not in cached)


def most_resident_rest(plans: list[Plan], model: ModelSpec) -> list[Plan]:
    """Of the best plans of each tier combination: those within SEARCH_TOLERANCE of the fastest prediction, and of
    those the ones that keep the most of the rest resident. So a part goes to the host where the resident plans do not
    fit or are predicted slower (its CPU update and copies are then hidden, or cost less than the resident blocks or
    slots its GPU memory buys)."""
    fastest = min(p.predicted_step_s for p in plans)
    close = [p for p in plans if p.predicted_step_s <= fastest * (1 + SEARCH_TOLERANCE)]
    most = max(resident_rest_numel(p, model) for p in close)
    return [p for p in close if resident_rest_numel(p, model) == most]
