"""A promotion's copies onto the GPU on a thread, while the training thread goes on (planning/promotion.py).

Promoting a block moves its fp32 master (and, once a step has written them, its moments) from pageable host memory to
the device: a host memcpy into pinned buffers, or the driver's own staging, a few GB/s, inside the first step (the
2.70 B Llama's first forward and the placement after its first step, docs/results.md), while the same forward spends
a second compiling on the training thread and the link and the other cores are idle. So the promotion makes every
device tensor on the training thread (the parameters', the masters', the moments'; each object in place before any
other code can see it) and leaves them empty, and this fills them on a thread of its own, block by block in the order
the forward needs them, on a stream of its own. The training thread waits only where it reads one: a one-shot
forward pre-hook on each promoted block (its block's copies done on the host, then the compute stream waits on their
event), and `finish`, which whoever reads the promoted states otherwise calls first (the optimizer step, synchronize,
a new promotion, close). The host buffers the copies read go to the releaser once the last copy is done.

On the CPU (CI) the same code runs with plain copies and no streams, so tests see the waits and the values.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from stronghold.streaming.staging import Stager
from stronghold.streaming.streams import indexed


@dataclass
class BlockFill:
    """One promoted block's copies, in order: (host source, device destination) for the masters, moments and frozen
    weights; (device master, device parameter) for the casts to the compute dtype, after their master's copy."""

    index: int
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    casts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    """Set once the block's copies are queued (and on a GPU its `event` recorded) or the thread failed."""
    event: Optional[torch.cuda.Event] = None


class PromotionFill:
    def __init__(self, device: torch.device, blocks: dict[int, nn.Module], fills: list[BlockFill], staged: bool,
                 release: Callable[[list, Optional[Callable]], None], left_behind: list,
                 then: Optional[Callable] = None):
        """`blocks`: the promoted blocks by index; `fills` in the order to copy; `staged`: through Stager's pinned
        buffers (the CPU otherwise idle) or the driver's copies; once every copy has finished the thread hands
        `left_behind` (the host buffers the copies read) and `then` to `release` (HostReleaser.release), which
        drops them; the caller keeps no reference to them."""
        self.is_cuda = device.type == "cuda"
        self.device = indexed(device)  # here, on the caller's thread
        self.fills = {fill.index: fill for fill in fills}
        self._order = fills
        self._staged = staged
        self._release = release
        self._left_behind = [left_behind, then]
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        if self._stream is not None:
            # The copies write memory made on the training thread's stream (the freed window slots' perhaps): after
            # whatever that stream has queued so far, as the promotion's copies on that stream were before.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self.error: Optional[BaseException] = None
        self.fill_s: Optional[float] = None
        """The thread's seconds from start to its last copy done (None while it runs)."""
        self.waited_s = 0.0
        """How long the training thread waited for it (the blocks' first forwards, `finish`)."""
        self._hooks = {index: block.register_forward_pre_hook(self._pre_hook(index))
                       for index, block in blocks.items() if index in self.fills}
        self._finished = False
        self._thread = threading.Thread(target=self._run, name="stronghold-promotion-fill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if self.is_cuda:
                torch.cuda.set_device(self.device)  # a new thread's current device is the first GPU
            stager = Stager(self.device, staged=self._staged)
            with torch.no_grad(), (torch.cuda.stream(self._stream) if self.is_cuda else contextlib.nullcontext()):
                for fill in self._order:
                    for source, destination in fill.copies:
                        stager.copy_into(destination, source)
                    for master, param in fill.casts:
                        param.copy_(master)
                    if self.is_cuda:
                        fill.event = torch.cuda.Event()
                        fill.event.record(self._stream)
                    fill.ready.set()
                if self.is_cuda:
                    self._stream.synchronize()  # every copy done: the host sources can go
            # The loops' last host view too: held here, it would make this thread, not the releaser, drop a buffer.
            del stager
            source = destination = None  # noqa: F841
            for fill in self._order:  # the host views go first: the hand-over below holds the last references
                fill.copies.clear()
                fill.casts.clear()
            left_behind, then = self._left_behind
            self._left_behind.clear()
            self._release(left_behind, then)
            del left_behind, then
        except BaseException as err:  # raised on the training thread where it next waits
            self.error = err
        finally:
            self.fill_s = time.perf_counter() - start
            for fill in self._order:
                fill.ready.set()

    def _pre_hook(self, index: int):
        def hook(module, args):
            self.wait(index)
        return hook

    def wait(self, index: int) -> None:
        """Block `index`'s values are usable on the training thread's current stream from here on."""
        fill = self.fills.get(index)
        if fill is None:
            return
        start = time.perf_counter()
        fill.ready.wait()
        self.waited_s += time.perf_counter() - start
        if self.error is not None:
            raise RuntimeError(f"stronghold: copying promoted block {index} onto the GPU failed: "
                               f"{type(self.error).__name__}: {self.error}") from self.error
        if fill.event is not None:
            torch.cuda.current_stream(self.device).wait_event(fill.event)
        handle = self._hooks.pop(index, None)
        if handle is not None:
            handle.remove()
        del self.fills[index]

    def finish(self, raise_error: bool = True) -> None:
        """Every promoted value usable from here on, the thread gone and the hooks removed (a failed copy raised
        unless not `raise_error`: at close, where nothing reads the values any more)."""
        if self._finished:
            return
        start = time.perf_counter()
        self._thread.join()
        self.waited_s += time.perf_counter() - start
        if self.error is not None and not raise_error:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            self._finished = True
            return
        for index in list(self.fills):
            self.wait(index)
        self._finished = True

    def report(self) -> dict:
        return {"blocks": len(self._order), "fill_s": self.fill_s, "waited_s": self.waited_s,
                "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}"}
