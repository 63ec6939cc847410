"""The hand-off of a streamed block's (or a cached unit's, cached.py) gradients to the host: a mixin of
runtime.StrongholdRuntime, whose state it reads and moves (the per-block `MicroState`, the stores, the CPU optimizer,
the transfers, the window).

Once backward has produced every gradient of a block (`grad_arrived`), the block's gradients go to the host and to
the CPU optimizer, one step after the other: take the block's host gradient buffer (`CpuOptimizer.take_grad_buffer`,
which waits until the CPU has read what the last copy left there), copy the gradients into it (`Transfers.offload`;
with data parallel after the reduction across ranks), then record and queue the job that accumulates or applies them
(`CpuOptimizer.submit_grads`). With accumulation on the GPU (device_accum.py) only the boundary hands over, the
window's sum.

An exception can stop this between any two of those steps (a failed copy, a Ctrl-C the script catches, a failed
job). The buffer is noted as taken before it is claimed, and `CpuOptimizer.abort` (cpu_rollback.py), run by
`abort_backward`, gives back every buffer taken in the micro-step and restores every step count and accumulator it
touched, however far the hand-off got: so the next backward never waits for a buffer that no job will release.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from stronghold.streaming.cached import INDEX_OF
from stronghold.streaming.device_accum import sum_of_squares


class GradientHandOff:
    def grad_arrived(self, index: int, entry) -> None:
        if self.blockwise is not None:
            if self.blockwise.walking:
                return  # the walk sums each micro-batch's gradients itself (blockwise_walk.py)
            if index == INDEX_OF["input"]:
                raise ValueError(f"stronghold: {entry.name}, of the cached input part, got a gradient outside the "
                                 "blockwise backward's walk (tied to the head?); set \"rest_placement\" to \"gpu\" or "
                                 "\"blockwise_backward\" to false")
        state, store = self.micro[index], self._store(index)
        if state.offloaded:
            raise RuntimeError(f"{entry.name} received a gradient after block {index}'s gradients were offloaded; "
                               "stronghold needs each block to run once per forward")
        if not entry.grad_this_micro:
            entry.grad_this_micro = entry.grad_this_window = True
            state.arrived += 1
        if state.arrived == len(store.trainable):
            self._offload(index)

    def _offload(self, index: int) -> None:
        store = self._store(index)
        present = [e for e in store.trainable if e.grad_this_micro]
        if self.device_accum is not None and index >= 0:  # a cached unit accumulates on the host (cached.py)
            self._offload_window_sum(index, present)
        else:
            self._offload_grads(index, present)
        self._offloaded(index, bool(present))

    def _offloaded(self, index: int, present: bool) -> None:
        """Block `index`'s gradients of this micro-step (`present`: it had some) are handed over."""
        state, store = self.micro[index], self._store(index)
        state.offloaded = True
        state.accum_started = present or state.accum_started
        if self.boundary:
            state.accum_started = False
            for entry in store.trainable:
                entry.grad_this_window = False
        if index >= 0:
            self.window.release(index)

    def _offload_grads(self, index: int, present: list) -> None:
        """This micro-step's gradients of the block to the host, for the CPU to accumulate or apply."""
        state, store = self.micro[index], self._store(index)
        if present:
            self.cpu.take_grad_buffer(store)  # the CPU may still read the previous micro-step's gradients
            grads = [e.param.grad for e in present]
            if self.data_parallel is not None:
                # Averaged over ranks and scattered on the device before the D2H of this rank's shard (which
                # waits for it, not the compute stream); the sum of squares is the shard's.
                finish = self.data_parallel.reduce_block(store, present, grads)
                self.transfers.offload_after(finish, store.grad, store.grad_sq, self.landed[index])
            else:
                # The block's sum of squares, on the device while backward goes on: it travels with the
                # gradients and lets the CPU decide early vs deferred before touching the block's state. With
                # host accumulation the CPU sums the squares of the accumulated gradient itself (cpu_optim
                # _accumulate), so the device's would go unread: five calls less on the launching thread a block.
                sq = None if store.accum is not None else torch.stack(
                    torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
                destinations = store.grad_destinations()
                self.transfers.offload([(g, destinations[e.offset]) for g, e in zip(grads, present)], sq,
                                       store.grad_sq, self.landed[index])
            for entry in present:
                entry.param.grad = None
        self.cpu.submit_grads(store, present, self.landed[index], self.boundary, not state.accum_started)

    def _offload_window_sum(self, index: int, present: list) -> None:
        """Gradient accumulation on the GPU (device_accum.py): a non-boundary micro-step keeps the gradients
        for `end_backward`'s fold; the boundary sends the window's fp32 sum down, once, for the update."""
        state = self.micro[index]
        if not self.boundary:
            self.device_accum.hold(index, present, state.accum_started)
            return
        self._send_window_sum(index, self.device_accum.window_sum(index, present, state.accum_started))

    def _send_window_sum(self, index: int, summed, landing: Optional[list] = None,
                         unpack: Optional[Callable[[], None]] = None) -> None:
        """At the boundary: the window's gradient of block (or unit) `index`, (an fp32 sum on the device, its sum of
        squares) or None where it got none, to the host in one D2H; the update takes the entries that got one.
        `landing`: (device tensor, host destination) pairs in place of the sum into the gradient buffer, and `unpack`
        what writes them into it on the CPU before the update reads it (a table's rows: embedding_rows.py)."""
        store = self._store(index)
        if summed is not None:
            self.cpu.take_grad_buffer(store)
            total, sq = summed
            pieces = landing or [(total, store.grad[:total.numel()])]
            self.transfers.offload(pieces, sq, store.grad_sq, self.landed[index])
        window = [e for e in store.trainable if e.grad_this_window]
        # Every gradient of the window is in the one sum: the CPU takes it as a block without accumulation.
        self.cpu.submit_grads(store, window, self.landed[index], True, True, window_sum=True, unpack=unpack)

    def offload_block_sum(self, index: int, total, window: list) -> None:
        """The blockwise backward (blockwise.py), at the boundary: block (or cached input part) `index`'s gradient over
        the whole window (`window`: the entries that got one), an fp32 sum on the device or None, handed over as
        gradient accumulation on the GPU hands its sums over."""
        for entry in window:
            entry.grad_this_window = True
        self._send_window_sum(index, None if total is None else (total, sum_of_squares(total)))
        self._offloaded(index, False)

    def offload_rows_sum(self, index: int, rows, distinct, total) -> None:
        """`offload_block_sum` for a cached input table (`index`) whose gradient is the fp32 sums `total` of the
        window's rows `distinct` (embedding_rows.py)."""
        store, count = self._store(index), len(distinct)
        rows.entry.grad_this_window = True
        landing = list(zip((total, distinct), rows.landing(count)))
        self._send_window_sum(index, (total, sum_of_squares(total)), landing, lambda: rows.write(store.grad, count))
        self._offloaded(index, False)
