"""When the CPU optimizer updates a streamed block during backward (speculates) rather than at step().

With clipping on, the clip coefficient is known only once backward has produced every gradient, but a
streamed block's gradients reach the host, and could be applied, long before. Updating early with the
unclipped gradient is exact only if the step then does not clip; otherwise step() redoes the block (a
second pass over its states). Deferring to step() is always exact but gives up the overlap with backward.
Either way the result is the same to rounding; the choice is only about speed.

The rule: update block i early while the step's *predicted* global sum of squares stays within
SPECULATE_FRACTION² · max_norm². The prediction is what this step has produced so far plus, for the
blocks not yet seen, what they produced last step (`Forecast`): gradients change slowly from one step
to the next, so a run whose norm sits steadily below the limit speculates every block and one that clips
every step defers every block, with no redo in either case. The running sum alone also bounds the
prediction, so a block whose own gradient pushes the sum over max_norm² (a loss spike) is never
updated early: undoing a step made with a huge gradient would lose the state's low bits, while undoing
normal-sized early steps, when a later spike makes the step clip, is accurate (adamw.c's redo).
The first step has no forecast and speculates while the running sum stays within the bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

SPECULATE_FRACTION = 0.9
"""Speculate while the predicted global norm is at most this fraction of max_norm. A wrong speculation
costs a redo pass, a wrong deferral the overlap of one block's update with backward: the margin makes
a redo need the norm to grow by more than 1 / 0.9 (11%) in one step."""


@dataclass
class Forecast:
    """Last step's sums of squares (loss scale removed), as this process saw them."""

    block_sq: dict[int, float] = field(default_factory=dict)
    """Per streamed block index (its shard's, with sharded data parallel)."""
    other_sq: float = 0.0
    """The rest of the global sum: resident blocks, embeddings and head, other ranks' shards."""
    _unseen: Optional[float] = field(default=None, compare=False, repr=False)
    """Worker-side, during a step: the forecast of the blocks not decided yet (None between steps)."""

    def end_step(self) -> None:
        self._unseen = None

    def speculate(self, index: int, running_sq: float, block_sq: float, limit_sq: float) -> bool:
        """Whether block `index`, whose sum of squares is `block_sq`, may be updated before step();
        `running_sq`: the sums of the blocks decided earlier in this step. Called once per block and step
        (worker thread); `end_step` starts the next step's forecast afresh."""
        if self._unseen is None:
            self._unseen = sum(self.block_sq.values()) + self.other_sq
        self._unseen -= self.block_sq.get(index, 0.0)
        predicted = running_sq + block_sq + max(0.0, self._unseen)
        return predicted <= SPECULATE_FRACTION ** 2 * limit_sq

    def record(self, block_sq: dict[int, float], total_sq: float) -> None:
        """After a finite step: its blocks' sums and its global total (all ranks, all parts)."""
        if not math.isfinite(total_sq) or not all(map(math.isfinite, block_sq.values())):
            return  # a skipped step says nothing about the next one's gradients
        self.block_sq = dict(block_sq)
        self.other_sq = max(0.0, total_sq - sum(block_sq.values()))

    def state_dict(self) -> dict:
        """Plain values for a checkpoint, so a resumed run decides as the uninterrupted one would."""
        return {"block_sq": {str(i): v for i, v in self.block_sq.items()}, "other_sq": self.other_sq}

    def load_state_dict(self, state) -> None:
        """Take a checkpoint's forecast (`from_state_dict`'s formats) in place."""
        loaded = Forecast.from_state_dict(state)
        self.block_sq, self.other_sq, self._unseen = loaded.block_sq, loaded.other_sq, None

    @classmethod
    def from_state_dict(cls, state) -> "Forecast":
        """`state_dict()`'s output; also a format-2 checkpoint's `defer_next` flag (True: defer every
        block of the next step, as the rule of that format did; False or None: no forecast)."""
        if isinstance(state, dict):
            return cls(block_sq={int(i): float(v) for i, v in state["block_sq"].items()},
                       other_sq=float(state["other_sq"]))
        return cls(other_sq=math.inf) if state else cls()
