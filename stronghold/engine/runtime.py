"""Everything stronghold adds to one model, wired together: placement, window, hooks, both optimizers.

The engine (engine.py) owns one runtime and calls `begin_forward`, `begin_backward`,
`end_backward` and `step` around DeepSpeed's own bookkeeping.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from stronghold.memory.activations import ActivationOffload, blocks_to_offload
from stronghold.memory.mlp_chunks import MlpChunks, chunk_tokens_of
from stronghold.planning.plan_bytes import check_host_fits, store_bytes, unit_store_bytes
from stronghold.planning.plan_rest import BLOCKWISE_SUMMED
from stronghold.planning.plan_inputs import drive_slots, host_available
from stronghold.planning.placement import Placement, PlannedStart
from stronghold.planning.promotion import PartClock
from stronghold.memory.long_context import LongContextAuto
from stronghold.integrations import compiler_setup
from stronghold.integrations.compile import CompiledBlocks, compile_blocks, start_set_up
from stronghold.config import Settings
from stronghold.engine.blockwise import BlockwiseBackward
from stronghold.engine.block_major import RunsAhead
from stronghold.engine.collector import StepCollector
from stronghold.engine.cores import pin_worker
from stronghold.engine.first_step import FirstStepClock
from stronghold.optim.cpu_adam import load_kernel
from stronghold.optim.cpu_optim import CpuOptimizer
from stronghold.distributed.data_parallel import DataParallel
from stronghold.distributed.resident_reduce import ResidentReductions
from stronghold.streaming.device_accum import DeviceAccumulators
from stronghold.integrations.discovery import ModelParts, check_materialized, split_rest
from stronghold.optim import param_state
from stronghold.optim.gpu_optim import ResidentOptimizer, place_resident
from stronghold.streaming.hooks import Hooks
from stronghold.engine.handoff import GradientHandOff
from stronghold.engine.host_buffers import BufferLayout, build_host_buffers
from stronghold.engine.micro_step import MicroSteps
from stronghold.engine.stepping import OptimizerStep
from stronghold.engine.relayout import Relayout
from stronghold.engine.layout_rules import check_layout
from stronghold.engine.optimizer import group_map
from stronghold.streaming.schedule import Phase, WindowSchedule
from stronghold.streaming.cached import INDEX_OF, CachedUnits
from stronghold.streaming.nvme import NvmeStates
from stronghold.streaming.nvme_setup import count_on_drive
from stronghold.streaming.pinned import HostMeter
from stronghold.streaming.prefault import Prefault
from stronghold.streaming.promotion_fill import PromotionFill
from stronghold.streaming.release import HostReleaser
from stronghold.streaming.store import BlockStore, counts, cpu_param_bytes, order_entries
from stronghold.engine.step_state import MicroState, StepState, require_idle
from stronghold.streaming.streams import Transfers
from stronghold.streaming.window import Window


class StrongholdRuntime(GradientHandOff, MicroSteps, OptimizerStep, Relayout, RunsAhead):
    def __init__(self, model: nn.Module, parts: ModelParts, settings: Settings, param_groups: list[dict],
                 device: torch.device, compute_dtype: torch.dtype, accumulation_steps: int, max_grad_norm: float,
                 resident_blocks: int, window_size: int, data_parallel: Optional[DataParallel] = None,
                 lean_blocks: int = 0, host_planned: bool = False, gpu_accumulation: bool = False,
                 cached_parts: frozenset[str] = frozenset(), gradient_spares: bool = True,
                 nvme_blocks: Optional[int] = 0, planned: Optional[PlannedStart] = None, rank0: bool = True,
                 compact_master: bool = False, pooled_grads: bool = False):
        """`settings`: the "stronghold" section as resolved for the device (config.resolve). `resident_blocks` /
        `window_size` / `lean_blocks`: the placement (numbers: placement.py plans what the settings leave to
        stronghold; lean blocks are the first streamed ones, store.py). `host_planned`: the planner already
        checked host memory (on a GPU); otherwise the runtime checks the streamed blocks' buffers itself.
        `data_parallel`: the replicas' reducer with several ranks; the streamed stores are then built sharded
        over one node-shared working copy (sharding.py), a collective. `gpu_accumulation`: the streamed blocks'
        gradients are accumulated on the GPU (device_accum.py; accumulation, one process). `cached_parts`: the parts
        outside the blocks ("input", "output": discovery.split_rest) in the cached tier (cached.py; one process).
        `gradient_spares`: with host accumulation, a second gradient buffer per streamed block (store.py).
        `compact_master`: the streamed blocks in host memory keep compact fp32 masters (compact.py).
        `pooled_grads`: with host accumulation, the streamed blocks share pooled landing buffers (grad_pool.py).
        `nvme_blocks`: the last streamed blocks whose fp32 states live in files under settings.nvme_path (nvme.py);
        None: the fewest that make host memory fit (unless `host_planned`, which gives the number). `planned`: the
        start-up plan on a GPU, from which the placement (placement.py) goes on planning. `rank0`: this process logs
        what every rank does alike."""
        clock = PartClock()
        self.model, self.settings, self.param_groups = model, settings, param_groups
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
        # The compiler's set-up from here, beside the host buffers' (the CPU probe waits for it; the one line started
        # it already): compile.start_set_up.
        start_set_up(parts.blocks, settings.compile, device)
        named = dict(model.named_parameters())
        group_of = group_map(model, param_groups)

        n_blocks = len(parts.blocks)
        self.resident_count = min(resident_blocks, n_blocks)
        streamed = list(range(self.resident_count, n_blocks))
        self.window_size = min(window_size, len(streamed))
        if streamed and self.window_size < window_size:
            warnings.warn(f"stronghold: window_size {window_size} is more than the {len(streamed)} streamed "
                          f"blocks; using {self.window_size}")

        check_layout(settings, compute_dtype, accumulation_steps, data_parallel, cached_parts, gpu_accumulation,
                     min(lean_blocks, len(streamed)), compact_master, pooled_grads)
        self.compact_master, self.pooled_grads = compact_master, pooled_grads
        layouts = {i: order_entries([(n, named[n]) for n in parts.block_param_names[i]], group_of) for i in streamed}
        # A part with nothing to train stays resident: in the cached tier it would only gain a host copy.
        unit_layouts = {INDEX_OF[name]: (name, order_entries([(n, named[n]) for n in names], group_of))
                        for name, names in split_rest(model, parts).items() if name in cached_parts}
        unit_layouts = {i: v for i, v in unit_layouts.items() if any(e.group is not None for e in v[1])}
        self.cached_parts = frozenset(name for name, _ in unit_layouts.values())
        accumulate = accumulation_steps > 1
        blockwise = settings.blockwise_backward is True
        # Blockwise, a streamed block's gradients reach the host once a step as an fp32 sum, as with gpu_accumulation.
        fp32_grads = gpu_accumulation or blockwise
        host_accumulate = accumulate and not fp32_grads
        lean = min(lean_blocks, len(streamed))
        self.lean_until = self.resident_count + lean
        """Blocks below this index are lean while streamed (their stores have no gradient buffer)."""
        self.gradient_spares = host_accumulate and (gradient_spares or data_parallel is not None)
        """The streamed blocks' stores have a second gradient buffer (store.py; sharded ones always do)."""
        # The units accumulate on the host whatever the blocks do (cached.py): they drop their spares only where the
        # blocks do so on the host, for want of host memory.
        unit_spares = self.gradient_spares or not host_accumulate
        nvme = 0 if settings.nvme_path is None else nvme_blocks
        nvme_buffers = (planned.plan.drive.slots if planned is not None and planned.plan.drive is not None
                        else drive_slots(settings)["slots"])
        """The NVMe tier's staging buffers: the plan's, else as set (plan_inputs.drive_slots)."""

        def check_host(on_drive: int) -> None:
            # What the buffers replace: every CPU parameter (the resident ones go to the device first, below).
            # The units accumulate on the host whatever the blocks do (cached.py).
            cb = compute_dtype.itemsize
            needed = store_bytes([counts(entries) for entries in layouts.values()], cb, accumulate, lean,
                                 fp32_grads, self.gradient_spares, on_drive, nvme_buffers,
                                 compact_master, pooled_grads)
            needed += unit_store_bytes([(name, *counts(entries)) for name, entries in unit_layouts.values()], cb,
                                       accumulate, unit_spares, BLOCKWISE_SUMMED if blockwise else frozenset())
            limit = settings.host_memory_limit_gb
            check_host_fits(needed, host_available(limit), cpu_param_bytes(model), limit)

        if (streamed or unit_layouts) and not host_planned:
            nvme = count_on_drive(check_host, len(streamed), nvme)
        on_drive = {i: layouts[i] for i in streamed[len(streamed) - (nvme or 0):]}
        self.nvme_from = min(on_drive, default=n_blocks)
        """Blocks from this index on keep their fp32 states on the NVMe drive while streamed (nvme.py)."""
        # The resident blocks and the rest go to the GPU first: their host storage (the model as the user
        # built it, fp32 on the CPU say) is freed before the streamed blocks' host buffers grow, so the host
        # peak is the planned buffers, not those plus the resident part of the model.
        streamed_ids = {id(p) for i in streamed for p in parts.blocks[i].parameters()}
        cached_ids = {id(e.param) for _, entries in unit_layouts.values() for e in entries}
        clock.mark("layout_s")
        master_values = place_resident(model, streamed_ids | cached_ids, device, compute_dtype)
        clock.mark("resident_to_device_s")
        pin = settings.pin_memory and device.type == "cuda"
        self.host_bytes = HostMeter()
        """Host bytes of the streamed blocks' buffers, now and at their high-water mark (store.py)."""
        layout = BufferLayout(compute_dtype, pin, host_accumulate, accumulate, fp32_grads, self.lean_until,
                              self.gradient_spares, compact_master, pooled_grads, nvme_buffers)
        buffers = build_host_buffers(layouts, {i: e for i, (_, e) in unit_layouts.items()}, set(on_drive), layout,
                                     settings, data_parallel, self.host_bytes)
        self.stores: dict[int, BlockStore] = buffers.stores
        unit_stores = buffers.unit_stores
        """With data parallel the cached units' stores, built sharded with the blocks' (cached.py)."""
        self.nvme: Optional[NvmeStates] = buffers.nvme
        """The NVMe tier of the last streamed blocks' fp32 states (nvme.py), or None."""
        clock.mark("host_buffers_s")
        self.transfers = Transfers(device)
        self.releaser = HostReleaser(device)
        """Drops the host buffers promoted blocks leave behind, off this thread (release.py)."""
        self.promotion_fill: Optional[PromotionFill] = None
        """A promotion's copies running on their thread (relayout.promote, promotion_fill.py), until waited for."""
        self.promotion_fills: list[dict] = []
        """The finished ones' reports (threads' seconds, the training thread's waits)."""
        self.first_step = FirstStepClock()
        """The first optimizer step's host time by phase, for the report (first_step.py)."""
        self.cached = CachedUnits(self.transfers, wait=lambda event, what: self.cpu.wait(event, what))
        """The parts outside the blocks in the cached tier (cached.py); their stores have negative indices."""
        for index, (name, _) in unit_layouts.items():
            if index in unit_stores:  # data parallel: built sharded with the blocks' stores
                self.cached.adopt(name, unit_stores[index], compute_dtype, data_parallel.shared)
        self.cached.build({i: layout for i, layout in unit_layouts.items() if i not in unit_stores}, compute_dtype, pin,
                          accumulate, self.host_bytes, unit_spares,
                          summed=frozenset(INDEX_OF[name] for name in BLOCKWISE_SUMMED) if blockwise else frozenset())
        clock.mark("cached_parts_s")
        self.micro = {i: MicroState() for i in [*streamed, *unit_layouts]}
        self.device_accum = DeviceAccumulators(self.stores, device) if gpu_accumulation and streamed else None
        """The streamed blocks' fp32 gradient sums on the GPU (device_accum.py), or None (host accumulation)."""

        chunks = [[(p, group_of[id(p)]) for p in parts.blocks[i].parameters() if id(p) in group_of]
                  for i in range(self.resident_count)]
        in_blocks = {id(p) for block in parts.blocks for p in block.parameters()}
        chunks.append([(p, group_of[id(p)]) for p in model.parameters() if id(p) in group_of
                       and id(p) not in in_blocks and id(p) not in cached_ids])
        self.resident = ResidentOptimizer(chunks, param_groups, master_values, fused=device.type == "cuda",
                                          accumulate=accumulate)
        self.resident_reductions = (ResidentReductions(data_parallel, self.resident, model)
                                    if data_parallel is not None else None)

        clock.mark("resident_optimizer_s")
        self.hooks = Hooks(self)
        self.blockwise: Optional[BlockwiseBackward] = None
        """The backward block by block at the boundary (blockwise.py), where "blockwise_backward" is on."""
        if blockwise:
            self.blockwise = BlockwiseBackward(self, self.blocks)
            self.blockwise.attach()
        self.activations: Optional[ActivationOffload] = None
        offloaded = blocks_to_offload(settings.offload_activations, n_blocks)
        # Hooked only when blocks are chosen: every saved tensor of every forward goes through the hooks,
        # a host cost the default path should not pay unless the activations would not fit (long_context.py).
        if offloaded:
            self.offload_activations(offloaded)
        chunking = chunk_tokens_of(settings.mlp_chunk_tokens, offloading=bool(offloaded))
        self.mlp_chunks = None if chunking == "off" else MlpChunks(dict(enumerate(parts.blocks)), chunking)
        if self.mlp_chunks is not None:
            self.mlp_chunks.attach()
        self.window: Optional[Window] = None
        self.cpu: Optional[CpuOptimizer] = None
        self.worker_cores: tuple[int, ...] = ()
        # The CPU optimizer serves the streamed blocks and the cached units (streaming/cached.py) alike.
        self.landed = {i: self.transfers.event() for i in self.micro}
        if self.micro:
            self.cpu = CpuOptimizer(load_kernel(settings.cpu_optimizer_threads), param_groups,
                                    write_working=compute_dtype != torch.float32, max_grad_norm=max_grad_norm,
                                    stall_timeout_s=settings.stall_timeout_s, weights_first=settings.weights_first)
            self.worker_cores = pin_worker(self.cpu)  # all of this rank's cores but the launching thread's
        if streamed:
            self._build_window()
        if self.cached.units:
            self.hooks.attach_units(self.cached.stores)
            self.cached.attach(model, self._before_cached_forward)
        clock.mark("cpu_optimizer_and_window_s")
        self._last_norm: Optional[float] = None
        self._prepared: Optional[tuple[float, bool]] = None
        """prepare_step's result, for the step() that follows."""
        self.steps = 0
        self.batches_ahead = False
        """The windows' micro-batches come ahead of their forwards (engine.window_batches, as the Trainer line gives
        them): "block_major_forward" runs only then, so the planner counts on it only then (`runs_ahead`)."""
        self.placement: Optional[Placement] = None
        """On a GPU: measures the first step, then promotes."""
        self.long_context: Optional[LongContextAuto] = None
        """On a GPU where offload_activations or kernels is left to stronghold: decides by the first training batch."""
        if planned is not None:
            self.placement = Placement(self, planned.spec, planned.budget, settings, planned.plan)
            compiler_setup.wait_all(compiler_setup.FIRST_CALL_WAIT_S)  # the probe has the cores to itself
            self.placement.measure_rates()
            if settings.offload_activations is None or settings.kernels is None:
                self.long_context = LongContextAuto(self, planned.budget.gpu_bytes)
        clock.mark("placement_rates_s")
        self.collector = StepCollector(settings.garbage_collection,
                                       group=data_parallel.config.group if data_parallel is not None else None)
        """Python's full garbage collections at step boundaries, the data-parallel ranks at the same steps."""
        # After the runtime's own forwards (MLP chunks) are installed: the compiled block forward calls them.
        self.compiled: Optional[CompiledBlocks] = compile_blocks(parts.blocks, settings.compile, device, rank0=rank0)
        """The blocks' compiled forward when the "compile" setting compiles them."""
        clock.mark("compile_set_up_s")
        self.prefault: Optional[Prefault] = None
        """The moments, mapped zero-filled and first written by the first update, faulted in on a thread before then
        (`start_prefault`): from here where nothing is placed, else from the end of the first training forward, once its
        placement has promoted what it promotes (a promoted block's moments are never written on the host) and its
        compile is done (it maps memory all through, and the populating holds the lock that mapping takes)."""
        if self.placement is None:
            self.start_prefault()
        self.set_up: dict = {"parts_s": clock.parts}
        """Host seconds of the construction by part, each from the end of the one before, for the report; the
        engine adds its planning and its whole construction (DeepSpeed's own included)."""

    def start_prefault(self) -> None:
        """Populate the host stores' moments on a thread (prefault.py), once, in the order the first step's updates
        write them: the input embeddings, the blocks, the head."""
        if self.prefault is not None:
            return
        units = self.cached.stores
        ordered = [*(units[i] for i in (INDEX_OF["input"],) if i in units), *self.stores.values(),
                   *(units[i] for i in (INDEX_OF["output"],) if i in units)]
        self.prefault = Prefault((t for store in ordered for t in (store.exp_avg, store.exp_avg_sq) if t is not None),
                                 fault_in=self.cpu.kernel.fault_in if self.cpu is not None else None)

    def _build_window(self) -> None:
        """Slots, schedule and hooks for the blocks in `self.stores` at `self.window_size`."""
        streamed = sorted(self.stores)
        largest = max(store.numel for store in self.stores.values())
        self.transfers.allocate_slots(self.window_size, largest, self.compute_dtype)
        shared = self.data_parallel.shared if self.data_parallel is not None else None
        if shared is not None:
            shared.watch(self.cpu.check)
        self.window = Window(self.stores, WindowSchedule(tuple(streamed), self.window_size), self.transfers,
                             wait=self.cpu.wait, shared=shared)
        self.hooks.attach({i: self.blocks[i] for i in streamed})

    def _store(self, index: int) -> BlockStore:
        """A streamed block's store, or a cached unit's (negative index)."""
        return self.stores[index] if index >= 0 else self.cached.units[index].store

    def host_stores(self) -> list[BlockStore]:
        """Every store whose fp32 state the CPU optimizer updates: the cached units', then the streamed blocks'."""
        return [*self.cached.stores.values(), *self.stores.values()]

    def _check_not_updating(self) -> None:
        if self.state is StepState.UPDATING:
            raise RuntimeError(
                "stronghold: forward() was called after the backward() that ends a gradient-accumulation "
                "window and before step(). The streamed blocks' update for that step is already running, "
                "so the model is between two versions. Call engine.step() right after engine.backward(), "
                "then run the forward (an evaluation after step() sees the updated weights).")

    def _before_cached_forward(self) -> None:
        """A forward pre-hook of the model and of the cached parts' modules (cached.py): their weights current."""
        self._check_not_updating()
        self.cached.ensure()

    # Phases, called by the engine -------------------------------------------------------------
    def begin_forward(self, training: bool, boundary: bool = False) -> None:
        """`boundary`: this forward's backward ends the accumulation window (its updates will read the states)."""
        self._check_not_updating()
        if training and boundary:
            self._read_ahead_states()
        if self.blockwise is not None:
            self.blockwise.begin_forward(training)
        if self.window is not None:
            # Blockwise, only the boundary's backward walks the blocks: other forwards free every slot they leave.
            self.window.begin(Phase.FORWARD, training and (boundary or self.blockwise is None),
                              prefetch=not self.blocks_inert)
        if self.blockwise is not None and training:
            self.blockwise.run_ahead(allowed=self.placement is None or not self.placement.timing)
        if self.activations is not None:
            self.activations.begin(Phase.FORWARD, training)

    def master_params(self) -> dict[int, torch.Tensor]:
        """id(param) -> the fp32 value the optimizer updates (param_state.master_params)."""
        return param_state.master_params(self)

    def zero_grad(self) -> None:
        self.resident.zero_grad()

    def synchronize(self) -> None:
        """Finish all CPU work and put every block's final weights in its host copy. With data parallel the
        host copy is node-shared and each local rank writes its shard of it: draining this rank's worker
        finishes only this rank's shard, so wait for every rank's publication of the current epoch too
        (otherwise a read of the weights, e.g. a state_dict, right after the last step may see another
        rank's shard of that step half written or not at all)."""
        self.finish_promotion()
        if self.cpu is not None:
            self.cpu.drain()
            if self.window is not None:
                self.window.evict_all()
        # Mid-step (a save refuses it later) a unit whose update waits for step() keeps its weights.
        self.cached.ensure(only_updated=True)
        if self.data_parallel is not None and self.data_parallel.shared is not None:
            self.data_parallel.shared.wait_all(store.index for store in self.host_stores())

    def require_idle(self, call: str) -> None:
        """Raise (step_state.require_idle) unless no gradients are pending: before `call` changes anything."""
        require_idle(self.state, call)

    @property
    def mid_step(self) -> bool:
        """Gradients are pending (between a backward and the step that ends its window)."""
        return self.state is not StepState.IDLE

    def close(self) -> None:
        if self.prefault is not None:
            self.prefault.close()
        if self.promotion_fill is not None:  # nothing reads the values any more: a failed copy is not raised here
            self.promotion_fill.finish(raise_error=False)
            self.promotion_fill = None
        self.collector.close()
        if self.compiled is not None:
            self.compiled.detach()
        self.hooks.detach()
        self.hooks.detach_units()
        if self.blockwise is not None:
            self.blockwise.detach()
        self.cached.detach()
        if self.activations is not None:
            self.activations.detach()
        if self.mlp_chunks is not None:
            self.mlp_chunks.detach()
        if self.cpu is not None:
            self.cpu.close()
        if self.nvme is not None:  # after the CPU jobs, the last of which may still write states back
            self.nvme.close()
        if self.resident_reductions is not None:
            self.resident_reductions.detach()
        if self.data_parallel is not None:
            self.data_parallel.close()
        self.releaser.close()
