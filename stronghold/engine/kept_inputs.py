"""Where the blockwise backward (blockwise.py) keeps the blocks' inputs between a micro-batch's forward and the
boundary's walk: in page-locked host memory on a GPU, so they do not take the window's room.

Every block's input of every micro-batch, kept on the GPU, is hidden size x tokens x 2 bytes a block and a micro-batch
in bf16: 4.3 GB for an 8 B Llama at accumulation 8 and 2048 tokens, about ten window slots of a 24 GiB card. So each
input goes to the host as the forward produces it (a D2H on a stream of its own, behind the kernel that wrote it; the
device copy is let go once that copy has landed), and the walk brings a block's inputs back while it walks the block
before (an H2D on another stream, which the compute stream waits for before it reads them). The copies are small
beside the block weights the window moves (0.13 GB a block against 0.44 GB for the 8 B shape, once each way a step).

The host copies live in `HostSlots`, reused from one step to the next: torch's pinned allocator would page-lock each
input on its own in the first step (a cudaHostAlloc per block and micro-batch, on the forward's thread) and round each
up to a power of two. Here a forward that finds no free slot of its input's size page-locks one exact-size mapping
for the rest of its blocks (pinned.py), and later steps take the same slots back.

A miss past the first step is a micro-batch longer than those before (a collator that pads each batch to its own
longest sequence): its slots are host memory no plan counted, so a miss checks them against what the host has
available first, and refuses with the fix rather than page-lock the host's last memory (which the kernel answers by
killing the process, or by swapping the optimizer's states).

On a CPU device, or without pinned memory, the inputs stay where they are (`Kept.on_device` is the tensor itself).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from stronghold.planning.plan_types import GIB, KEPT_PENDING as PENDING
from stronghold.streaming.pinned import pinned_empty

ALIGN = 64
"""Slot sizes are rounded up to this many bytes, so a slot serves any dtype and starts on a cache line."""

MARGIN_BYTES = GIB
"""Host memory a miss leaves available beside its slots: the planner's own margin (`default_host_margin`) stands
between the plan, first step's slots included, and the host; this keeps an unplanned miss from taking the last of
it (what the CUDA driver's page-locking and the Python heap still grow by)."""

SLACK = 2
"""A free slot serves an input up to this many times smaller (inputs whose length changes between batches), as
torch's power-of-two rounding would; a smaller input than that gets a slot of its own."""


@dataclass
class Kept:
    """One kept input: on the device until its D2H has landed (`on_device`), then on the host only (`host`)."""

    on_device: Optional[torch.Tensor]
    host: Optional[torch.Tensor] = None
    landed: Optional[torch.cuda.Event] = None
    fetched: Optional[torch.Tensor] = None
    """The walk's device copy, brought back by `prefetch`."""
    ready: Optional[torch.cuda.Event] = None
    slot: Optional[torch.Tensor] = None
    """The `HostSlots` slot `host` views, given back by `KeptInputs.recycle`."""


@dataclass(eq=False)
class _Free:
    slot: torch.Tensor
    stamp: Any
    """What the slot's last copies recorded (None for a fresh one): its next writer waits for it."""
    taken_in: int
    """The window that last took it (or made it)."""


class HostSlots:
    """Byte slots for the kept inputs, reused across windows. `allocate(nbytes)` makes one uint8 buffer (page-locked
    on a GPU); `take` carves a miss's buffer into `ahead` slots of one size, one allocation for a forward's blocks.
    `trim`, once a window is over, lets go the free slots that window never took (sizes no longer asked for).
    `room()`: host bytes that may still be added (None: unchecked), asked on a miss."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], room: Optional[Callable[[], int]] = None):
        self._allocate = allocate
        self._room = room
        self._free: dict[int, list[_Free]] = {}
        """Free slots by size."""
        self._sizes: set[int] = set()
        """The slot sizes allocated so far."""
        self.window = 0
        self.allocations = 0
        self.allocated_bytes = 0

    def take(self, nbytes: int, ahead: int) -> tuple[torch.Tensor, Any]:
        """A slot of at least `nbytes` (uint8) and what its writer must wait for. `ahead`: slots of this size the caller
        expects to take before its next pause (this one included), allocated together on a miss."""
        stride = -(-nbytes // ALIGN) * ALIGN
        exact = self._free.get(stride)
        if exact:  # the usual case: the same size as a step before (a forward takes one per block)
            best = exact.pop()
        else:
            fits = [size for size, free in self._free.items() if free and stride < size <= SLACK * nbytes]
            best = self._free[min(fits)].pop() if fits else None
        if best is not None:
            return best.slot, best.stamp
        ahead = max(1, ahead)
        self._check_room(ahead, stride)
        buffer = self._allocate(ahead * stride)
        self.allocations += 1
        self.allocated_bytes += ahead * stride
        self._sizes.add(stride)
        slots = buffer.view(ahead, stride)
        self._free.setdefault(stride, []).extend(_Free(slots[i], None, self.window) for i in range(1, ahead))
        return slots[0], None

    def _check_room(self, ahead: int, stride: int) -> None:
        if self._room is None:
            return
        need, available = ahead * stride, self._room()
        if need + MARGIN_BYTES <= available:
            return
        held = f"the {self.allocated_bytes / GIB:.2f} GiB of slots held so far"
        if self._sizes and stride not in self._sizes:
            why = f"an input size {held} do not serve: a micro-batch longer than those before"
            fix = "Pad every micro-batch to one length (the longest the run will see, from the first step on), or set"
        else:
            why = f"more inputs of this size than {held}: the host holds less than the plan counted on"
            fix = "Free host memory (other processes, a data loader's workers), or set"
        raise MemoryError(
            f"stronghold: the blockwise backward keeps every block's input of every micro-batch in page-locked host "
            f"memory until the step's backward; this micro-batch's inputs need {need / GIB:.2f} GiB more ({ahead} "
            f"blocks x {stride / 2 ** 20:.1f} MiB, {why}), but the host has {available / GIB:.2f} GiB available and "
            f"{MARGIN_BYTES / GIB:.0f} GiB stays free. {fix} \"blockwise_backward\": false in the stronghold "
            f"section. Nothing was allocated; the micro-batch was not trained and the step's earlier micro-batches "
            f"are kept.")

    def give(self, slot: torch.Tensor, stamp: Any) -> None:
        self._free.setdefault(slot.numel(), []).append(_Free(slot, stamp, self.window))

    def trim(self, settle: Callable[[Any], None]) -> None:
        """The window is over: the free slots it did not take go, once `settle(stamp)` says their copies are done."""
        for size, free in list(self._free.items()):
            for one in free:
                if one.taken_in != self.window and one.stamp is not None:
                    settle(one.stamp)
            kept = [one for one in free if one.taken_in == self.window]
            if kept:
                self._free[size] = kept
            else:
                del self._free[size]
        self.window += 1

    @property
    def free_bytes(self) -> int:
        return sum(one.slot.numel() for free in self._free.values() for one in free)


class KeptInputs:
    def __init__(self, device: torch.device, to_host: bool, room: Optional[Callable[[], int]] = None):
        """`room()`: host bytes the slots may still add (`HostSlots`)."""
        self.device = device
        self.to_host = to_host and device.type == "cuda"
        self._d2h = torch.cuda.Stream(device) if self.to_host else None
        self._h2d = torch.cuda.Stream(device) if self.to_host else None
        self._pending: deque[Kept] = deque()
        self.slots = HostSlots(lambda nbytes: pinned_empty(nbytes, torch.uint8), room)

    def keep(self, tensor: torch.Tensor, ahead: int = 1) -> Kept:
        """`tensor` (a block's input, detached) kept for the walk. `ahead`: inputs of this forward still to come, this
        one included (the slots a miss allocates together)."""
        if not self.to_host:
            return Kept(on_device=tensor)
        nbytes = tensor.numel() * tensor.element_size()
        slot, stamp = self.slots.take(nbytes, ahead)
        kept = Kept(on_device=tensor, host=slot[:nbytes].view(tensor.dtype).view(tensor.shape),
                    landed=torch.cuda.Event(), slot=slot)
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        if stamp is not None:
            self._d2h.wait_event(stamp[1])  # the slot's last H2D has read it (its last D2H ran on this stream)
        with torch.cuda.stream(self._d2h):
            kept.host.copy_(tensor, non_blocking=True)
            kept.landed.record(self._d2h)
        self._pending.append(kept)
        self._let_go(PENDING)
        return kept

    def recycle(self, kept: Iterable[Kept]) -> None:
        """The walk is over with `kept` (or they were dropped): their host slots go back for the next inputs."""
        for one in kept:
            if one.slot is None:
                continue
            stamp = (torch.cuda.Event(), torch.cuda.Event())
            stamp[0].record(self._d2h)
            stamp[1].record(self._h2d)
            self.slots.give(one.slot, stamp)
            one.slot = one.host = None

    def trim(self) -> None:
        """A window is over: free slots it did not use go (after their copies)."""
        self.slots.trim(lambda stamp: (stamp[0].synchronize(), stamp[1].synchronize()))

    def _let_go(self, limit: int) -> None:
        """Drop the device copies whose D2H has landed; wait for the oldest while more than `limit` are left."""
        while self._pending and (len(self._pending) > limit or self._pending[0].landed.query()):
            kept = self._pending.popleft()
            kept.landed.synchronize()
            kept.on_device = None

    def prefetch(self, kept: Kept) -> None:
        """Start bringing `kept` back to the device (before the walk reaches its block)."""
        if kept.on_device is not None or kept.fetched is not None:
            return
        self._h2d.wait_event(kept.landed)
        with torch.cuda.stream(self._h2d):
            kept.fetched = kept.host.to(self.device, non_blocking=True)
            kept.ready = torch.cuda.Event()
            kept.ready.record(self._h2d)

    def get(self, kept: Kept) -> torch.Tensor:
        """The input on the device, for the walk's compute stream."""
        if kept.on_device is not None:
            return kept.on_device
        self.prefetch(kept)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(kept.ready)
        # Made on the H2D stream, read and freed on the compute stream.
        kept.fetched.record_stream(compute)
        return kept.fetched

    def release(self, kept: Kept) -> None:
        """The walk is done with `kept`'s block: its device copy goes (the host one stays until the walk ends)."""
        kept.fetched = kept.ready = None

    def on_device_bytes(self, kept: Kept) -> int:
        tensor = kept.on_device if kept.on_device is not None else kept.fetched
        return 0 if tensor is None else tensor.untyped_storage().nbytes()
