"""Module and tensor hooks that drive the window and the gradient offload; attach/detach symmetric.

- forward pre-hook of a streamed block: `enter` it (load on demand, wait for its H2D, prefetch ahead);
  during backward the same hook fires for the recompute of activation checkpointing.
- forward post-hook: leave it (free the slot unless backward needs it soon) and, when autograd
  records the block, hook its output's gradient to detect that its backward starts.
- post-accumulate-grad hook of each trainable streamed parameter: count arrivals; when a block's
  gradients are complete, offload them.
- saved-tensor hooks (around the engine's forward): autograd saves weights that live in a slot
  (e.g. `weight.t()` for a matmul's backward) as a reference to (block, offset, shape, stride) rather
  than the slot's memory, and resolves it in backward against wherever the block is then. Without
  this a slot reused by another block would silently feed the wrong weights to backward. Every other
  saved tensor goes to activations.py's offload when it is on.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stronghold.engine.ranges import ranged
from stronghold.streaming.schedule import Phase

if TYPE_CHECKING:
    from stronghold.streaming.store import BlockStore
    from stronghold.streaming.window import Window


class HookTarget(Protocol):
    """What the hooks drive (the runtime, engine/runtime.py). Read at each call, not kept: the window is
    rebuilt when blocks change placement between steps."""

    device: torch.device
    window: Optional["Window"]
    stores: dict[int, "BlockStore"]
    activations: Any
    """The activation offload (memory/activations.py), or None when nothing is offloaded."""

    blocks_inert: bool
    """The blocks' calls now are not the model's compute: a collecting pass's, or skipped ones (block_major.py)."""

    def grad_arrived(self, index: int, entry: Any) -> None: ...


@dataclass(frozen=True)
class SlotRef:
    """A saved tensor that is a view of a streamed block's weights."""

    block: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]
    frozen: bool
    """The view lies in the block's frozen range, which the optimizer never writes."""


def first_grad_tensor(output: Any):
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = first_grad_tensor(item)
            if found is not None:
                return found
    if hasattr(output, "to_tuple"):  # HF ModelOutput
        return first_grad_tensor(output.to_tuple())
    return None


class Hooks:
    def __init__(self, runtime: HookTarget):
        self.runtime = runtime
        self.handles: list[RemovableHandle] = []
        self.unit_handles: list[RemovableHandle] = []
        """The cached units' gradient hooks (cached.py), which outlive a rebuild of the window (promotion.py)."""
        self.host_s: dict[str, float] = {}
        """Seconds the thread running forward/backward spent in each kind of hook (ranges.ranged), since the last
        report reset."""

    def attach(self, blocks: dict[int, nn.Module]) -> None:
        assert not self.handles, "hooks are already attached"
        for index, module in blocks.items():
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
            # First of the block's forward hooks: it sees the output as the block returned it (blockwise.py replaces
            # the last block's) in the grad mode it ran in.
            self.handles.append(module.register_forward_hook(self._post_hook(index), prepend=True))
            for entry in self.runtime.stores[index].trainable:
                self.handles.append(entry.param.register_post_accumulate_grad_hook(self._grad_hook(index, entry)))

    def attach_units(self, stores: dict[int, BlockStore]) -> None:
        """Gradient hooks of the cached units' trainable parameters: a unit's gradients go to the host, once all of
        them have arrived, as a streamed block's do."""
        assert not self.unit_handles, "the cached units' hooks are already attached"
        for index, store in stores.items():
            for entry in store.trainable:
                self.unit_handles.append(entry.param.register_post_accumulate_grad_hook(self._grad_hook(index, entry)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def detach_units(self) -> None:
        for handle in self.unit_handles:
            handle.remove()
        self.unit_handles.clear()

    def _pre_hook(self, index: int):
        def hook(module, args):
            if not self.runtime.blocks_inert:
                self.runtime.window.enter(index)

        return ranged("enter", hook, self.host_s)

    def _post_hook(self, index: int):
        entry = self._backward_entry(index)  # made once a block: registered on every forward's output

        def hook(module, args, output):
            runtime = self.runtime
            if runtime.window.phase is not Phase.FORWARD or runtime.blocks_inert:
                return  # a recompute during backward: the block stays until its gradients are out
            runtime.window.exit_forward(index)
            tensor = first_grad_tensor(output) if torch.is_grad_enabled() else None
            if tensor is not None:
                tensor.register_hook(entry)

        return ranged("exit_forward", hook, self.host_s)

    def _backward_entry(self, index: int):
        def hook(grad):
            self.runtime.window.enter(index)

        return ranged("enter_backward", hook, self.host_s)

    def _grad_hook(self, index: int, entry):
        # A parameter keeps its hooks where the garbage collector cannot look (torch's C++ side): a hook holding the
        # runtime, or the entry that holds the parameter, would keep an engine dropped without destroy() alive, GPU
        # memory and page-locked buffers included, until exit. So it reaches both by weak reference; the entry lives
        # as long as its store, and the store is not dropped before the hook is removed (relayout.py).
        held, entry_ref = weakref.ref(self), weakref.ref(entry)

        def hook(param):
            hooks = held()
            if hooks is not None:  # None: the engine was dropped, and a backward through the model runs without it
                hooks.runtime.grad_arrived(index, entry_ref())

        return ranged("grad_arrived", hook, self.host_s)

    def saved_tensors(self) -> torch.autograd.graph.saved_tensors_hooks:
        window = self.runtime.window
        activations = self.runtime.activations  # activations.py; None when nothing is offloaded

        def pack(tensor: torch.Tensor):
            if window is not None and tensor.layout is torch.strided and tensor.device == self.runtime.device:
                slot = window.slot_of_tensor(tensor)
                if slot is not None and slot.owner is not None:
                    offset = tensor.storage_offset()
                    frozen = offset >= self.runtime.stores[slot.owner].trainable_numel
                    return SlotRef(slot.owner, offset, tensor.size(), tensor.stride(), frozen)
            return activations.pack(tensor) if activations is not None else tensor

        def unpack(saved):
            if not isinstance(saved, SlotRef):
                return activations.unpack(saved) if activations is not None else saved
            if saved.frozen:
                # Read after the block's gradients left (e.g. a frozen norm's weight in its input
                # gradient): never wait for the block's update, which may only finish at step().
                return window.frozen_view(saved.block, saved.offset, saved.size, saved.stride)
            slot = window.ensure(saved.block)
            # Keep the slot until the next block is entered: the kernel that reads this view is not
            # queued yet, and a second load for the same node must not take this slot meanwhile.
            slot.pinned = True
            return slot.buffer.as_strided(saved.size, saved.stride, saved.offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
