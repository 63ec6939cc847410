"""A streamed block's lifecycle: where its weights, gradients and fp32 states are, and who may touch them now.

Each block's `BlockStore` (store.py) holds the buffers; its `BlockLife` (`store.life`) holds the state below, and
only the named transitions of this module change it. Readers look at the fields directly (`updated.is_set()`,
`wait(updated)`, `residency is`, `version ==`). The transitions run on the thread that launches the GPU work (the
window, the gradient hand-off, step()) or on the CPU optimizer's worker; the two `Flag`s are what those threads
hand each other, and a `Flag` can be set and waited for across them (flag.py).

Weights: the host working copy.
- `version`: bumped whenever the weights change, so a GPU copy made of an older version (a window slot: its
  `owner_version`; a cached unit: its `loaded_version`) is stale and is loaded again instead of used.
- `updated`: set while the working copy holds the final weights of the latest step, so an H2D may read it; a load
  waits for it, a prefetch skips a block without it.
- `update_begins()`: the block's update is on its way (the accumulation boundary hands its gradients over, or a redo
  or undo job will rewrite weights it already wrote): version + 1, since every GPU copy is stale from now on, and
  `updated` cleared, since no load may read the working copy before the job has written it.
- `update_done()`: the job wrote the final weights (or step() confirmed an early update's): `updated` set.
- `weights_replaced()`: version + 1 alone, for weights rewritten while no update runs on the block (a checkpoint
  load, a skipped or aborted step's restore): the GPU copies are stale, the working copy is readable.
- `settled()`: `update_done()` and `grads_released()` at once: the block's CPU work of the step is over. Idempotent:
  the abort path settles every block of the failed micro-step, wherever each one stopped.

Gradients: the host gradient buffer `grad` (and, with host accumulation, `grad_spare`).
- `grad_free`: set while the CPU is done with `grad`, so the next D2H may overwrite it.
- `grads_claimed()`: `grad_free` cleared: the runtime claims the buffer for a D2H, or a redo or undo job will read
  the gradients in it again. `grads_released()`: set, once the CPU has read them.
- `held`: the cpu_records.MicroAccum whose gradients wait in `grad_spare` to be added with the next micro-step's
  (cpu_optim.py): `hold(micro)` parks them, `take_held()` hands them to the next sum, `drop_held(micro)` forgets
  them when their micro-step is aborted.

GPU copy: the window's slot (window.py).
- `residency`, `slot`: HOST (no slot) --`loading(slot)`--> IN_FLIGHT --`arrived()`--> RESIDENT, and from either
  `evicted()` back to HOST. IN_FLIGHT: an H2D into the slot was issued (or a released slot still holding the block's
  weights was taken back: its last load's ready event still orders compute after it), so compute must wait on the
  slot's ready event; RESIDENT: the compute stream has waited, and the next use need not. A slot's copy being
  current is `version`'s matter, not residency's.

Host states: where a sharded or NVMe block's full fp32 state is.
- `gathered`: per trainable entry (by offset), private fp32 master, exp_avg, exp_avg_sq of the entry's shape, while
  a checkpoint save, the state dict or a promotion holds them (one block at a time); None otherwise, when each rank
  holds only its shard (or the drive holds the state). `gather(states)` / `release_gathered()`.
"""
from __future__ import annotations

import enum
from typing import Optional

import torch

from stronghold.streaming.flag import Flag

EntryStates = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""A gathered block: per trainable entry (by offset) its full fp32 master, exp_avg, exp_avg_sq (the moments None where
only the master was gathered: sharding.gather_block)."""


class Residency(enum.Enum):
    HOST = "host"            # weights only in host memory
    IN_FLIGHT = "in_flight"  # H2D issued into a slot; compute must wait on the slot's ready event
    RESIDENT = "resident"    # in a slot and the compute stream already waited for it


class BlockLife:
    """One block's weights, gradient buffer, GPU copy and host states, changed only by the transitions below (see the
    module docstring). A new block is on the host, not being updated, with its gradient buffer free."""

    __slots__ = ("version", "updated", "grad_free", "held", "residency", "slot", "gathered")

    def __init__(self):
        self.version = 0
        self.updated = Flag()
        self.updated.set()
        self.grad_free = Flag()
        self.grad_free.set()
        self.held: Optional[object] = None
        self.residency = Residency.HOST
        self.slot: Optional[int] = None
        self.gathered: Optional[EntryStates] = None

    # Weights.
    def update_begins(self) -> None:
        self.version += 1
        self.updated.clear()

    def update_done(self) -> None:
        self.updated.set()

    def weights_replaced(self) -> None:
        self.version += 1

    def settled(self) -> None:
        self.update_done()
        self.grads_released()

    # Gradient buffer.
    def grads_claimed(self) -> None:
        self.grad_free.clear()

    def grads_released(self) -> None:
        self.grad_free.set()

    def hold(self, micro: object) -> None:
        self.held = micro

    def take_held(self) -> Optional[object]:
        held, self.held = self.held, None
        return held

    def drop_held(self, micro: object) -> None:
        if self.held is micro:
            self.held = None

    # GPU copy.
    def loading(self, slot: int) -> None:
        self.slot, self.residency = slot, Residency.IN_FLIGHT

    def arrived(self) -> None:
        assert self.residency is Residency.IN_FLIGHT, f"only a block in flight arrives, not one {self.residency.value}"
        self.residency = Residency.RESIDENT

    def evicted(self) -> None:
        assert self.slot is not None, "only a block in a slot can be evicted"
        self.slot, self.residency = None, Residency.HOST

    # Host states.
    def gather(self, states: Optional[EntryStates]) -> None:
        self.gathered = states

    def release_gathered(self) -> None:
        self.gathered = None
