"""Backward block by block at the accumulation boundary (`"blockwise_backward"`).

Why: with host accumulation every micro-step's streamed gradients go down in the compute dtype and the CPU adds them
into an fp32 accumulator (about 10 host-DRAM bytes a parameter a micro-step); `"gpu_accumulation"` sums them on the GPU
instead, but holds an fp32 sum of every streamed block there (4 bytes a parameter: 28 GB for an 8 B model), which a
16-24 GiB card cannot. Here the blocks' backward waits for the boundary and then runs one block at a time over every
micro-batch, so only the block being walked has fp32 sums on the GPU, and each streamed block's gradients leave the GPU
once a step, as that sum.

How:
- Every training forward of the window runs the blocks without autograd (the forward pre-hook turns grad off, the
  forward hook back on) and keeps each block's arguments by reference: its input hidden states (the first block's as
  the model computed them, with the embedding's graph), its keyword arguments (rotary embeddings, the mask) and the RNG
  state. The last block's output is replaced by a leaf that requires grad; a hook on it keeps its gradient. So the
  model's own backward (`loss.backward()` in Trainer or the engine) runs the head and stops there.
- At the boundary, `walk` takes the blocks from the last to the first. Each block runs again from each micro-batch's
  input, in micro-batch order, with grad on, the RNG state put back and without checkpointing, and backward runs from
  the gradient at its output; its input's gradient is the next block's output gradient. A parameter's gradient goes
  into an fp32 sum on the device: the first gradient converted exactly, the later ones added in micro-batch order, as
  host accumulation adds them (device_accum.py), so the applied gradient is the same. After the last micro-batch a
  streamed block's sum goes to the host in one D2H and to the CPU optimizer as the window's gradient
  (handoff.offload_block_sum); a resident block's becomes its resident accumulator.
- Then the embeddings' backward, per micro-batch, from the first block's input gradient, into the same kind of sums.

Failure: the kept arguments stay until the walk has finished, so a boundary backward that fails (its micro-batch is
dropped, runtime.abort_backward) can be run again; the walk's resident sums are merged only at its end, and the streamed
blocks already handed to the CPU are taken back by `CpuOptimizer.abort`, as for "gpu_accumulation"'s boundary.

GPU bytes: the kept inputs, hidden size x tokens x the compute dtype's bytes a block and a micro-batch, plus one
streamed block's fp32 sums and one block's activations during the walk.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stronghold.engine.block_major import BlockMajor
from stronghold.engine.blockwise_walk import run_walk
from stronghold.engine.embedding_rows import EmbeddingRows, rows_for
from stronghold.engine.kept_inputs import Kept, KeptInputs
from stronghold.planning.plan_inputs import host_available
from stronghold.streaming.cached import INDEX_OF

CACHE_KWARGS = ("past_key_values", "cache", "layer_past")
"""The keyword arguments through which a block would update a KV cache: None while recorded (as transformers sets them
under checkpointing), since the walk runs each block a second time; a cache passed positionally goes the same way."""


def _is_cache(value: Any) -> bool:
    """A transformers KV cache passed positionally (GPT-2 passes `past_key_values` so)."""
    return hasattr(value, "get_seq_length") and hasattr(value, "update")


@dataclass
class BlockCall:
    """One block's call in one micro-batch's forward."""

    args: tuple
    """The first is the input hidden states, kept (kept_inputs.py)."""
    kwargs: dict
    rng: tuple[torch.Tensor, Optional[torch.Tensor]]
    """The CPU and (on a GPU) the device's RNG state at the call, put back for the walk's run of it."""


class BlockwiseBackward:
    def __init__(self, runtime, blocks: list[nn.Module]):
        self.runtime = runtime
        self.blocks = blocks
        limit = runtime.settings.host_memory_limit_gb
        self.kept = KeptInputs(runtime.device, runtime.settings.pin_memory, room=lambda: host_available(limit))
        """The blocks' inputs between the forwards and the walk: on the host on a GPU (kept_inputs.py)."""
        self.calls: list[dict[int, BlockCall]] = []
        """Per micro-batch of the window, per block: its call."""
        self.inputs: list[Optional[torch.Tensor]] = []
        """Per micro-batch: the first block's input with the graph that computed it (the embeddings)."""
        self.top_grads: list[Optional[torch.Tensor]] = []
        """Per micro-batch: the gradient at the last block's output, once the micro-batch's backward computed it."""
        self.committed = 0
        """Micro-batches whose backward ended (the rest are dropped at the next forward or by `abort`)."""
        self.recording = False
        self.walking = False
        self._grad_modes: list[bool] = []
        self._checkpointing: set[int] = set()
        """Blocks whose transformers checkpointing is turned off for now (`_checkpointing_off`)."""
        self.handles: list[RemovableHandle] = []
        self.walks = 0
        """Boundaries walked so far."""
        self.rows: Optional[EmbeddingRows] = None
        self._rows_for: Optional[int] = None
        """The cached input part's table row sums (embedding_rows.py) and the id of the unit they were made for."""
        self.major = BlockMajor(self)
        """The window's forwards block by block, where its batches were offered (block_major.py)."""
        self._into: Optional[dict[int, BlockCall]] = None
        """Where the blocks' calls are recorded while `major` runs a micro-batch ahead; None: the window's last."""

    # Hooks ------------------------------------------------------------------------------------------------------
    def attach(self) -> None:
        assert not self.handles, "already attached"
        # The input table's rows now, not at the first walk: its whole-table gradient buffer goes before the host fills.
        self.table_rows(self.runtime.cached.units.get(INDEX_OF["input"]))
        for index, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post_hook(index)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._restore_checkpointing()

    def _pre_hook(self, index: int):
        def hook(module, args, kwargs):
            major = self.major
            if major.skipping is not None or not (self.recording or major.collecting is not None):
                return None
            hidden = args[0] if args else None
            if not isinstance(hidden, torch.Tensor):
                raise ValueError(f"stronghold: blockwise_backward needs the hidden states as a block's first "
                                 f"positional argument (block {index} got {type(hidden).__name__}): set "
                                 "\"blockwise_backward\" to false")
            args, kwargs = (hidden, *(None if _is_cache(a) else a for a in args[1:])), dict(kwargs)
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            for name in CACHE_KWARGS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
            others = [*args[1:], *kwargs.values()]
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in others):
                raise ValueError(f"stronghold: block {index} takes a tensor that requires grad besides its hidden "
                                 "states; blockwise_backward carries a gradient through the hidden states only: set "
                                 "\"blockwise_backward\" to false")
            if major.collecting is not None:
                major.collected(args, kwargs)  # raises: the collecting pass stops here
            calls = self.calls[-1] if self._into is None else self._into
            if index in calls:
                raise RuntimeError(f"stronghold: block {index} ran twice in one forward; blockwise_backward needs "
                                   "each block to run once per forward: set \"blockwise_backward\" to false")
            if index == 0 and self._into is None:
                self.inputs[-1] = hidden if hidden.requires_grad else None
                if major.expecting and self._ran_ahead(args, kwargs):
                    return None
            device = hidden.device
            rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
            # The first block's input stays on the device: `inputs` holds it there with the embeddings' graph anyway.
            kept = (Kept(on_device=hidden.detach()) if index == 0 else
                    self.kept.keep(hidden.detach(), ahead=len(self.blocks) - index))
            calls[index] = BlockCall((kept, *args[1:]), kwargs, rng)
            self._grad_modes.append(torch.is_grad_enabled())
            torch.set_grad_enabled(False)
            return args, kwargs

        return hook

    def _ran_ahead(self, args: tuple, kwargs: dict) -> bool:
        """The first block's pre-hook of a micro-batch whose blocks may have run ahead (block_major.py): True where
        they did on these arguments (its calls are theirs, and the blocks are skipped); else the window's hooks, inert
        until now, enter the first block."""
        taken = self.major.take(len(self.calls) - 1, args, kwargs)
        if taken is None:
            window = self.runtime.window
            if window is not None and 0 in window.stores:  # its hook, inert, did not
                window.enter(0)
            return False
        first = taken.calls[0]  # this forward's own input in place of the collected copy (equal)
        taken.calls[0] = dataclasses.replace(first, args=(Kept(on_device=args[0].detach()), *first.args[1:]))
        self.calls[-1] = taken.calls
        return True

    def record_into(self, calls: Optional[dict[int, BlockCall]]) -> None:
        """The blocks' calls from now on are recorded into `calls` (a micro-batch run ahead), or, None, into the
        window's last micro-batch again."""
        self._into = calls

    def _post_hook(self, index: int):
        def hook(module, args, output):
            last = index == len(self.blocks) - 1
            if self.major.skipping is not None:
                if not last:
                    return None
                self.major.skipped()
                self.recording = False
                self._restore_checkpointing()
                return self._cut(output)
            if not self.recording or index not in (self.calls[-1] if self._into is None else self._into):
                return None
            torch.set_grad_enabled(self._grad_modes.pop())
            if not last or self._into is not None:
                return None
            self.recording = False
            self._restore_checkpointing()
            return self._cut(output)

        return hook

    def _cut(self, output: Any):
        """The last block's output as a leaf that requires grad, its gradient kept for the walk."""
        micro = len(self.calls) - 1

        def keep(grad: torch.Tensor) -> None:
            self.top_grads[micro] = grad

        def leaf(tensor: torch.Tensor) -> torch.Tensor:
            cut = tensor.detach().requires_grad_()
            cut.register_hook(keep)
            return cut

        if isinstance(output, torch.Tensor):
            return leaf(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (leaf(output[0]), *output[1:])
        raise ValueError(f"stronghold: blockwise_backward needs the last block to return a tensor or a tuple that "
                         f"starts with one (got {type(output).__name__}): set \"blockwise_backward\" to false")

    def _checkpointing_off(self, blocks) -> None:
        """transformers' checkpointing off (a block's `gradient_checkpointing`) until `_restore_checkpointing`: the
        forward keeps nothing to recompute, and the walk runs each block once with its activations."""
        for index in blocks:
            block = self.blocks[index]
            if getattr(block, "gradient_checkpointing", False):
                self._checkpointing.add(index)
                block.gradient_checkpointing = False

    def _restore_checkpointing(self) -> None:
        for index in self._checkpointing:
            self.blocks[index].gradient_checkpointing = True
        self._checkpointing.clear()

    # The runtime's phases ---------------------------------------------------------------------------------------
    def begin_forward(self, training: bool) -> None:
        """A forward starts: a training one is recorded as the window's next micro-batch."""
        self._drop_uncommitted()
        if training and not self.calls:
            self.major.drop()  # a window's first forward: nothing of an earlier window runs ahead any more
        self.recording = training
        if training:
            self.calls.append({})
            self.inputs.append(None)
            self.top_grads.append(None)
            self._checkpointing_off(range(len(self.blocks)))
        self.major.expect(training)

    def run_ahead(self, allowed: bool) -> None:
        """After `begin_forward` of a training forward, the window open: at the window's first, the offered
        micro-batches' blocks, block by block (block_major.py), where `allowed` (not while the placement times the
        blocks' calls, which skipped ones would falsify)."""
        if self.major.offered is None or len(self.calls) != 1 or self.calls[0]:
            return
        if not allowed:
            self.major.refuse()
            return
        runtime = self.runtime
        compiled = runtime.compiled
        self.major.run(runtime.model, runtime.device, (lambda kwargs: kwargs) if compiled is None else
                       (lambda kwargs: compiled.training_call(runtime.model, kwargs)))
        self.major.expect(True)

    def commit(self) -> None:
        """A micro-step's backward ended: its micro-batch is part of the window."""
        self.committed = len(self.calls)

    def abort(self) -> None:
        """A backward failed: its micro-batch goes; the window's earlier ones stay for the next boundary."""
        self.walking = False
        self._drop_uncommitted()

    def _drop_uncommitted(self) -> None:
        self.recording = False
        self.major.stop_skipping()
        self._grad_modes.clear()
        self._restore_checkpointing()
        self.kept.recycle(call.args[0] for calls in self.calls[self.committed:] for call in calls.values())
        del self.calls[self.committed:], self.inputs[self.committed:], self.top_grads[self.committed:]

    @property
    def pending(self) -> int:
        """Micro-batches recorded and not yet walked."""
        return len(self.calls)

    @property
    def kept_bytes(self) -> int:
        """Device bytes of the kept block inputs."""
        return sum(self.kept.on_device_bytes(call.args[0]) for calls in self.calls for call in calls.values())

    # The walk ---------------------------------------------------------------------------------------------------
    def walk(self) -> None:
        """At the boundary, after its micro-batch's backward reached the cut: every block's backward over every
        micro-batch, from the last block to the first, then the embeddings'."""
        if not self.calls:
            return
        self.walking = True
        try:
            run_walk(self, self.runtime)
        finally:
            self.walking = False
        self.walks += 1
        self.major.drop()
        self.kept.recycle(call.args[0] for calls in self.calls for call in calls.values())
        self.kept.trim()
        self.calls.clear()
        self.inputs.clear()
        self.top_grads.clear()
        self.committed = 0

    def table_rows(self, unit) -> Optional[EmbeddingRows]:
        """The row sums of the cached input part `unit` (cached.py), where its table allows them."""
        if unit is None:
            return None
        if self._rows_for != id(unit):
            runtime = self.runtime
            pin = runtime.settings.pin_memory and runtime.device.type == "cuda"
            self.rows, self._rows_for = rows_for(runtime.model, unit, self.blocks, pin), id(unit)
        return self.rows

    @contextlib.contextmanager
    def replay(self, index: int, call: "BlockCall"):
        """Around the walk's run of one block's call: its RNG state as at the forward, no checkpointing."""
        device = self.runtime.device
        devices = [] if call.rng[1] is None else [
            device.index if device.index is not None else torch.cuda.current_device()]
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(call.rng[0])
            if call.rng[1] is not None:
                torch.cuda.set_rng_state(call.rng[1], devices[0])
            self._checkpointing_off([index])
            try:
                yield
            finally:
                self._restore_checkpointing()
