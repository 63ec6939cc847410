"""Gradient accumulation on the host: each micro-step's landed gradients added into a streamed block's fp32
accumulator, two micro-steps in one pass where the first waited in the spare buffer. A mixin of cpu_optim.CpuOptimizer,
whose kernel it runs; the rules are cpu_optim's docstring's.
"""
from __future__ import annotations

from typing import Optional

import torch

from stronghold.optim.cpu_records import contiguous_ranges
from stronghold.streaming.store import BlockStore, ParamEntry


class Accumulation:
    def _accumulate(self, store: BlockStore, present: list[ParamEntry], first: bool) -> float:
        """Add the landed gradients into the accumulator, after those of the micro-step held in the spare buffer (in
        micro-step order, in one pass where both cover the same parameters); the sum of squares of the whole
        accumulator. A pooled landing buffer goes back to its pool once read."""
        held = store.life.take_held()
        if held is None:
            total = self._add(store, store.grad, present, first)
            if store.pool is not None:
                store.pool.release(store)
            return total
        if [id(e) for e in held.present] == [id(e) for e in present]:
            return self._add(store, store.grad_spare, present, held.first, then=store.grad)
        total = self._add(store, store.grad_spare, held.present, held.first)
        return self._add(store, store.grad, present, False) if present else total

    def _add(self, store: BlockStore, grad: torch.Tensor, present: list[ParamEntry], first: bool,
             then: Optional[torch.Tensor] = None) -> float:
        """accum (zero where `first`) + `grad` (+ `then`, the next micro-step's) over the present parameters."""
        assert store.accum is not None
        total = 0.0
        if first:  # the window starts: parameters without a gradient yet start from zero
            taken = {id(e) for e in present}
            for start, stop in store.local_ranges(contiguous_ranges([e for e in store.trainable if id(e) not in taken])):
                store.accum[start:stop].zero_()
        for start, stop in store.local_ranges(contiguous_ranges(present)):
            if then is None:
                total += self.kernel.accumulate(store.accum[start:stop], grad[start:stop], first=first)
            else:
                total += self.kernel.accumulate2(store.accum[start:stop], grad[start:stop], then[start:stop], first)
        if not first:
            taken = {id(e) for e in present}
            for start, stop in store.local_ranges(contiguous_ranges([e for e in store.trainable if id(e) not in taken])):
                total += self.kernel.sum_squares(store.accum[start:stop])
        return total
