"""The working window: which streamed block owns which GPU slot, and moving blocks in and out.

Correctness never depends on the prefetch policy: `enter(block)` loads a block on demand when it is
not there, waiting for its CPU update if needed. The schedule only decides what to load early.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from stronghold.engine.ranges import timed
from stronghold.streaming.flag import Flag
from stronghold.streaming.schedule import Phase, WindowSchedule
from stronghold.streaming.lifecycle import Residency
from stronghold.streaming.store import BlockStore
from stronghold.streaming.streams import Slot, Transfers


@dataclass
class WindowStats:
    """Counters since the last reset (telemetry reads and resets them)."""

    loads: int = 0
    demand_loads: int = 0
    """Loads the prefetcher had not issued by the time the block was needed (a stall on the GPU)."""
    reused: int = 0
    """Blocks taken back from a released slot that still held their current weights (no copy)."""
    wait_cpu_s: float = 0.0
    """Host time blocked waiting for a block's CPU update before its H2D could start."""


class Window:
    def __init__(self, stores: dict[int, BlockStore], schedule: WindowSchedule, transfers: Transfers,
                 wait: Callable[[Flag, str], object] = lambda event, what: event.wait(), shared=None):
        self.stores = stores
        self.wait = wait
        """Waits for a CPU-optimizer event; the runtime passes CpuOptimizer.wait, which raises if the
        optimizer failed where a plain wait would hang."""
        self.schedule = schedule
        self.transfers = transfers
        self.slots: list[Slot] = transfers.slots
        self.slot_by_storage = {slot.buffer.untyped_storage().data_ptr(): slot for slot in self.slots}
        self._loaded_into: dict[int, Slot] = {}
        """Block -> the slot of its latest load: the only one that can still hold its current weights."""
        self.phase = Phase.FORWARD
        self.training = True
        self.current: Optional[int] = None
        self.stats = WindowStats()
        self.shared = shared
        """shared_host.NodeSharedCopy with data parallel: a block's working copy is also written by the other
        local ranks, so a load waits for their updates of it too (its `wait`), a prefetch skips it (`ready`)."""
        self._frozen_held: Optional[int] = None
        """A block released in backward that has frozen weights: kept in its slot until the next block is entered
        (`release`)."""

    def begin(self, phase: Phase, training: bool, prefetch: bool = True) -> None:
        """A walk starts: prefetch its first blocks (those whose weights are final), unless told it runs no block
        (`prefetch` False: a forward whose blocks ran ahead, engine/block_major.py)."""
        self.end_walk()
        self.phase, self.training, self.current = phase, training, None
        if prefetch:
            self.prefetch(self.schedule.start(phase))

    def end_walk(self) -> None:
        """Nothing of the walk runs any more: a block held for its frozen weights goes (`release`)."""
        held, self._frozen_held = self._frozen_held, None
        if held is not None:
            self._let_go(self.stores[held])

    def reset_stats(self) -> None:
        self.stats = WindowStats()

    def reset(self) -> None:
        """After a failed backward: nothing is running, every slot may be reused."""
        self.end_walk()
        for slot in self.slots:
            slot.pinned = False
        self.phase, self.current = Phase.FORWARD, None

    def enter(self, block: int) -> None:
        """`block` is about to run: make it resident, order compute after its H2D, prefetch ahead."""
        self.current = block
        # Blocks run one at a time: whatever ran before may be evicted now (in backward a block has
        # no exit hook, and one without trainable parameters never reports its gradients).
        self.end_walk()
        for other in self.slots:
            other.pinned = False
        slot = self.ensure(block)
        slot.pinned = True
        self.prefetch(self.schedule.lookahead(self.phase, block, self.training))

    def exit_forward(self, block: int) -> None:
        store = self.stores[block]
        if store.life.slot is None:
            return
        slot = self.slots[store.life.slot]
        slot.pinned = False
        if not self.schedule.keep_after_forward(block, self.training):
            # The bytes stay for a cheap reuse: forwards with no backward between them (the blockwise backward's
            # micro-steps, evaluation) find the blocks the last one left, as far as no other block took their slot.
            self._evict(slot, keep_bytes=True)

    def release(self, block: int) -> None:
        """Done with the block's trainable weights for this walk (its gradients are out): its slot may
        be reused. The slot keeps the bytes until another block is loaded into it, so a frozen weight
        of the block that backward still reads (`frozen_view`) costs no reload; a block with frozen weights
        is held a little longer in backward (below)."""
        store = self.stores[block]
        if store.life.slot is None:
            return
        if self.phase is Phase.BACKWARD and store.trainable_numel < store.numel:
            # Its frozen weights may still be read by the rest of its backward (e.g. an input norm's weight
            # in the input gradient), and activation checkpointing's recompute saved them as the parameters
            # themselves, which pointing the parameters back at the host would move off the device: the block
            # stays in its slot, pinned, until the next block is entered (its backward is then over) or the
            # walk ends.
            self.end_walk()
            self._frozen_held = block
            return
        self._let_go(store)

    def _let_go(self, store: BlockStore) -> None:
        """Unpin the block's slot and evict it, the bytes kept for a cheap reuse."""
        if store.life.slot is not None:
            slot = self.slots[store.life.slot]
            slot.pinned = False
            self._evict(slot, keep_bytes=True)

    def frozen_view(self, block: int, offset: int, size: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
        """A frozen weight of `block` on the device. Frozen ranges are never written by the optimizer,
        so they can be read whatever the block's update is doing: from the slot that last held the
        block if no other block has been loaded into it since, else by a copy of just that range
        (never waiting for the CPU update, which may not finish before step())."""
        store = self.stores[block]
        for slot in self.slots:
            if slot.last_owner == block:
                return slot.buffer.as_strided(size, stride, offset)
        end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        chunk = store.working[offset:end].to(self.transfers.device, non_blocking=True)
        return chunk.as_strided(size, stride, 0)

    def ensure(self, block: int) -> Slot:
        """The slot holding the current weights of `block`, loading them if needed; compute may use it."""
        store = self.stores[block]
        slot = self._holding(store) or self._reuse(store)
        if slot is None:
            slot = self._take_slot(block, demand=True)
            assert slot is not None, "every slot is pinned; a window of >= 2 slots cannot run out"
            self.stats.demand_loads += 1
            self._load(store, slot)
        if store.life.residency is Residency.IN_FLIGHT:
            self.transfers.wait_ready(slot)
            store.life.arrived()
        return slot

    def prefetch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            store = self.stores[block]
            if self._holding(store) is not None or self._reuse(store) is not None:
                continue
            if not store.life.updated.is_set() or (self.shared is not None and not self.shared.ready(block)):
                continue  # its CPU update is still running; never block the launching thread for a prefetch
            slot = self._take_slot(block, demand=False)
            if slot is None:
                return
            self._load(store, slot)

    def _holding(self, store: BlockStore) -> Optional[Slot]:
        if store.life.slot is None:
            return None
        slot = self.slots[store.life.slot]
        if slot.owner == store.index and slot.owner_version == store.life.version:
            return slot
        return None

    def _cached(self, slot: Slot) -> bool:
        """A released slot whose bytes are still its last owner's current weights."""
        return (slot.owner is None and slot.last_owner is not None
                and slot.last_version == self.stores[slot.last_owner].life.version)

    def _reuse(self, store: BlockStore) -> Optional[Slot]:
        """Take back a released slot that still holds the block's current weights: the walk after a backward
        of gradient accumulation finds the blocks that backward used last (the first of the next forward)
        still there, and with W slots only the other S - W blocks are copied in each direction."""
        slot = self._loaded_into.get(store.index)  # looked up, not searched: this runs on every block entry
        if slot is None or slot.last_owner != store.index or not self._cached(slot):
            return None
        slot.owner, slot.owner_version = store.index, store.life.version
        store.life.loading(slot.index)  # its last load's ready event still orders compute after it
        self._point_at(store, slot)
        self.stats.reused += 1
        return slot

    def _take_slot(self, block: int, demand: bool) -> Optional[Slot]:
        empty = [s for s in self.slots if s.owner is None and not self._cached(s)]
        if empty:
            return empty[0]
        # Released slots that still hold a block's current weights are victims like occupied ones: the
        # one needed furthest in the future goes first.
        candidates = {s.last_owner: s for s in self.slots if self._cached(s)}
        candidates.update({s.owner: s for s in self.slots if s.owner is not None and not s.pinned})
        stale = [s for s in candidates.values()
                 if s.owner is not None and s.owner_version != self.stores[s.owner].life.version]
        if stale:
            return stale[0]
        victim = self.schedule.victim(self.phase, self.current, candidates, self.training)
        if victim is None:
            return None
        if not demand:
            # Prefetch only displaces a block needed later than the one being fetched.
            distance = self.schedule.distance
            if distance(self.phase, self.current, victim, self.training) <= distance(
                    self.phase, self.current, block, self.training):
                return None
        return candidates[victim]

    def _evict(self, slot: Slot, keep_bytes: bool = False) -> None:
        if slot.owner is None:
            return
        victim = self.stores[slot.owner]
        if victim.life.slot == slot.index:
            victim.point_params_at(victim.working)
            victim.life.evicted()
        slot.last_owner = slot.owner if keep_bytes else None
        slot.owner, slot.owner_version = None, -1

    def _load(self, store: BlockStore, slot: Slot) -> None:
        self._evict(slot)
        if not store.life.updated.is_set():
            self.stats.wait_cpu_s += timed("wait_cpu_update", lambda: self.wait(
                store.life.updated, f"the CPU update of block {store.index} before its load"))
        if self.shared is not None and not self.shared.ready(store.index):
            self.stats.wait_cpu_s += timed("wait_cpu_update", lambda: self.shared.wait(store.index))
        self.transfers.load(slot, store.working)
        slot.owner, slot.owner_version, slot.last_owner = store.index, store.life.version, store.index
        slot.last_version = store.life.version
        self._loaded_into[store.index] = slot
        store.life.loading(slot.index)
        self._point_at(store, slot)
        self.stats.loads += 1

    @staticmethod
    def _point_at(store: BlockStore, slot: Slot) -> None:
        views = slot.views.get(store.index)
        if views is None:
            views = slot.views[store.index] = store.param_views(slot.buffer)
        store.point_params_to(views)

    def slot_of_tensor(self, tensor: torch.Tensor) -> Optional[Slot]:
        """The slot a tensor's memory belongs to (None for anything else)."""
        return self.slot_by_storage.get(tensor.untyped_storage().data_ptr())

    def evict_all(self) -> None:
        """Put every block back on the host (e.g. before a checkpoint reads the host copies)."""
        for slot in self.slots:
            slot.pinned = False
            self._evict(slot)
        self.forget_cached()

    def forget_cached(self) -> None:
        """No released slot may be taken back from now on (at each optimizer step and whenever the host copies
        may be read or written from outside, e.g. a state_dict load): reuse is for the micro-steps of one
        accumulation window, where nothing but the window touches the weights."""
        for slot in self.slots:
            slot.last_version = -1
