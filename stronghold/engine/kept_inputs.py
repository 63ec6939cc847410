"""Where the blockwise backward (blockwise.py) keeps the blocks' inputs between a micro-batch's forward and the
boundary's walk: in page-locked host memory on a GPU, so they do not take the window's room.

Every block's input of every micro-batch, kept on the GPU, is hidden size x tokens x 2 bytes a block and a micro-batch
in bf16: 4.3 GB for an 8 B Llama at accumulation 8 and 2048 tokens, about ten window slots of a 24 GiB card. So each
input goes to the host as the forward produces it (a D2H on a stream of its own, behind the kernel that wrote it; the
device copy is let go once that copy has landed), and the walk brings a block's inputs back while it walks the block
before (an H2D on another stream, which the compute stream waits for before it reads them). The copies are small
beside the block weights the window moves (0.13 GB a block against 0.44 GB for the 8 B shape, once each way a step).

On a CPU device, or without pinned memory, the inputs stay where they are (`Kept.on_device` is the tensor itself).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from stronghold.planning.plan_types import KEPT_PENDING as PENDING


@dataclass
class Kept:
    """One kept input: on the device until its D2H has landed (`on_device`), then on the host only (`host`)."""

    on_device: Optional[torch.Tensor]
    host: Optional[torch.Tensor] = None
    landed: Optional[torch.cuda.Event] = None
    fetched: Optional[torch.Tensor] = None
    """The walk's device copy, brought back by `prefetch`."""
    ready: Optional[torch.cuda.Event] = None


class KeptInputs:
    def __init__(self, device: torch.device, to_host: bool):
        self.device = device
        self.to_host = to_host and device.type == "cuda"
        self._d2h = torch.cuda.Stream(device) if self.to_host else None
        self._h2d = torch.cuda.Stream(device) if self.to_host else None
        self._pending: deque[Kept] = deque()

    def keep(self, tensor: torch.Tensor) -> Kept:
        """`tensor` (a block's input, detached) kept for the walk."""
        if not self.to_host:
            return Kept(on_device=tensor)
        kept = Kept(on_device=tensor, host=torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True),
                    landed=torch.cuda.Event())
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            kept.host.copy_(tensor, non_blocking=True)
            kept.landed.record(self._d2h)
        self._pending.append(kept)
        self._let_go(PENDING)
        return kept

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
