"""The tokens of the training micro-batches seen. The placement plans from the first training step: its measured
activation peak decides how many window slots and resident blocks the GPU holds beside them. A later micro-batch with
more tokens (a collator that pads each batch to its own longest sequence) needs more activation memory than was left:
the window gives up slots for it first (planning/batch_room.py), and where that is not enough, the out-of-memory advice
names the lengths and the fix."""
from __future__ import annotations

import dataclasses
from typing import Optional

from stronghold.memory.long_context import batch_tokens


@dataclasses.dataclass
class BatchLengths:
    first: Optional[int] = None
    """Tokens of the first training micro-batch: what the placement's activations were measured with."""
    largest: Optional[int] = None
    """The most tokens of a training micro-batch so far, this one included."""

    def see(self, inputs: tuple, kwargs: dict) -> None:
        """A training forward's micro-batch, before anything of the forward runs (so an out-of-memory error in it
        counts it)."""
        tokens = batch_tokens(inputs, kwargs)
        if tokens is None:
            return
        if self.first is None:
            self.first = tokens
        self.largest = max(self.largest or 0, tokens)

    def advice(self) -> str:
        """A sentence for the out-of-memory error where a micro-batch has been longer than the first; else ""."""
        if self.first is None or self.largest is None or self.largest <= self.first:
            return ""
        return (f" The placement was planned from the first training micro-batch, {self.first} tokens; micro-batches "
                f"have since had up to {self.largest}, whose activations need more GPU memory than the first step "
                "measured: pad every micro-batch to one length (a collator padding to max_length, or packed "
                "sequences), or set \"window_size\" lower.")
