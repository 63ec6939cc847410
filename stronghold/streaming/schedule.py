"""Which streamed block to prefetch, keep or evict at each hook. Pure: no tensors, no devices.

A step walks the streamed blocks forward (first to last) and then backward (last to first). With
W slots, entering a block wants the next W-1 blocks of the walk loaded or in flight. Leaving a
block in a training forward frees its slot unless it is one of the last W, which backward needs
first. When a slot must be taken, the victim is the block whose next use is furthest away
(Belady's rule over the known walk), so prefetching never evicts something needed sooner.

A forward followed by another forward (the blockwise backward's micro-steps, evaluation) looks one block ahead
instead, where more than KEEP_AHEAD_FROM blocks are left out: the victim rule then keeps the first W - 2 blocks in
their slots for the next forward, which loads S - W + 2 blocks instead of every one. A forward with no autograd is
bound by its loads wherever a block's copy takes longer than its forward (what streaming is for), and one load queued
behind the one in flight keeps the copy engine as busy as W - 1 do. With W - 1 ahead, the slots end the forward
holding its last W blocks, and the next forward finds the 2W - S of them it starts with: it loads 2(S - W) (all S
where W <= S / 2), which is no more than S - W + 2 only where at most KEEP_AHEAD_FROM blocks are left out: there
W - 1 ahead stays (`later_forward_blocks` counts both).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Optional


KEEP_AHEAD_FROM = 2
"""Blocks left out of the window above which a forward followed by another looks one block ahead (see above)."""


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class WindowSchedule:
    streamed: tuple[int, ...]
    """Indices of the streamed blocks, in forward order."""
    window: int
    """Slots on the GPU (already clamped to the number of streamed blocks)."""

    def __post_init__(self):
        assert self.streamed, "a schedule needs at least one streamed block"
        assert 1 <= self.window <= len(self.streamed), (self.window, len(self.streamed))
        object.__setattr__(self, "_position", {block: pos for pos, block in enumerate(self.streamed)})

    def position(self, block: int) -> int:
        return self._position[block]

    def lookahead(self, phase: Phase, block: int, training: bool = True) -> list[int]:
        """The blocks after `block` in walk order that should be loaded or in flight, nearest first (`depth` of
        them)."""
        pos, depth = self.position(block), self.depth(phase, training)
        if phase is Phase.FORWARD:
            return list(self.streamed[pos + 1:pos + 1 + depth])
        return list(reversed(self.streamed[max(0, pos - depth):pos]))

    def depth(self, phase: Phase, training: bool) -> int:
        """Blocks to prefetch ahead of the one entered: one in a forward that another forward follows, where more
        than KEEP_AHEAD_FROM blocks are left out (see above); W - 1 otherwise."""
        left_out = len(self.streamed) - self.window
        return 1 if phase is Phase.FORWARD and not training and left_out > KEEP_AHEAD_FROM else self.window - 1

    def start(self, phase: Phase) -> list[int]:
        """What to prefetch before the first streamed block of a walk runs, nearest first."""
        if phase is Phase.FORWARD:
            return list(self.streamed[:self.window])
        return list(reversed(self.streamed[-self.window:]))

    def keep_after_forward(self, block: int, training: bool) -> bool:
        """Keep the slot after a forward only for the last W blocks, which backward needs first."""
        return training and self.position(block) >= len(self.streamed) - self.window

    def distance(self, phase: Phase, current: Optional[int], block: int, training: bool) -> int:
        """Steps of the walk until `block` is needed again, seen from `current` (None: before the walk)."""
        n = len(self.streamed)
        pos = self.position(block)
        if current is None:
            return pos + 1 if phase is Phase.FORWARD else n - pos
        cur = self.position(current)
        if phase is Phase.FORWARD:
            if pos > cur:
                return pos - cur
            if training:  # passed: next needed when backward walks back to it
                return (n - 1 - cur) + (n - 1 - pos) + 1
            return (n - cur) + pos  # passed, no backward: the next forward
        if pos < cur:
            return cur - pos
        return cur + 1 + pos  # passed in backward: the next forward

    def victim(self, phase: Phase, current: Optional[int], candidates: Iterable[int], training: bool) -> Optional[int]:
        """The candidate needed furthest in the future (None if there are no candidates)."""
        best, best_distance = None, -1
        for block in candidates:
            d = self.distance(phase, current, block, training)
            if d > best_distance:
                best, best_distance = block, d
        return best


def later_forward_blocks(streamed: int, window: int) -> int:
    """Blocks a forward loads after another forward of the same weights (see above): the planner's count."""
    left_out = max(0, streamed - window)
    if left_out > KEEP_AHEAD_FROM:
        return min(streamed, left_out + 2)
    return min(streamed, 2 * left_out)
