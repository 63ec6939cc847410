"""GPU time measured with CUDA events: one transformer block's, around its forward calls, which the placement
(placement.py) times in the first step and the steps right after the placement and turns into a pass time
(planner.Rates.gpu_s_per_block); `record_event` also times the resident AdamW's step (gpu_optim.py)."""
from __future__ import annotations

import statistics
from typing import Optional

import torch


class BlockTimer:
    """CUDA events around the blocks' forward calls during the steps being timed (recomputes included)."""

    def __init__(self):
        self.pairs: list[tuple] = []
        self.calls = 0
        self._open: dict[int, object] = {}
        self.handles: list = []

    def attach(self, blocks) -> None:
        # Registered after the runtime's own pre-hooks, so each start event is queued after the wait
        # for the block's weights: it times compute, not the load.
        def pre(module, args):
            self.calls += 1
            self._open[id(module)] = record_event()

        def post(module, args, output):
            # Paired per module: a non-reentrant checkpoint's recompute may stop inside a block
            # (once it has what backward needs) and never reach the post-hook.
            start = self._open.pop(id(module), None)
            if start is not None:
                self.pairs.append((start, record_event()))

        for block in blocks:
            self.handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def seconds(self) -> Optional[float]:
        """A block's forward time: the median of the timed step's complete calls (None if none),
        which leaves out the first calls (kernel compilation, library handles). The lower quartile
        was tried and predicted the Llama step 43% short (results/placement/NOTES.md)."""
        if not self.pairs:
            return None
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in self.pairs)


def record_event():
    """A timing CUDA event recorded on the current stream now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
