"""GPU time measured with CUDA events: one transformer block's, around its forward calls, which the placement
(placement.py) times in the first step and the steps right after the placement and turns into a pass time
(planner.Rates.gpu_s_per_block); `record_event` also times the resident AdamW's step (gpu_optim.py)."""
from __future__ import annotations

import statistics
from typing import Optional

import torch


DISTURBED = 1.25
"""A timed step whose time is over this multiple of the fastest one's counts as disturbed (`typical`)."""


def typical(seconds: list[float]) -> float:
    """The median of the times within DISTURBED of the fastest: the machine's own spread stays in, a disturbed step
    does not."""
    fastest = min(seconds)
    return statistics.median(s for s in seconds if s <= DISTURBED * fastest)


class BlockTimer:
    """CUDA events around the blocks' forward calls during the steps being timed (recomputes included)."""

    def __init__(self):
        self.pairs: list[tuple] = []
        self.starts: list[tuple[int, object]] = []
        """(block index, start event) of every call, in call order."""
        self.calls = 0
        self._open: dict[int, object] = {}
        self.handles: list = []

    def attach(self, blocks) -> None:
        # Registered after the runtime's own pre-hooks, so each start event is queued after the wait
        # for the block's weights: it times compute, not the load.
        def pre(module, args):
            self.calls += 1
            self._open[id(module)] = event = record_event()
            self.starts.append((index[id(module)], event))

        def post(module, args, output):
            # Paired per module: a non-reentrant checkpoint's recompute may stop inside a block
            # (once it has what backward needs) and never reach the post-hook.
            start = self._open.pop(id(module), None)
            if start is not None:
                self.pairs.append((start, record_event()))

        index = {id(block): i for i, block in enumerate(blocks)}
        for block in blocks:
            self.handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]

    def reset(self) -> None:
        self.pairs.clear()
        self.starts.clear()
        self.calls = 0

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def seconds(self) -> Optional[float]:
        """A block's forward time: the median of the timed step's complete calls (None if none),
        which leaves out the first calls (kernel compilation, library handles). The lower quartile
        was tried and predicted a Llama step 43% short."""
        if not self.pairs:
            return None
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in self.pairs)

    def backward_seconds(self, below: int, streamed: bool = False) -> Optional[float]:
        """With checkpointing, a block's recompute and backward: the GPU time from one block's recompute to the next
        lower block's (backward walks the blocks downwards), the median over blocks below `below` (resident ones,
        with no load to wait for in between); None without such pairs. Twice the forward calls' own time stood in
        for the backward and missed it both ways: on one H200 the forward timed 1.7 ms a block of GPT-2 1.72 B, and
        the step predicted +37%, while on another it timed 1.0 ms.

        `streamed`: blocks above `below` hand their gradients to the host, and the last one's hand-off, which the
        host may queue after the top resident block's recompute has begun, makes the compute stream wait for an
        earlier copy (streams.Transfers.offload): the top resident block's interval is left out, as that wait is
        the link's time, not the block's (the Llama-3-8B shape's median doubled when that wait came in; that it sat in
        this interval is likely, not timed apart)."""
        top = below - 1 if streamed else below
        pairs = [(a, b) for (i, a), (j, b) in zip(self.starts, self.starts[1:]) if j == i - 1 and i < top]
        if not pairs:
            return None
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) / 1e3 for a, b in pairs)


def record_event():
    """A timing CUDA event recorded on the current stream now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
