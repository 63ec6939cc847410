"""Largest trainable value of one integer field of a point, by search: grow geometrically until a
point fails, then bisect between the largest fit and the smallest failure, over multiples of `step`.

Fig. 6a searches the layer count (`SearchPlan`); the `seqlen` sweep searches the sequence length
(`IntSearch(field="seq", ...)`). Pure: `fits(value)` runs (or looks up) a point. Because the
sequence of probes depends only on the answers, a search replayed against the results store
re-asks the same points, finds them cached and resumes exactly where a previous, budget-cut
command stopped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class IntSearch:
    """Where and how finely to search one integer field (named in messages as start_<field>, ...)."""

    field: str
    """The Point field searched (`layers`, `seq`): only names it in messages."""
    start: int
    """First probe (rounded up to a multiple of step)."""
    step: int
    """Resolution of the answer: probes are multiples of it."""
    growth: float = 1.5
    """Factor between probes until the first failure."""
    maximum: int
    """Stop growing here: the answer is then 'at least maximum'."""
    known_fit: int = 0
    """A value known to fit (an earlier measurement, of other code): where `start` fails, the search bisects
    between the two instead of from zero. A multiple of step below start; 0: none known."""

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"step_{self.field}={self.step} must be >= 1")
        if self.growth <= 1:
            raise ValueError(f"growth={self.growth} must be > 1, e.g. 1.5")
        if not 1 <= self.start <= self.maximum:
            raise ValueError(f"start_{self.field}={self.start} must be in 1..max_{self.field}={self.maximum}")
        if self.known_fit % self.step or not 0 <= self.known_fit < _round_up(self.start, self.step):
            raise ValueError(f"known_{self.field}={self.known_fit} must be a multiple of step_{self.field}="
                             f"{self.step} below start_{self.field}={self.start}")


@dataclass(frozen=True, kw_only=True)
class SearchPlan:
    """Fig. 6a's search of the layer count (an IntSearch over `layers`)."""

    start_layers: int
    """First probe (rounded up to a multiple of step_layers)."""
    step_layers: int = 4
    """Resolution of the answer: probes are multiples of it."""
    growth: float = 1.5
    """Factor between probes until the first failure."""
    max_layers: int = 512
    """Stop growing here: the answer is then 'at least max_layers'."""

    def __post_init__(self) -> None:
        self.search()  # validates, with the messages naming these fields

    def search(self) -> IntSearch:
        return IntSearch(field="layers", start=self.start_layers, step=self.step_layers, growth=self.growth,
                         maximum=self.max_layers)


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    largest_fit: int
    """Largest probed value that trained; 0 if none did."""
    smallest_failure: int | None
    """Smallest probed value that failed; None if none failed up to the maximum."""
    probes: tuple[int, ...]


def _round_up(value: float, step: int) -> int:
    return max(step, -(-math.ceil(value) // step) * step)


def largest_trainable(fits: Callable[[int], bool], plan: SearchPlan | IntSearch) -> SearchResult:
    """Largest multiple of the plan's step for which fits() holds, assuming it is monotone."""
    search = plan.search() if isinstance(plan, SearchPlan) else plan
    step = search.step
    probes: list[int] = []

    def probe(value: int) -> bool:
        probes.append(value)
        return fits(value)

    lo, hi = search.known_fit, None
    value = _round_up(search.start, step)
    while hi is None:
        if not probe(value):
            hi = value
        elif value >= search.maximum:
            return SearchResult(largest_fit=value, smallest_failure=None, probes=tuple(probes))
        else:
            lo = value
            # At least one step up: a small value times a small growth can round back to itself.
            value = min(max(_round_up(value * search.growth, step), value + step), _round_up(search.maximum, step))
    while hi - lo > step:
        mid = lo + ((hi - lo) // (2 * step)) * step  # lo, hi are multiples of step, hi - lo >= 2 step
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(largest_fit=lo, smallest_failure=hi, probes=tuple(probes))
