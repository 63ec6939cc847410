"""Largest trainable layer count by search (Fig. 6a): grow geometrically until a point fails,
then bisect between the largest fit and the smallest failure, over multiples of `step`.

Pure: `fits(layers)` runs (or looks up) a point. Because the sequence of probes depends only on
the answers, a search replayed against the results store re-asks the same points, finds them
cached and resumes exactly where a previous, budget-cut command stopped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class SearchPlan:
    start_layers: int
    """First probe (rounded up to a multiple of step_layers)."""
    step_layers: int = 4
    """Resolution of the answer: probes are multiples of it."""
    growth: float = 1.5
    """Factor between probes until the first failure."""
    max_layers: int = 512
    """Stop growing here: the answer is then 'at least max_layers'."""

    def __post_init__(self) -> None:
        if self.step_layers < 1:
            raise ValueError(f"step_layers={self.step_layers} must be >= 1")
        if self.growth <= 1:
            raise ValueError(f"growth={self.growth} must be > 1, e.g. 1.5")
        if not 1 <= self.start_layers <= self.max_layers:
            raise ValueError(f"start_layers={self.start_layers} must be in 1..max_layers={self.max_layers}")


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    largest_fit: int
    """Largest probed layer count that trained; 0 if none did."""
    smallest_failure: int | None
    """Smallest probed layer count that failed; None if none failed up to max_layers."""
    probes: tuple[int, ...]


def _round_up(value: float, step: int) -> int:
    return max(step, -(-int(value) // step) * step)


def largest_trainable(fits: Callable[[int], bool], plan: SearchPlan) -> SearchResult:
    """Largest multiple of plan.step_layers for which fits() holds, assuming it is monotone."""
    step = plan.step_layers
    probes: list[int] = []

    def probe(layers: int) -> bool:
        probes.append(layers)
        return fits(layers)

    lo, hi = 0, None
    layers = _round_up(plan.start_layers, step)
    while hi is None:
        if not probe(layers):
            hi = layers
        elif layers >= plan.max_layers:
            return SearchResult(largest_fit=layers, smallest_failure=None, probes=tuple(probes))
        else:
            lo = layers
            layers = min(_round_up(layers * plan.growth, step), _round_up(plan.max_layers, step))
    while hi - lo > step:
        mid = lo + ((hi - lo) // (2 * step)) * step  # lo, hi are multiples of step, hi - lo >= 2 step
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(largest_fit=lo, smallest_failure=hi, probes=tuple(probes))
