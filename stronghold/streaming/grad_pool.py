"""Pooled gradient landing buffers: with gradient accumulation on the host, the streamed blocks share a few landing
buffers instead of one each (2 host bytes a parameter in bf16), where the plan fits host memory in no other way
(planning/planner.py, after compact masters).

A block's gradients only pass through its landing buffer: the CPU adds them into the block's fp32 accumulator as soon
as they land (cpu_optim.py), and the update reads the accumulator. So a buffer is needed from the block's D2H until
that sum, and a few, each the size of the largest block, serve every block in turn: `acquire` (the thread running
backward, before the D2H; it waits while every buffer is in use, which is the cost: backward can run only that many
blocks ahead of the CPU's sums) points the store's `grad` at a free buffer, and `release` (the CPU worker, once the
sum has read it) takes it back. Such a store has `pool` set, and `grad` None between the two.

What it gives up: a backward that fails after a block's gradients were summed cannot take them back out of the
accumulator (the buffer has moved on to another block), so the accumulation window's sums are lost, and the step at
its boundary is skipped with a warning (cpu_rollback.py), like a step with a non-finite gradient.
"""
from __future__ import annotations

import threading

import torch

from stronghold.planning.plan_types import GRAD_POOL_BUFFERS
from stronghold.streaming.flag import Flag


class GradPool:
    def __init__(self, largest_trainable: int, dtype: torch.dtype, pin: bool, host, buffers: int = GRAD_POOL_BUFFERS):
        """`host`: the runtime's pinned.HostMeter, which counts the buffers."""
        self._free = [host.empty(largest_trainable, dtype, pin) for _ in range(buffers)]
        self._lent: dict[int, torch.Tensor] = {}
        """Each buffer in use, by id() of the store that has it."""
        self._lock = threading.Lock()
        self.available = Flag()
        """Set while a buffer is free: `acquire`'s caller waits for it (bounded by the stall timeout)."""
        self.available.set()

    def acquire(self, store) -> None:
        """Point the store's `grad` at a free buffer. Only the thread running backward acquires, after `available`:
        the worker only gives buffers back, so one is still free here."""
        with self._lock:
            buffer = self._lent[id(store)] = self._free.pop()
            if not self._free:
                self.available.clear()
        store.grad = buffer[:store.trainable_numel]

    def release(self, store) -> None:
        """Take the store's buffer back (its gradients were read); a store without one is left as it is."""
        with self._lock:
            buffer = self._lent.pop(id(store), None)
            if buffer is None:
                return
            store.grad = None
            self._free.append(buffer)
            self.available.set()
