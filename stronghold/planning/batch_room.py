"""GPU room for a training micro-batch longer than any the placement has planned for.

The placement plans the window from the first training micro-batch (its activation estimate at the first forward,
its measured peak after the first step). A collator that pads each batch to its own longest sequence (HF's
`DataCollatorForLanguageModeling`, and any micro-batch of one sequence without padding) sends later micro-batches with
more tokens, whose activations need more GPU memory than was left. So before such a forward runs, the window gives up
the slots that cover the difference (`Relayout.shrink_window`), in the middle of an accumulation window too: a
streamed block outside the window is loaded again from its host copy, which no update changes before the step.

The difference is what the activations grow by from the longest micro-batch planned for to this one, less the room
the plan left beyond its needs (a slot's leftover covers later ones): once the first step is measured, its measured
activations scaled by the tokens (a checkpointed decoder's activations grow with them: block inputs, one block's
working set, the loss's chunks) without the allocator's gap at that peak (reserved beyond allocated: held already,
and no larger in a step planned for the longer batch from the start); before that, the difference of the
checkpointed activation estimate (activation_estimate.py), an upper bound. Blocks only ever move onto the GPU, so the
window is the one thing that shrinks, down to two slots; below that the out-of-memory error names the lengths
(memory/batch_lengths.py). The window never grows back: the next batch may be as long. Before the first step's
measurement, where the estimate cannot be made (no checkpointing, no sizes in the model's config), nothing changes.
"""
from __future__ import annotations

import logging
from typing import Optional

from stronghold.planning import activation_estimate, plan_bytes, planner

logger = logging.getLogger(__name__)

MIN_WINDOW = 2
"""The fewest slots a window runs with: one block computes while the next loads."""


def activation_bytes(model, spec: planner.ModelSpec, tokens: int, cached_parts: frozenset[str],
                     blockwise_on_host: Optional[bool], ahead: bool = False) -> Optional[int]:
    """The planner's activation bytes for a micro-batch of `tokens` tokens, as the runtime runs the backward
    (`blockwise_on_host`: None for host or GPU accumulation, else whether the blockwise backward keeps the block
    inputs on the host; `ahead`: its forwards block by block, block_major.py); None where the estimate cannot be
    made."""
    estimate = activation_estimate.checkpointed_decoder_activations(model, tokens, spec.compute_bytes)
    if estimate is None:
        return None
    if blockwise_on_host is not None:
        estimate = activation_estimate.blockwise(estimate, spec, cached_parts, blockwise_on_host, ahead)
    return plan_bytes.gpu_activation_bytes(spec, estimate, 0)


def slots_to_free(extra: int, room: int, slot_bytes: int, window: int) -> int:
    """Window slots to give up for `extra` more activation bytes where `room` bytes are free beyond the plan's
    needs: the fewest that cover what the room does not, leaving at least MIN_WINDOW."""
    short = extra - room
    if short <= 0:
        return 0
    return max(0, min(-(-short // slot_bytes), window - MIN_WINDOW))


class BatchRoom:
    """The longest training micro-batch planned for and the GPU bytes left free beside it; the placement owns it."""

    def __init__(self, spec: planner.ModelSpec):
        self.spec = spec
        self.tokens: Optional[int] = None
        """The most tokens of a training micro-batch the window has been sized for."""
        self.room = 0
        """GPU bytes free beyond the needs of the current layout at `tokens` (negative: short by that much)."""
        self._plan: Optional[planner.Plan] = None
        self._per_token: Optional[float] = None
        """The measured activation bytes a token, once the plan is made from a measured step."""
        self.shrunk: list[dict] = []
        """Each shrink, for the placement's report."""

    def before_forward(self, runtime, tokens: Optional[int], plan: planner.Plan,
                       measured: Optional[int] = None) -> None:
        """A training forward of `tokens` tokens is about to run on `runtime`, placed by `plan` (the placement's
        latest: a new one was made for the longest micro-batch so far, so its room is read afresh). `measured`: the
        activation bytes of the first step's peak, which `plan` was made from, less the allocator's gap, else None."""
        if tokens is None:
            return
        if self.tokens is None:
            self.tokens = tokens
        if runtime.window is None or runtime.activations is not None:
            return
        on_host = None if runtime.blockwise is None else runtime.blockwise.kept.to_host
        ahead = on_host is not None and runtime.runs_ahead
        planned = activation_bytes(runtime.model, self.spec, self.tokens, plan.cached_parts, on_host, ahead)
        if plan is not self._plan:
            self._plan, self.room = plan, self._plan_room(runtime, plan, planned)
            self._per_token = measured / self.tokens if measured else None
        if tokens <= self.tokens:
            return
        if self._per_token is not None:
            extra = int(self._per_token * (tokens - self.tokens))
        else:
            longer = activation_bytes(runtime.model, self.spec, tokens, plan.cached_parts, on_host, ahead)
            if longer is None or planned is None:
                self.tokens = tokens  # it runs as placed: the first step's measured peak, if it is in it, covers it
                return
            extra = longer - planned
        slot = runtime.window.slots[0].buffer
        slot = slot.numel() * slot.element_size()
        before, window = self.tokens, runtime.window_size
        freed = slots_to_free(extra, self.room, slot, window)
        self.room += freed * slot - extra
        self.tokens = tokens
        self.shrunk.append(dict(tokens_before=before, tokens=tokens, extra_bytes=extra, window_before=window,
                                window=window - freed))
        if freed:
            runtime.shrink_window(window - freed)
            logger.info(f"stronghold: a micro-batch of {tokens} tokens, longer than the {before} planned for, needs "
                        f"{extra / planner.GIB:.2f} GiB more for its activations: the window gives up {freed} slots "
                        f"({window} to {window - freed})")
        if self.room < 0:
            logger.warning(f"stronghold: a micro-batch of {tokens} tokens needs {-self.room / planner.GIB:.2f} GiB "
                           f"more GPU memory than the window of {runtime.window_size} slots can give up: the GPU may "
                           "run out; pad every micro-batch to one length, or train with shorter sequences")

    @staticmethod
    def _plan_room(runtime, plan: planner.Plan, planned: Optional[int]) -> int:
        """What `plan` leaves free where the runtime is laid out as it says (else nothing is counted): beyond its
        needs, and of the activations it counted, what the longest micro-batch planned for (`planned` bytes) leaves:
        the start-up plan holds a reserve back for a batch it has not seen."""
        window = min(max(MIN_WINDOW, plan.window_size), len(runtime.stores))
        if (plan.resident_blocks, window) != (runtime.resident_count, runtime.window_size):
            return 0
        unused = max(0, plan.gpu.activations - planned) if planned is not None else 0
        return max(0, plan.gpu_budget_bytes - plan.gpu.needed) + unused
