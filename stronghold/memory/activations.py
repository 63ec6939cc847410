"""Activation offload: the blocks' saved activations go to pinned host buffers during forward and
come back ahead of each block's backward (STRONGHOLD and Megatron-Kwai do the same).

Which tensors, for the chosen blocks (`offload_activations`; the first N blocks in forward order, whose
activations wait longest for backward):
- with activation checkpointing (reentrant or not): the block's input, which torch.utils.checkpoint
  saves through the engine's saved-tensor hooks (outside the checkpoint's own nested hooks). It is
  recognised by its memory: the tensor the block's forward pre-hook receives as its first argument.
  Reentrant checkpointing saves it after the block ran, non-reentrant before, so both orders are
  matched (`_pending`, `_input`).
- without checkpointing: every tensor the block's forward saves that is at least as large as its input
  (the hidden state, the MLP's intermediate, the attention's inputs); smaller ones (rotary tables,
  masks shared by all blocks) would cost a copy each and free little.
Only tensors whose elements fill their memory densely are moved, so the copy that comes back has the
original strides and backward runs the same kernels on the same values: gradients are bit-identical.

When, on which stream, what waits on what (the window's discipline, streams.py):
- forward: an event on the compute stream (the producer) -> the D2H stream waits, copies into a
  pooled host buffer, records `stored`. The GPU tensor is then dropped with `record_stream`, so the
  allocator reuses its memory only after the copy has read it.
- backward: entering block i (its recompute's pre-hook, or the gradient hook on its output) enqueues
  the H2D of blocks i and i-1 (PREFETCH_BLOCKS) on the H2D stream, after their `stored` events and an
  event of the compute stream (the new device memory may still be read by earlier kernels); the copy
  records `loaded`. Unpacking waits for `loaded` only; a tensor not prefetched is loaded on demand.
- host buffers: a pool keyed by byte size, filled in the first step and reused after (sizes recur).
  A buffer goes back when its holder dies (autograd frees a node's saved tensors once the node ran),
  with its `loaded` event, which the next D2H into it waits for.
On a CPU device the copies are plain copies and there are no events: the same code runs in CI.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from collections import defaultdict, deque
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stronghold.streaming.hooks import first_grad_tensor
from stronghold.streaming.pinned import pinned_empty
from stronghold.planning.planner import ACTIVATION_PREFETCH_BLOCKS
from stronghold.streaming.schedule import Phase
from stronghold.streaming.streams import Transfers

PREFETCH_BLOCKS = ACTIVATION_PREFETCH_BLOCKS
"""Blocks whose activations are on the GPU or in flight in backward: the one entered and the next (the
planner counts them). One block's backward hides one block's H2D when a block's activations are no
larger than its compute wants (a checkpointed input is seq x hidden, a block's backward ~seq x
hidden^2 FLOPs); more would only hold more GPU memory."""
PENDING = 4
"""Tensors saved outside the chosen blocks that may still turn out to be the next block's input (the
non-reentrant checkpoint saves it last before the block runs); older ones stay on the device."""


def blocks_to_offload(setting: Union[None, bool, int], n_blocks: int) -> int:
    """How many leading blocks move their activations to the host for the `offload_activations`
    setting (as resolved: config.resolve). True: all but the last, whose input backward needs right after the forward
    ends (moving it frees nothing at the peak). None ("auto"): none here; on a GPU, long_context.py turns offload on at
    the first training batch when that batch's activations would not fit."""
    if setting is None or setting is False:
        return 0
    if setting is True:
        return max(0, n_blocks - 1)
    return min(int(setting), n_blocks)


