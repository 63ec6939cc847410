"""Side streams, events and the GPU slot pool: who waits on what.

Two side streams: H2D (weights into slots) and D2H (gradients out). Ordering is by CUDA events
only, never a device-wide synchronize: compute waits for a slot's `ready` event; the H2D into a
slot waits for its `free` event; the D2H of a block's gradients waits for the event recorded
after its backward. On the CPU (CI), transfers are plain copies and events are already complete,
so the same engine code runs and is tested there.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from stronghold.planning.plan_types import STREAMED_GRADS_IN_FLIGHT


def indexed(device: torch.device) -> torch.device:
    """`device` with its index: an unindexed CUDA device means the caller's current one. For a thread's use, taken on
    the thread that names the device (a new thread's current device is the first GPU)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DoneEvent:
    """Stand-in for a CUDA event on the CPU: every copy has already finished when it is 'recorded'."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass
class Slot:
    """One flat GPU buffer of the window. Events are producer -> consumer."""

    index: int
    buffer: torch.Tensor
    ready: object
    """H2D stream -> compute stream: the owner's weights have landed in `buffer`."""
    free: object
    """Compute stream -> H2D stream: every kernel that read the previous owner is enqueued before it."""
    owner: Optional[int] = None
    owner_version: int = -1
    last_owner: Optional[int] = None
    """The block whose bytes the buffer holds (the owner, or a released block not overwritten since)."""
    last_version: int = -1
    """The version of `last_owner` those bytes are: while it is the block's current version (no update
    since, e.g. between the micro-steps of gradient accumulation) the block can take the slot back
    without a copy (window.py)."""
    pinned: bool = False
    """The owner is running (between its block's entry and exit); never evict a pinned slot."""
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Block -> its parameters' views of `buffer` (store.point_params_at), made at the block's first load here."""


@dataclass
class Transfers:
    """The streams and the copy operations of one device."""

    device: torch.device
    h2d_stream: Optional[torch.cuda.Stream] = None
    d2h_stream: Optional[torch.cuda.Stream] = None
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    slots: list[Slot] = field(default_factory=list)
    produced: Optional[torch.cuda.Event] = field(default=None, repr=False)
    """The compute stream's mark that a D2H waits for. One event serves every offload: a stream's wait_event takes
    the event's state when called, so re-recording it later changes no wait already queued (and saves making an
    event a block a micro-step on the thread that launches the GPU work)."""
    held: deque = field(default_factory=deque, repr=False)
    """(landed event, gradients) of the compute stream's offloads whose memory is not yet given back: see `offload`."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def __post_init__(self):
        if self.is_cuda:
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
            self.produced = torch.cuda.Event()

    def event(self):
        return torch.cuda.Event() if self.is_cuda else DoneEvent()

    def allocate_slots(self, count: int, numel: int, dtype: torch.dtype) -> None:
        self.slots = [Slot(i, torch.empty(numel, dtype=dtype, device=self.device), self.event(), self.event())
                      for i in range(count)]

    def reset_stats(self) -> None:
        self.h2d_bytes = self.d2h_bytes = 0

    def free_slots(self) -> None:
        """Drop the slots (their memory returns to the device's allocator once no window refers to them)."""
        self.slots = []

    def load(self, slot: Slot, source: torch.Tensor) -> None:
        """Copy a block's working copy into a slot; compute must `wait_ready(slot)` before using it."""
        n = source.numel()
        if not self.is_cuda:
            slot.buffer[:n].copy_(source)
            self.h2d_bytes += n * source.element_size()
            return
        # Everything enqueued on the compute stream so far may still read the previous owner.
        slot.free.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(slot.free)
            slot.buffer[:n].copy_(source, non_blocking=True)
            slot.ready.record(self.h2d_stream)
        self.h2d_bytes += n * source.element_size()

    def wait_ready(self, slot: Slot) -> None:
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)

    def offload(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], sq: Optional[torch.Tensor],
                sq_destination: torch.Tensor, done) -> None:
        """Copy gradients (tensor, its host destination: a view of the same shape) and their sum of squares `sq`
        (a 0-d fp32 tensor on the device, or None where the host computes it), produced on the compute stream, to
        the host; record `done` when they have landed.

        The gradients' memory goes back to the compute stream in its own order, never more than
        STREAMED_GRADS_IN_FLIGHT blocks' at once (the planner's count): before this block's copies, the compute
        stream is made to wait for the previous offload's and that one's references are dropped. `record_stream`
        would return it only once the allocator, on the host, sees the copy done: with the D2H behind (a large
        model's backward makes gradients faster than the link takes them), gigabytes were freed but not reusable,
        over the plan, and paid for by allocation retries that synchronize the device."""
        if not self.is_cuda:
            self._copy_to_host(pieces, sq, sq_destination, done)
            return
        compute = torch.cuda.current_stream(self.device)
        while len(self.held) >= STREAMED_GRADS_IN_FLIGHT - 1:
            landed, _ = self.held.popleft()
            compute.wait_event(landed)
        self.produced.record(compute)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(self.produced)
            read = self._copy_to_host(pieces, sq, sq_destination, done)
        # `done` is the block's own event, recorded again only at its next offload, which pops this entry first.
        self.held.append((done, read))

    def _copy_to_host(self, pieces, sq, sq_destination, done, record: bool = False) -> list[torch.Tensor]:
        """The copies; returns the tensors they read. `record`: the caller drops those right away, so the allocator
        must not hand out their memory before the copies have read it (`record_stream`)."""
        read = [grad for grad, _ in pieces] + ([sq] if sq is not None else [])
        for grad, destination in pieces:
            destination.copy_(grad, non_blocking=self.is_cuda)
            self.d2h_bytes += grad.numel() * grad.element_size()
        if sq is not None:
            sq_destination.copy_(sq.reshape(1), non_blocking=self.is_cuda)
        if record:
            for tensor in read:
                tensor.record_stream(self.d2h_stream)
        done.record(self.d2h_stream)
        return read

    def release_held(self) -> None:
        """The gradients `offload` still holds (the last block's of a backward) go back to the allocator, which
        hands their memory out again once their copies have landed: the next forward need not wait for them."""
        while self.held:
            _, tensors = self.held.popleft()
            for tensor in tensors:
                tensor.record_stream(self.d2h_stream)

    def wait_offloads(self) -> None:
        """Every gradient copy issued so far has landed (an aborted micro-step's, before its buffers are given back;
        the D2H stream only, not the device)."""
        if self.is_cuda:
            self.d2h_stream.synchronize()
            self.held.clear()

    def offload_after(self, finish: Callable[[], tuple[list[tuple[torch.Tensor, int]], torch.Tensor]],
                      destination: torch.Tensor, sq_destination: torch.Tensor, done) -> None:
        """`offload` of the pieces (tensor, offset into the flat `destination`) and sum of squares that `finish`
        returns, run in the D2H stream's order after everything the compute stream enqueued so far: e.g. the
        tail of an asynchronous all-reduce (data_parallel.py), which the compute stream then never waits for."""
        def flat(pieces):
            return [(t.reshape(-1), destination[o:o + t.numel()]) for t, o in pieces]

        if not self.is_cuda:
            pieces, sq = finish()
            self.offload(flat(pieces), sq, sq_destination, done)
            return
        produced = self.produced
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(produced)
            # Now the current stream: the copies follow `finish`'s kernels in order.
            pieces, sq = finish()
            self._copy_to_host(flat(pieces), sq, sq_destination, done, record=True)
