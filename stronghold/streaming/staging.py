"""Pageable host tensors onto the GPU through two pinned buffers, for the promotion's moves (planning/promotion.py).

A block's fp32 master and moments live in pageable memory (only DMA buffers are pinned: store.py), and a plain
`.to("cuda")` of pageable memory goes through the driver's own staging, one CPU thread copying: 5-6 GB/s on an H200
host, so promoting a 2.70 B Llama's blocks cost 0.3-0.4 s at the first forward and again after the first step. Here
the rank's torch threads copy each chunk into a pinned buffer while the chunk before it crosses the link, the two
buffers taking turns: 0.18-0.19 s at that first forward on an H200 host. Only while the CPU has nothing else to do
(`staged`): after the first step the CPU optimizer's deferred updates run beside the promotion, and the staged
copies, competing with them for cores and memory bandwidth, took 0.72-0.79 s where the driver's took 0.40 s. The
copies run on the caller's current stream; a buffer is refilled only after its copy out has finished (an event
each), so nothing here outlives the call but the device tensors it returns and the work queued on that stream, which
reads only the pinned buffers: they go back to torch's caching host allocator when the stager is dropped, and that
allocator keeps a block until the work recorded against it is done."""
from __future__ import annotations

from typing import Optional

import torch

CHUNK_BYTES = 32 << 20
"""Each pinned buffer's size: large enough that a chunk's launch and event cost little beside its copy, small
enough that two take no noticeable host memory."""
STAGED_MIN_BYTES = 4 << 20
"""Below this a tensor goes by a plain copy: the driver's staging costs little there."""


class Stager:
    def __init__(self, device: torch.device, staged: bool = True, chunk_bytes: int = CHUNK_BYTES):
        self.device = device
        self.staged = staged and device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self._buffers: list[torch.Tensor] = []
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._turn = 0

    def to_device(self, source: torch.Tensor) -> torch.Tensor:
        """A new device tensor equal to the host tensor `source` (same dtype and shape)."""
        nbytes = source.numel() * source.element_size()
        if not self.staged or nbytes < STAGED_MIN_BYTES or not source.is_contiguous():
            return source.to(self.device, copy=True)
        out = torch.empty(source.shape, dtype=source.dtype, device=self.device)
        self.copy_into(out, source)
        return out

    def copy_into(self, out: torch.Tensor, source: torch.Tensor) -> None:
        """Copy the host tensor `source` into the device tensor `out` (same dtype and shape; contiguous if staged).
        A pinned source is copied asynchronously: the caller keeps it until its stream has run the copy."""
        nbytes = source.numel() * source.element_size()
        if not self.staged or nbytes < STAGED_MIN_BYTES or not source.is_contiguous():
            out.copy_(source, non_blocking=source.is_pinned())
            return
        if not self._buffers:
            self._buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        src, dst = source.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8)
        stream = torch.cuda.current_stream(self.device)
        for start in range(0, nbytes, self.chunk_bytes):
            end = min(start + self.chunk_bytes, nbytes)
            turn = self._turn
            self._turn = 1 - turn
            if self._copied[turn] is not None:
                self._copied[turn].synchronize()  # its last chunk has left the buffer
            buffer = self._buffers[turn][:end - start]
            buffer.copy_(src[start:end])
            dst[start:end].copy_(buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            self._copied[turn] = event
