"""Everything stronghold adds to one model, wired together: placement, window, hooks, both optimizers.

The engine (engine.py) owns one runtime and calls `begin_forward`, `begin_backward`,
`end_backward` and `step` around DeepSpeed's own bookkeeping.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .config import StrongholdConfig
from .cpu_adam import load_kernel
from .cpu_optim import CpuOptimizer, norm_and_clip_coef
from .discovery import ModelParts
from .gpu_optim import ResidentOptimizer
from .hooks import Hooks
from .schedule import Phase, WindowSchedule
from .store import BlockStore, build_block_store, order_entries, plan_host_memory
from .streams import Transfers
from .window import Window


DEFER_FRACTION = 0.8
"""Defer the next step's CPU updates when the last global norm was at least this fraction of max_norm."""


@dataclass
class _MicroState:
    """Per streamed block, on the thread that runs backward."""

    arrived: int = 0
    offloaded: bool = False
    accum_started: bool = False


class StrongholdRuntime:
    def __init__(self, model: nn.Module, parts: ModelParts, config: StrongholdConfig, param_groups: list[dict],
                 device: torch.device, compute_dtype: torch.dtype, accumulation_steps: int, max_grad_norm: float):
        self.model, self.config, self.param_groups = model, config, param_groups
        self.device, self.compute_dtype = device, compute_dtype
        self.max_grad_norm = max_grad_norm
        self.boundary = True
        named = dict(model.named_parameters())
        group_of = self._group_map(model, param_groups)

        n_blocks = len(parts.blocks)
        self.resident_count = min(config.resident_blocks, n_blocks)
        streamed = list(range(self.resident_count, n_blocks))
        self.window_size = min(config.window_size, len(streamed))
        if streamed and self.window_size < config.window_size:
            warnings.warn(f"stronghold: window_size {config.window_size} is more than the {len(streamed)} streamed "
                          f"blocks; using {self.window_size}")

        layouts = {i: order_entries([(n, named[n]) for n in parts.block_param_names[i]], group_of) for i in streamed}
        accumulate = accumulation_steps > 1
        if streamed:
            plan_host_memory(list(layouts.values()), compute_dtype, accumulate).check_available()
        pin = config.pin_memory and device.type == "cuda"
        self.stores: dict[int, BlockStore] = {
            i: build_block_store(i, layouts[i], compute_dtype, pin, accumulate) for i in streamed}
        self.micro = {i: _MicroState() for i in streamed}

        master_values = self._place_resident(model, set(streamed), parts)
        chunks = [[(p, group_of[id(p)]) for p in parts.blocks[i].parameters() if id(p) in group_of]
                  for i in range(self.resident_count)]
        in_blocks = {id(p) for block in parts.blocks for p in block.parameters()}
        chunks.append([(p, group_of[id(p)]) for p in model.parameters() if id(p) in group_of
                       and id(p) not in in_blocks])
        self.resident = ResidentOptimizer(chunks, param_groups, master_values, fused=device.type == "cuda")

        self.transfers = Transfers(device)
        self.hooks = Hooks(self)
        self.window: Optional[Window] = None
        self.cpu: Optional[CpuOptimizer] = None
        if streamed:
            largest = max(store.numel for store in self.stores.values())
            self.transfers.allocate_slots(self.window_size, largest, compute_dtype)
            self.cpu = CpuOptimizer(load_kernel(config.cpu_optimizer_threads), param_groups,
                                    bf16_working=compute_dtype != torch.float32, speculative=max_grad_norm > 0)
            self.window = Window(self.stores, WindowSchedule(tuple(streamed), self.window_size), self.transfers,
                                 wait=self.cpu.wait)
            self.landed = {i: self.transfers.event() for i in streamed}
            self.hooks.attach({i: parts.blocks[i] for i in streamed})
        self._pending_norm: Optional[tuple[list, Optional[torch.Tensor]]] = None
        self._last_norm: Optional[float] = None
        self.steps = 0

    @staticmethod
    def _group_map(model: nn.Module, param_groups: list[dict]) -> dict[int, int]:
        group_of: dict[int, int] = {}
        for index, group in enumerate(param_groups):
            for param in group["params"]:
                group_of[id(param)] = index
        in_model = {id(p) for p in model.parameters()}
        if any(pid not in in_model for pid in group_of):
            raise ValueError("the optimizer's param groups hold a tensor that is not a parameter of the model; "
                             "build the groups from model.parameters()")
        loose = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
        if loose:
            raise ValueError(f"{len(loose)} parameters require grad but are in no optimizer param group (e.g. "
                             f"{loose[0]}); add them to a group or set requires_grad=False")
        return group_of

    def _place_resident(self, model: nn.Module, streamed: set[int], parts: ModelParts) -> dict[int, torch.Tensor]:
        """Move everything that is not streamed to the device in the compute dtype; return fp32 masters."""
        streamed_ids = {id(p) for i in streamed for p in parts.blocks[i].parameters()}
        masters: dict[int, torch.Tensor] = {}
        for param in model.parameters():
            if id(param) in streamed_ids:
                continue
            if param.is_floating_point() and param.dtype != self.compute_dtype and param.requires_grad:
                # Keep the original precision as the master before casting the working parameter.
                master = param.data.to(self.device, torch.float32, copy=True)
                masters[id(param)] = master
                param.data = master.to(self.compute_dtype)
            elif param.is_floating_point():
                param.data = param.data.to(self.device, self.compute_dtype)
            else:
                param.data = param.data.to(self.device)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.device)
        return masters

    # Phases, called by the engine -------------------------------------------------------------
    def begin_forward(self, training: bool) -> None:
        if self.window is not None:
            self.window.begin(Phase.FORWARD, training)

    def begin_backward(self, boundary: bool) -> None:
        self.boundary = boundary
        if self.window is None:
            return
        for state, store in zip(self.micro.values(), self.stores.values()):
            state.arrived, state.offloaded = 0, False
            for entry in store.trainable:
                entry.grad_this_micro = False
        self.window.begin(Phase.BACKWARD, True)

    def grad_arrived(self, index: int, entry) -> None:
        state, store = self.micro[index], self.stores[index]
        if state.offloaded:
            raise RuntimeError(f"{entry.name} received a gradient after block {index}'s gradients were offloaded; "
                               "stronghold needs each block to run once per forward")
        if not entry.grad_this_micro:
            entry.grad_this_micro = entry.grad_this_window = True
            state.arrived += 1
        if state.arrived == len(store.trainable):
            self._offload(index)

    def _offload(self, index: int) -> None:
        state, store = self.micro[index], self.stores[index]
        present = [e for e in store.trainable if e.grad_this_micro]
        if present:
            self.cpu.wait(store.grad_free)  # the CPU still reads the previous micro-step's gradients (rare)
            store.grad_free.clear()
            self.transfers.offload([(e.param.grad, e.offset) for e in present], store.grad, self.landed[index])
            for entry in present:
                entry.param.grad = None
        self.cpu.submit_grads(store, present, self.landed[index], self.boundary, not state.accum_started)
        state.offloaded = True
        state.accum_started = bool(present) or state.accum_started
        if self.boundary:
            state.accum_started = False
            for entry in store.trainable:
                entry.grad_this_window = False
        self.window.release(index)

    def end_backward(self) -> None:
        """Offload what backward left partial (unused parameters) and, at the boundary, blocks that got
        gradients only in earlier micro-steps."""
        if self.window is None:
            return
        for index, state in self.micro.items():
            store = self.stores[index]
            if state.offloaded:
                continue
            if state.arrived or (self.boundary and any(e.grad_this_window for e in store.trainable)):
                self._offload(index)

    # Optimizer ---------------------------------------------------------------------------------
    def step(self) -> None:
        """The optimizer step at an accumulation boundary: exact global clipping, then both optimizers."""
        resident_sq = self.resident.grad_sq_sum()
        if self.max_grad_norm > 0:
            total = self.cpu.grad_sq_sum() if self.cpu is not None else 0.0
            total += float(resident_sq) if resident_sq is not None else 0.0
            self._last_norm, coef = norm_and_clip_coef(total, self.max_grad_norm)
            self._pending_norm = None
        else:
            coef = 1.0
            self._pending_norm = (list(self.cpu.records) if self.cpu is not None else [], resident_sq)
        if self.cpu is not None:
            self.cpu.finish_step(coef)
            # Defer when the next step may well clip: a wrong deferral costs the overlap of one step's
            # update with backward, a wrong speculation costs that and a second (redo) pass.
            self.cpu.defer_next = self.max_grad_norm > 0 and self._last_norm >= DEFER_FRACTION * self.max_grad_norm
        self.resident.step(coef)
        self.steps += 1

    def grad_norm(self) -> Optional[float]:
        """The last step's global gradient norm (computed on demand when clipping is off)."""
        if self._pending_norm is not None:
            records, resident_sq = self._pending_norm
            for record in records:
                self.cpu.wait(record.done)
            total = sum(r.sq for r in records) + (float(resident_sq) if resident_sq is not None else 0.0)
            self._last_norm, self._pending_norm = math.sqrt(total), None
        return self._last_norm

    def master_params(self) -> dict[int, torch.Tensor]:
        """id(param) -> the fp32 value the optimizer updates (host for streamed, device for resident).
        Call `synchronize()` first so every streamed block's latest update has landed."""
        masters = {id(p): m for chunk in self.resident.chunks for p, m in zip(chunk.params, chunk.masters)}
        for store in self.stores.values():
            for entry in store.entries:
                source = store.master if entry.group is not None else store.working
                masters[id(entry.param)] = entry.host_view(source)
        for param in self.model.parameters():  # frozen resident parameters are their own value
            masters.setdefault(id(param), param.data)
        return masters

    def zero_grad(self) -> None:
        self.resident.zero_grad()

    def synchronize(self) -> None:
        """Finish all CPU work and put every block's final weights in its host copy."""
        if self.cpu is not None:
            self.cpu.drain()
            self.window.evict_all()

    def close(self) -> None:
        self.hooks.detach()
        if self.cpu is not None:
            self.cpu.close()
