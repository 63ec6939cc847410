"""Compact masters: a bf16 block's fp32 master kept as its low 16 bits only, beside the working copy that already holds
its high half, 2 host bytes a trainable parameter instead of 4 (the planner turns it on where the host cannot hold
the full masters: planning/planner.py).

The working copy is always the master rounded to nearest even (store.py), so the pair (working, low half) is the
master, up to one case: at an exact tie (low half 0x8000) rounding may have gone either way. Splitting never stores
a tie: it moves the master one ulp towards the working copy's value first (the kernel's `split_master`), a change
smaller than the update's own rounding, on about one element in 65536 of those the update writes.

A store with a compact master has `master` None, `master_lo` (int16, its trainable elements) and `tier` this
holder. The CPU AdamW's update runs on the halves in place (the kernel's `step_compact`: one pass, no more bytes
than a full master's step; cpu_optim.py). Every other reader and writer goes through `BlockStore.states()`, as for the
NVMe tier (nvme.py), and gets a staging buffer with the merged fp32 master; leaving a writer's hold splits it back
into the working copy and the low half. So those readers (undo and redo, checkpoints, promotion) are unchanged.

What it excludes: a lean store (its working copy holds gradients between backward and the update, so the high half
would be gone) and weights-first previews (they write the next weights into the working copy before the state
changes: cpu_optim.py skips them for these stores); bf16 only (an fp16 copy is not the master's high half).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from stronghold.optim.adamw_kernel import AdamWKernel
from stronghold.planning.plan_types import COMPACT_STAGING_SLOTS


States = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class CompactMasters:
    def __init__(self, kernel: AdamWKernel, largest_trainable: int, host):
        """`host`: the runtime's pinned.HostMeter, which counts the staging buffer (COMPACT_STAGING_SLOTS: one)."""
        assert COMPACT_STAGING_SLOTS == 1, "one staging buffer, one lock: holds never overlap but on an idle worker"
        self.kernel = kernel
        self._staging = host.empty(largest_trainable, torch.float32)
        self._held = threading.Lock()
        """Taken for a hold's length: a main-thread hold (a checkpoint, a promotion) waits for the worker's."""

    def add(self, store, low: torch.Tensor) -> None:
        """Make a freshly built store compact: `low` holds its master's low halves (`fill`), and its working copy the
        high ones."""
        store.master, store.master_lo, store.tier = None, low, self

    def fill(self, master: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> None:
        """Split an fp32 master into a store's working copy (`high`, bf16) and `low` (int16): at build time, from
        the model's values."""
        self.kernel.split_master(master, high, low)

    @staticmethod
    def _high(store) -> torch.Tensor:
        return store.working[store.shard_start:store.shard_stop]

    @contextlib.contextmanager
    def hold(self, store, write: bool = True) -> Iterator[States]:
        """The block's (master, exp_avg, exp_avg_sq) for the duration, the master merged into a staging buffer;
        split back into the working copy and the low half after if `write`."""
        with self._held:
            master = self._staging[:store.master_lo.numel()]
            self.kernel.merge_master(self._high(store), store.master_lo, master)
            yield master, store.exp_avg, store.exp_avg_sq
            if write:
                self.kernel.split_master(master, self._high(store), store.master_lo)

    def gather(self, store) -> dict[int, States]:
        """Copies of the block's state per trainable entry (by offset), as nvme.NvmeStates.gather gives them."""
        with self.hold(store, write=False) as (master, exp_avg, exp_avg_sq):
            return {e.offset: tuple(t[e.offset:e.offset + e.numel].clone().view(e.shape)
                                    for t in (master, exp_avg, exp_avg_sq)) for e in store.trainable}

    def to_host(self, store, host) -> None:
        """The store's full fp32 master back in host memory (promotion reads it as an ordinary store's)."""
        full = host.empty(store.master_lo.numel(), torch.float32)
        with self.hold(store, write=False) as (master, _, _):
            full.copy_(master)
        store.master, store.master_lo, store.tier = full, None, None

    def expect(self, stores, replace: bool = False) -> None:
        """Nothing to read ahead: the state is in host memory (the NVMe tier's read-ahead hook)."""