def _dense(tensor: torch.Tensor) -> bool:
    """The elements fill [storage_offset, storage_offset + numel) exactly, so a host buffer of numel
    elements holds them with the same strides."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype)


class HostPool:
    """Host buffers (pinned on a GPU) by byte size, reused across steps."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = defaultdict(list)
        self._lock = threading.Lock()  # holders die on whatever thread frees the autograd graph
        self.bytes = 0
        """Host bytes this pool has allocated (its high-water mark: buffers are never given back)."""

    def take(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A buffer and the event of the last copy that read it (None: nothing to wait for)."""
        with self._lock:
            if self._free[nbytes]:
                return self._free[nbytes].pop()
            self.bytes += nbytes
        # Exact-size page-locked buffers (pinned.py): torch's pinned allocator rounds up to a power of two, +60%
        # for one Llama h2560 block input at 131072 tokens (671 MB in a 1 GiB buffer).
        return (pinned_empty(nbytes, torch.uint8) if self.pin else torch.empty(nbytes, dtype=torch.uint8)), None

    def give(self, buffer: torch.Tensor, last_read) -> None:
        with self._lock:
            self._free[buffer.numel()].append((buffer, last_read))


class SavedActivation:
    """One saved tensor of a block: on the device until offloaded, then in a host buffer, and back on
    the device from its (pre)fetch until autograd drops it. Events are producer -> consumer."""

    __slots__ = ("owner", "block", "device", "host", "buffer", "stored", "loaded", "__weakref__")

    def __init__(self, owner: "ActivationOffload", tensor: torch.Tensor):
        self.owner, self.block = owner, None
        self.device: Optional[torch.Tensor] = tensor
        self.host: Optional[torch.Tensor] = None
        self.buffer: Optional[torch.Tensor] = None
        self.stored = None
        """D2H stream -> H2D stream: the host copy is complete."""
        self.loaded = None
        """H2D stream -> compute stream (and the next D2H into `buffer`): the device copy is complete."""

    def offload(self, block: int) -> None:
        owner, tensor = self.owner, self.device
        transfers = owner.transfers
        nbytes = tensor.numel() * tensor.element_size()
        self.block = block
        self.buffer, last_read = owner.pool.take(nbytes)
        self.host = self.buffer.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
        if transfers.is_cuda:
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(transfers.device))
            with torch.cuda.stream(transfers.d2h_stream):
                transfers.d2h_stream.wait_event(produced)
                if last_read is not None:  # the previous step's H2D out of this buffer
                    transfers.d2h_stream.wait_event(last_read)
                self.host.copy_(tensor, non_blocking=True)
                # Our reference goes now, the model's soon after: this keeps the allocator from giving
                # the memory to the compute stream before the copy has read it.
                tensor.record_stream(transfers.d2h_stream)
                self.stored = torch.cuda.Event()
                self.stored.record(transfers.d2h_stream)
        else:
            self.host.copy_(tensor)
        self.device = None
        owner.stats["d2h_bytes"] += nbytes
        owner.stats["offloaded_tensors"] += 1
        owner.by_block[block].append(weakref.ref(self))

    def load(self) -> None:
        """Enqueue the copy back to the device (once); `unpack` waits for it."""
        if self.device is not None or self.host is None:
            return
        transfers = self.owner.transfers
        device = torch.empty_strided(self.host.shape, self.host.stride(), dtype=self.host.dtype,
                                     device=transfers.device)
        if transfers.is_cuda:
            # Allocated in the compute stream's order: kernels enqueued there before may still read the
            # memory's previous tensor.
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(transfers.device))
            with torch.cuda.stream(transfers.h2d_stream):
                transfers.h2d_stream.wait_event(free)
                transfers.h2d_stream.wait_event(self.stored)
                device.copy_(self.host, non_blocking=True)
                # If autograd drops this tensor before the copy ends (a failed backward), the memory must
                # not be reused under the copy.
                device.record_stream(transfers.h2d_stream)
                self.loaded = torch.cuda.Event()
                self.loaded.record(transfers.h2d_stream)
        else:
            device.copy_(self.host)
        self.device = device
        self.owner.stats["h2d_bytes"] += device.numel() * device.element_size()

    def unpack(self) -> torch.Tensor:
        self.load()
        if self.loaded is not None:
            torch.cuda.current_stream(self.owner.transfers.device).wait_event(self.loaded)
        return self.device

    def __del__(self):
        # Never loaded (`loaded` None): the next D2H into the buffer is queued behind this one's on the
        # same stream, so there is nothing to wait for.
        if self.buffer is not None:
            self.owner.pool.give(self.buffer, self.loaded)


class ActivationOffload:
    """Offloads the saved activations of the chosen blocks; hooks on every block (module docstring)."""

    def __init__(self, blocks: dict[int, nn.Module], transfers: Transfers, pin: bool, chosen: int):
        self.blocks = blocks
        self.transfers = transfers
        self.pool = HostPool(pin)
        self.chosen: frozenset[int] = frozenset()
        self.set_chosen(chosen)
        self.phase, self.training = Phase.FORWARD, True
        self.handles: list[RemovableHandle] = []
        self.by_block: dict[int, list[weakref.ref]] = defaultdict(list)
        self.stats: dict[str, int] = defaultdict(int)
        self._keyword_only: set[int] = set()
        """Chosen blocks already warned about: called without a positional tensor input."""
        self.block_input_bytes: dict[int, int] = {}
        """Bytes of each block's input in the last training forward (the checkpointed hidden state)."""
        self.last_tokens = 0
        """Tokens of the last training forward (the first block's input without its last dimension)."""
        self._inside: Optional[int] = None
        """The chosen block whose forward (not a recompute) runs now."""
        self._min_bytes = 0
        self._recent: dict[tuple, tuple[SavedActivation, torch.Tensor]] = {}
        """Tensors saved inside the running block, by memory: one copy when several ops save the same
        tensor (the q, k and v projections save one input). Holding the tensor until the block ends
        keeps its memory from becoming another tensor's with the same key meanwhile."""
        self._input: Optional[tuple[int, torch.Tensor, list[SavedActivation]]] = None
        """(block, its input, [its holder]) since the block's pre-hook: a reentrant checkpoint saves
        the input after the block ran."""
        self._weights: set[int] = set()
        """Storages of the chosen blocks' parameters: saved weights stay where they are (a resident one
        is on the GPU anyway; a streamed one is a slot reference, hooks.py)."""
        self._pending: deque[tuple[tuple, SavedActivation]] = deque(maxlen=PENDING)
        """The last tensors saved outside the chosen blocks: a non-reentrant checkpoint saves a block's
        input just before the block's pre-hook runs."""

    def set_chosen(self, count: int) -> None:
        """Offload the first `count` blocks (forward order) from the next forward on."""
        self.chosen = frozenset(sorted(self.blocks)[:max(0, count)])

    def attach(self) -> None:
        assert not self.handles, "activation hooks are already attached"
        for index, module in self.blocks.items():
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
            self.handles.append(module.register_forward_hook(self._post_hook(index)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def begin(self, phase: Phase, training: bool = True) -> None:
        """A forward or backward pass starts (runtime.py); also after a failed backward."""
        self.phase, self.training = phase, training
        self._inside, self._input, self._recent = None, None, {}
        self._pending.clear()
        if phase is Phase.FORWARD:
            self.by_block.clear()
            # Per forward: promotion (runtime.promote) moves resident parameters to new memory.
            self._weights = {p.untyped_storage().data_ptr() for i in self.chosen for p in self.blocks[i].parameters()}

    # Module hooks --------------------------------------------------------------------------------
    def _pre_hook(self, index: int):
        def hook(module, args):
            if self.phase is Phase.BACKWARD:
                self._enter_backward(index)  # a checkpoint's recompute: this block's backward is next
                return
            if not self.training:
                return
            # Under a reentrant checkpoint this runs without grad mode, hence `training`, not grad mode.
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            pending = list(self._pending)
            self._pending.clear()
            self._input = None
            if first is None:
                if index in self.chosen and index not in self._keyword_only:
                    self._keyword_only.add(index)
                    warnings.warn(f"stronghold: offload_activations: block {index} was called without a tensor as its "
                                  "first positional argument (its hidden state), so its activations stay on the GPU; "
                                  "call the block with the hidden state first, as Hugging Face models do",
                                  stacklevel=2)
                return
            self.block_input_bytes[index] = _nbytes(first)
            if index == min(self.blocks):
                self.last_tokens = first.numel() // max(1, first.shape[-1])
                self.stats["tokens"] += self.last_tokens
            if index not in self.chosen:
                return
            key = _key(first)
            for pending_key, holder in pending:
                if pending_key == key and holder.host is None:
                    holder.offload(index)
            self._input = (index, first, [])
            self._inside, self._min_bytes, self._recent = index, _nbytes(first), {}

        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            if self.phase is Phase.BACKWARD:
                return
            self._inside, self._recent = None, {}
            tensor = first_grad_tensor(output) if torch.is_grad_enabled() else None
            if tensor is not None:  # without a reentrant checkpoint: its gradient starts the block's backward
                tensor.register_hook(lambda grad: self._enter_backward(index))

        return hook

    def _enter_backward(self, index: int) -> None:
        for block in range(index, index - PREFETCH_BLOCKS, -1):
            for ref in self.by_block.get(block, ()):
                holder = ref()
                if holder is not None:
                    holder.load()

    # Saved-tensor hooks (composed into hooks.Hooks.saved_tensors) ---------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        if (not self.chosen or self.phase is not Phase.FORWARD or not self.training
                or tensor.device != self.transfers.device
                or not tensor.is_floating_point() or tensor.layout is not torch.strided or not _dense(tensor)):
            return tensor
        if self._inside is not None:  # checkpointing off: the block's own saved tensors
            if _nbytes(tensor) < self._min_bytes or tensor.untyped_storage().data_ptr() in self._weights:
                return tensor
            key = _key(tensor)
            if key not in self._recent:
                holder = SavedActivation(self, tensor)
                holder.offload(self._inside)
                self._recent[key] = (holder, tensor)
            return self._recent[key][0]
        if self._input is not None:
            block, first, holders = self._input
            if _key(tensor) == _key(first):  # a reentrant checkpoint saves the block's input
                if not holders:
                    holders.append(SavedActivation(self, tensor))
                    holders[0].offload(block)
                return holders[0]
        if tensor.dim() < 2:  # not a hidden state
            return tensor
        holder = SavedActivation(self, tensor)
        self._pending.append((_key(tensor), holder))
        return holder

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, SavedActivation) else saved

    # Telemetry -----------------------------------------------------------------------------------
    def report(self, steps: int) -> dict:
        tokens, inputs = self.stats["tokens"], self.block_input_bytes
        return {
            "blocks": sorted(self.chosen),
            "d2h_bytes_per_step": self.stats["d2h_bytes"] / steps,
            "h2d_bytes_per_step": self.stats["h2d_bytes"] / steps,
            "offloaded_tensors_per_step": self.stats["offloaded_tensors"] / steps,
            "tokens_per_step": tokens / steps,
            "d2h_bytes_per_token": self.stats["d2h_bytes"] / tokens if tokens else None,
            # What one block keeps per token with checkpointing (its input): the planner's per-block term.
            "block_input_bytes_per_token": max(inputs.values()) / self.last_tokens if inputs and self.last_tokens
            else None,
            "host_pool_bytes": self.pool.bytes,
        }

    def reset_stats(self) -> None:
        self.stats = defaultdict(int)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
