"""Choosing among the placements the planner's search found (planner._plan_at, with gradient accumulation and both
knobs "auto"): which window size to take, and which of several close predictions to take. The predictions come from
the first step's rates, which are noisy and biased, so close ones count as equal."""
from __future__ import annotations

from typing import Callable, Optional

from stronghold.planning.plan_result import Plan

SEARCH_TOLERANCE = 0.03
"""Predicted steps this close to the fastest count as equal in the residency x window search. The rates come
from the first step, which streams far more than the steps after it: its block time came out 7.0 to 9.4 ms on
one machine in four Llama runs, and with the slower one a plan with 9 resident blocks and 6 slots tied the
compute floor and was taken over 15 and 17, which ran 8-11% slower. Resident blocks do not depend on the rates:
every one removes copies and CPU work outright."""

BLOCK_TIME_LOW = 0.75
"""The close plans are ranked again with the blocks this much faster than measured. The first step's block time
is biased high (it streams more than the steps after it, and its CPU work shares the host): 7.0-9.4 ms on one
machine; on an H100 the first step's 10.2 ms put the compute term alone at 2.76 s a step, above the 2.61 s the
whole step took with R15 W17 in the same run. Too long a compute term hides copy-bound walks: there R16 W4 and
R15 W17 predicted within 3%, R16 won on residency and ran 0.742x plain DeepSpeed against 0.864x for R15 W17 in the
same run."""


def choose(plans: list[Plan], low_step_s: Optional[Callable[[Plan], float]] = None) -> Plan:
    """Among predictions within SEARCH_TOLERANCE of the fastest: those within it of the fastest again by
    `low_step_s` (a plan's step with the blocks BLOCK_TIME_LOW as long), then those within it of the least host
    memory traffic (the plan's host_memory_s), and of those the most resident blocks (max keeps the first of
    equals).

    Why host traffic before residency: the model takes the copies and the CPU's passes as hidden under a longer
    term, but they share host DRAM with each other and cores with the thread that launches the GPU work, which it
    does not model. Every same-run A/B on the Llama GA 8 point under 32 GiB went against the plan with one more
    resident block and a small window, which streams ~11x the bytes: R16 W4 0.742x vs R15 W17 0.864x, R16 W2
    0.865x vs R15 W17 0.927x; with the compute term dominant even at BLOCK_TIME_LOW (11.1 ms first-step blocks)
    only this step tells them apart. Without accumulation every window moves the same bytes, so there it is the
    residency order as before."""
    def within(candidates: list[Plan], step_s: Callable[[Plan], float]) -> list[Plan]:
        fastest = min(step_s(p) for p in candidates)
        return [p for p in candidates if step_s(p) <= fastest * (1 + SEARCH_TOLERANCE)]

    close = within(plans, lambda p: p.predicted_step_s)
    if low_step_s is not None and len(close) > 1:
        close = within(close, low_step_s)
    if len(close) > 1:
        close = within(close, lambda p: p.floor.host_memory_s)
    return max(close, key=lambda p: p.resident_blocks)


def largest_fitting_window(fits: Callable[[int], bool], smallest: int, largest: int) -> Optional[int]:
    """The largest window in [smallest, largest] that `fits`, by bisection (a window's GPU bytes grow with its
    slots, so the windows that fit are a prefix); None where not even `smallest` does. With accumulation the slots
    are a cache across the micro-steps, so at a given residency the largest window that fits is the fastest: each
    slot more keeps a block's copies off the bus on every micro-step after the first."""
    if largest < smallest or not fits(smallest):
        return None
    low, high = smallest, largest
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
