"""Everything stronghold adds to one model, wired together: placement, window, hooks, both optimizers.

The engine (engine.py) owns one runtime and calls `begin_forward`, `begin_backward`,
`end_backward` and `step` around DeepSpeed's own bookkeeping.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Optional

import torch
from torch import nn

from stronghold.memory.activations import ActivationOffload, blocks_to_offload
from stronghold.memory.mlp_chunks import MlpChunks, chunk_tokens_of
from stronghold.planning.promotion import promote
from stronghold.config import StrongholdConfig
from stronghold.engine.cores import pin_worker
from stronghold.optim.cpu_adam import load_kernel
from stronghold.optim.cpu_optim import CpuOptimizer
from stronghold.optim.cpu_records import norm_and_clip_coef
from stronghold.distributed.data_parallel import DataParallel
from stronghold.streaming.device_accum import DeviceAccumulators
from stronghold.integrations.discovery import ModelParts, check_materialized
from stronghold.optim.gpu_optim import ResidentOptimizer, place_resident
from stronghold.streaming.hooks import Hooks
from stronghold.engine.handoff import GradientHandOff
from stronghold.engine.optimizer import group_map
from stronghold.streaming.schedule import Phase, WindowSchedule
from stronghold.distributed.sharding import build_sharded_stores
from stronghold.streaming.store import BlockStore, HostBytes, build_block_stores, cpu_param_bytes, order_entries, plan_host_memory
from stronghold.engine.step_state import MicroState, StepState, require_idle
from stronghold.streaming.streams import Transfers
from stronghold.streaming.window import Window

logger = logging.getLogger(__name__)


class StrongholdRuntime(GradientHandOff):
    def __init__(self, model: nn.Module, parts: ModelParts, config: StrongholdConfig, param_groups: list[dict],
                 device: torch.device, compute_dtype: torch.dtype, accumulation_steps: int, max_grad_norm: float,
                 resident_blocks: int, window_size: int, data_parallel: Optional[DataParallel] = None,
                 lean_blocks: int = 0, host_planned: bool = False, gpu_accumulation: bool = False):
        """`resident_blocks` / `window_size` / `lean_blocks`: the placement (placement.py resolves "auto" into
        numbers; lean blocks are the first streamed ones, store.py). `host_planned`: the planner already
        checked host memory (on a GPU); otherwise the runtime checks the streamed blocks' buffers itself.
        `data_parallel`: the replicas' reducer with several ranks; the streamed stores are then built sharded
        over one node-shared working copy (sharding.py), a collective. `gpu_accumulation`: the streamed blocks'
        gradients are accumulated on the GPU (device_accum.py; accumulation, one process)."""
        self.model, self.config, self.param_groups = model, config, param_groups
        self.data_parallel = data_parallel
        self.blocks = parts.blocks
        self.device, self.compute_dtype = device, compute_dtype
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.boundary = True
        self.loss_scale = 1.0
        """What the current accumulation window's losses were multiplied by (fp16 loss scaling)."""
        self.state = StepState.IDLE
        self._state_before_backward = StepState.IDLE
        self.skipped_steps = 0
        check_materialized(model)
        named = dict(model.named_parameters())
        group_of = group_map(model, param_groups)

        n_blocks = len(parts.blocks)
        self.resident_count = min(resident_blocks, n_blocks)
        streamed = list(range(self.resident_count, n_blocks))
        self.window_size = min(window_size, len(streamed))
        if streamed and self.window_size < window_size:
            warnings.warn(f"stronghold: window_size {window_size} is more than the {len(streamed)} streamed "
                          f"blocks; using {self.window_size}")

        layouts = {i: order_entries([(n, named[n]) for n in parts.block_param_names[i]], group_of) for i in streamed}
        accumulate = accumulation_steps > 1
        if gpu_accumulation and (not accumulate or data_parallel is not None):
            raise ValueError(f"stronghold.gpu_accumulation needs gradient accumulation (here "
                             f"{accumulation_steps}) in one process (here: "
                             f"{'data parallel' if data_parallel is not None else 'one process'}); set "
                             "\"gpu_accumulation\" to \"auto\" or false")
        host_accumulate = accumulate and not gpu_accumulation
        lean = min(lean_blocks, len(streamed))
        if lean and (compute_dtype == torch.float32 or accumulate or data_parallel is not None):
            raise ValueError(f"stronghold.lean_blocks {lean_blocks} needs bf16 or fp16, no gradient accumulation "
                             f"and one process (here: {compute_dtype}, accumulation {accumulation_steps}, "
                             f"{'data parallel' if data_parallel is not None else 'one process'}); set "
                             "\"lean_blocks\" to \"auto\" or 0")
        self.lean_until = self.resident_count + lean
        """Blocks below this index are lean while streamed (their stores have no gradient buffer)."""
        if streamed and not host_planned:
            # What the buffers replace: every CPU parameter (the resident ones go to the device first, below).
            plan_host_memory(list(layouts.values()), compute_dtype, accumulate, lean, gpu_accumulation).check_available(
                freed=cpu_param_bytes(model))
        # The resident blocks and the rest go to the GPU first: their host storage (the model as the user
        # built it, fp32 on the CPU say) is freed before the streamed blocks' host buffers grow, so the host
        # peak is the planned buffers, not those plus the resident part of the model.
        streamed_ids = {id(p) for i in streamed for p in parts.blocks[i].parameters()}
        master_values = place_resident(model, streamed_ids, device, compute_dtype)
        pin = config.pin_memory and device.type == "cuda"
        self.host_bytes = HostBytes()
        """Host bytes of the streamed blocks' buffers, now and at their high-water mark (store.py)."""
        self.stores: dict[int, BlockStore]
        if data_parallel is not None:
            self.stores = build_sharded_stores(data_parallel, layouts, compute_dtype, pin, accumulate, self.host_bytes)
        else:
            self.stores = build_block_stores(layouts, compute_dtype, pin, host_accumulate, self.host_bytes,
                                             self.lean_until, torch.float32 if gpu_accumulation else compute_dtype)
        self.micro = {i: MicroState() for i in streamed}
        self.device_accum = DeviceAccumulators(self.stores, device) if gpu_accumulation and streamed else None
        """The streamed blocks' fp32 gradient sums on the GPU (device_accum.py), or None (host accumulation)."""

        chunks = [[(p, group_of[id(p)]) for p in parts.blocks[i].parameters() if id(p) in group_of]
                  for i in range(self.resident_count)]
        in_blocks = {id(p) for block in parts.blocks for p in block.parameters()}
        chunks.append([(p, group_of[id(p)]) for p in model.parameters() if id(p) in group_of
                       and id(p) not in in_blocks])
        self.resident = ResidentOptimizer(chunks, param_groups, master_values, fused=device.type == "cuda",
                                          accumulate=accumulate)

        self.transfers = Transfers(device)
        self.hooks = Hooks(self)
        self.activations: Optional[ActivationOffload] = None
        offloaded = blocks_to_offload(config.offload_activations, n_blocks)
        # Hooked only when blocks are chosen: every saved tensor of every forward goes through the hooks,
        # a host cost the default path should not pay before the offload is measured on a GPU (issue 13).
        if offloaded:
            self.offload_activations(offloaded)
        chunking = chunk_tokens_of(config.mlp_chunk_tokens, offloading=bool(offloaded))
        self.mlp_chunks = None if chunking == "off" else MlpChunks(dict(enumerate(parts.blocks)), chunking)
        if self.mlp_chunks is not None:
            self.mlp_chunks.attach()
        self.window: Optional[Window] = None
        self.cpu: Optional[CpuOptimizer] = None
        self.worker_cores: tuple[int, ...] = ()
        if streamed:
            self.cpu = CpuOptimizer(load_kernel(config.cpu_optimizer_threads), param_groups,
                                    write_working=compute_dtype != torch.float32, max_grad_norm=max_grad_norm,
                                    stall_timeout_s=config.stall_timeout_s,
                                    weights_first=None if config.weights_first == "auto" else config.weights_first)
            self.worker_cores = pin_worker(self.cpu)  # all of this rank's cores but the launching thread's
            self.landed = {i: self.transfers.event() for i in streamed}
            self._build_window()
        self._last_norm: Optional[float] = None
        self.steps = 0
        self.placement = None
        """placement.Placement on a GPU (set by the engine): measures the first step, then promotes."""
        self.long_context = None
        """long_context.LongContextAuto on a GPU under offload_activations "auto" (set by the engine)."""

    def _build_window(self) -> None:
        """Slots, schedule and hooks for the blocks in `self.stores` at `self.window_size`."""
        streamed = sorted(self.stores)
        largest = max(store.numel for store in self.stores.values())
        self.transfers.allocate_slots(self.window_size, largest, self.compute_dtype)
        self.window = Window(self.stores, WindowSchedule(tuple(streamed), self.window_size), self.transfers,
                             wait=self.cpu.wait)
        if self.data_parallel is not None:
            self.window.shared = self.data_parallel.shared
            self.window.shared.check = self.cpu.check  # a failed update (or exchange) fails the wait at once
        self.hooks.attach({i: self.blocks[i] for i in streamed})

    def offload_activations(self, blocks: int) -> None:
        """Offload the saved activations of the first `blocks` blocks from the next forward on (activations.py):
        at construction for a number in the config, or at the first forward under "auto" (long_context.py)."""
        pin = self.config.pin_memory and self.device.type == "cuda"
        self.activations = ActivationOffload(dict(enumerate(self.blocks)), self.transfers, pin, blocks)
        self.activations.attach()

    def promote(self, resident_blocks: int, window_size: int) -> None:
        """Make the leading streamed blocks up to `resident_blocks` resident, between steps (promotion.py)."""
        promote(self, resident_blocks, window_size)

    # Phases, called by the engine -------------------------------------------------------------
    def begin_forward(self, training: bool) -> None:
        if self.state is StepState.UPDATING:
            raise RuntimeError(
                "stronghold: forward() was called after the backward() that ends a gradient-accumulation "
                "window and before step(). The streamed blocks' update for that step is already running, "
                "so the model is between two versions. Call engine.step() right after engine.backward(), "
                "then run the forward (an evaluation after step() sees the updated weights).")
        if self.window is not None:
            self.window.begin(Phase.FORWARD, training)
        if self.activations is not None:
            self.activations.begin(Phase.FORWARD, training)

    def begin_backward(self, boundary: bool, loss_scale: float = 1.0) -> None:
        """A backward of a loss multiplied by `loss_scale` (fp16 loss scaling; 1.0 otherwise) begins."""
        if self.state is StepState.UPDATING:
            raise RuntimeError("stronghold: backward() was called twice without step() in between at a gradient-"
                               "accumulation boundary; call engine.step() after each engine.backward()")
        if not boundary and self.accumulation_steps == 1 and self.window is not None:
            raise ValueError("stronghold: backward() outside a gradient-accumulation boundary, but "
                             "gradient_accumulation_steps is 1, so the streamed blocks have no buffers to accumulate "
                             "in (set_gradient_accumulation_boundary(False), or \"managed_gradient_accumulation\": "
                             "false?); set gradient_accumulation_steps in ds.json to the micro-batches of a step")
        self._begin_micro_step(boundary, loss_scale)
        if self.activations is not None:
            self.activations.begin(Phase.BACKWARD)
        if self.window is not None:
            self.window.begin(Phase.BACKWARD, True)

    def _begin_micro_step(self, boundary: bool, loss_scale: float) -> None:
        """What a micro-step starts from, noted so that `abort_backward` can return to it."""
        # The scale changes only in step(), so every micro-step of a window carries the same one.
        assert self.state is StepState.IDLE or loss_scale == self.loss_scale, (loss_scale, self.loss_scale)
        self._state_before_backward = self.state
        self.boundary = boundary
        self.loss_scale = loss_scale
        if self.cpu is None:
            return
        self.cpu.begin_micro_step(self.stores.values(), 1.0 / loss_scale)
        for state, store in zip(self.micro.values(), self.stores.values()):
            state.arrived, state.offloaded = 0, False
            state.accum_before = state.accum_started
            for entry in store.trainable:
                entry.grad_this_micro = False
                entry.window_before = entry.grad_this_window

    def end_backward(self) -> None:
        """Offload what backward left partial (unused parameters) and, at the boundary, blocks that got
        gradients only in earlier micro-steps."""
        if self.window is not None:
            for index, state in self.micro.items():
                store = self.stores[index]
                if state.offloaded:
                    continue
                if state.arrived or (self.boundary and any(e.grad_this_window for e in store.trainable)):
                    self._offload(index)
        if not self.boundary:
            self.resident.end_micro_step()
            if self.device_accum is not None:
                self.device_accum.fold()
        elif self.data_parallel is not None:
            self.data_parallel.start_resident(self.resident.window_grads())  # step() waits for it
        self.state = StepState.UPDATING if self.boundary else StepState.ACCUMULATING

    def abort_backward(self) -> None:
        """An exception escaped backward: discard this micro-step and leave everything as it was before
        it began (earlier micro-steps' accumulated gradients included), so the caller can go on."""
        failure: Optional[BaseException] = None
        if self.cpu is not None:
            self.transfers.wait_offloads()  # the copies of the buffers `abort` gives back have landed
            try:
                self.cpu.abort()
            except RuntimeError as err:
                failure = err
            for index, state in self.micro.items():
                state.arrived, state.offloaded = 0, False
                state.accum_started = state.accum_before
                for entry in self.stores[index].trainable:
                    entry.param.grad = None
                    entry.grad_this_micro = False
                    entry.grad_this_window = entry.window_before
            self.window.reset()
            if self.device_accum is not None:
                self.device_accum.drop()
        if self.activations is not None:
            self.activations.begin(Phase.FORWARD)
        self.resident.drop_micro_step()
        if self.data_parallel is not None:
            self.data_parallel.drop_pending()
        self.state = self._state_before_backward
        if failure is not None:
            raise failure

    # Optimizer ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """The optimizer step at an accumulation boundary: exact global clipping, then both optimizers.
        A non-finite global gradient norm skips the step everywhere; returns True when skipped. From every state
        (IDLE, ACCUMULATING, UPDATING) as step_state.py's docstring says."""
        if self.state is StepState.IDLE:
            self._last_norm = 0.0
            self.steps += 1
            return False
        if self.state is StepState.ACCUMULATING:
            self._close_window()
        if self.data_parallel is not None:
            self.data_parallel.finish_resident()
        try:
            streamed = self.cpu.grad_sq_sum() if self.cpu is not None else 0.0
        except BaseException:
            if self.cpu.failed:  # the worker lost a job of this micro-step: its gradients cannot be summed
                self.abort_backward()  # raises the worker's failure
            raise
        # After the one wait that can fail: the resident sums add the boundary's gradients into the resident
        # accumulators, which a discarded micro-step could not take back out (on a GPU they queue behind the
        # resident blocks' backward, so launching them here rather than first costs no overlap unless the CPU's
        # sums arrive after that backward is done).
        resident_sq = self.resident.grad_sq_sum()
        # One device sync per step: whether to skip must be known before the resident update.
        resident = float(resident_sq) if resident_sq is not None else 0.0
        if self.data_parallel is not None:
            total = self.data_parallel.agree_sq(streamed, resident)
        else:
            total = streamed + resident
        self._last_norm, coef = norm_and_clip_coef(total, self.max_grad_norm, self.loss_scale)
        skip = not math.isfinite(total)
        if self.cpu is not None:
            self.cpu.finish_step(coef, skip=skip, total_sq=self._last_norm ** 2)
            if self.data_parallel is not None:
                self.data_parallel.publish(self)
        if skip:
            self.resident.zero_grad()
            self.skipped_steps += 1
            # With fp16, an overflow is how dynamic loss scaling finds the largest scale that fits: routine.
            level = logging.INFO if self.compute_dtype == torch.float16 else logging.WARNING
            logger.log(level, f"step {self.steps + 1} skipped: the global gradient norm is "
                              f"{self._last_norm} (inf/NaN in the gradients, loss scale {self.loss_scale}); no "
                              "parameter was updated")
        else:
            self.resident.step(coef / self.loss_scale)
        self.steps += 1
        self.state = StepState.IDLE
        if self.window is not None:
            self.window.forget_cached()
        return skip

    def _close_window(self) -> None:
        """End the accumulation window at step() without its boundary backward: as a boundary backward that produced
        no gradient would, so each streamed block's update takes the window's gradients so far (from the host or
        GPU accumulator) and no part of the model is left out."""
        self._begin_micro_step(boundary=True, loss_scale=self.loss_scale)
        try:
            self.end_backward()
        except BaseException:
            self.abort_backward()
            raise

    def grad_norm(self) -> Optional[float]:
        """The last step's global gradient norm."""
        return self._last_norm

    def master_params(self) -> dict[int, torch.Tensor]:
        """id(param) -> the fp32 value the optimizer updates (host for streamed, device for resident).
        Call `synchronize()` first so every streamed block's latest update has landed. A sharded block
        (data parallel) holds only its shard of the fp32 master: its working copy stands in (the master
        itself in fp32; the bf16 weights otherwise, which is what a model's state_dict holds anyway)."""
        masters = {id(p): m for chunk in self.resident.chunks for p, m in zip(chunk.params, chunk.masters)}
        for store in self.stores.values():
            for entry in store.entries:
                source = store.master if entry.group is not None and not store.sharded else store.working
                masters[id(entry.param)] = entry.host_view(source)
        for param in self.model.parameters():  # frozen resident parameters are their own value
            masters.setdefault(id(param), param.data)
        return masters

    def zero_grad(self) -> None:
        self.resident.zero_grad()

    def synchronize(self) -> None:
        """Finish all CPU work and put every block's final weights in its host copy. With data parallel the
        host copy is node-shared and each local rank writes its shard of it: draining this rank's worker
        finishes only this rank's shard, so wait for every rank's publication of the current epoch too
        (otherwise a read of the weights, e.g. a state_dict, right after the last step may see another
        rank's shard of that step half written or not at all)."""
        if self.cpu is not None:
            self.cpu.drain()
            self.window.evict_all()
        if self.data_parallel is not None and self.data_parallel.shared is not None:
            self.data_parallel.shared.wait_all()

    def require_idle(self, call: str) -> None:
        """Raise (step_state.require_idle) unless no gradients are pending: before `call` changes anything."""
        require_idle(self.state, call)

    @property
    def mid_step(self) -> bool:
        """Gradients are pending (between a backward and the step that ends its window)."""
        return self.state is not StepState.IDLE

    def close(self) -> None:
        self.hooks.detach()
        if self.activations is not None:
            self.activations.detach()
        if self.mlp_chunks is not None:
            self.mlp_chunks.detach()
        if self.cpu is not None:
            self.cpu.close()
        if self.data_parallel is not None:
            self.data_parallel.close()
