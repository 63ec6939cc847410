"""StrongholdEngine: DeepSpeed's engine with stronghold's placement, window and optimizer. Glue only.

DeepSpeed keeps doing what it does well: configuration, the batch / accumulation bookkeeping, LR
schedulers, timers, monitoring, launching. The engine overrides exactly the places where the whole
model would otherwise be moved to or optimized on the GPU:
- `_configure_distributed_model`: split the model into streamed blocks (host) and the rest (GPU)
  before DeepSpeed casts anything, so fp32 masters come from the original fp32 values;
- `_configure_optimizer`: the AdamW facade over the runtime (no ZeRO / BF16 optimizer wrappers);
- `forward` / `backward` / `step` bracket DeepSpeed's own with the runtime's phases; with fp16,
  `backward` multiplies the loss by the loss scale (DeepSpeed does that only for its own ZeRO and fp16
  optimizers, never for a client optimizer such as ours);
- `clip_fp32_gradients`: clipping is done exactly inside the optimizer step (global norm).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Optional, Sequence

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from torch import nn

from stronghold.planning import initial_plan, placement

from stronghold.planning import plan_inputs, plan_text
from stronghold.config import Settings, StrongholdConfig
from stronghold.distributed.data_parallel import check_same_settings, data_parallel_for, replica_settings
from stronghold.integrations.discovery import find_blocks
from stronghold.memory.batch_lengths import BatchLengths
from stronghold.optim.loss_scale import LossScaleConfig, LossScaler
from stronghold.engine.collector import free_dropped_engines
from stronghold.engine.interrupts import deferred_interrupt
from stronghold.engine.optimizer import StrongholdOptimizer, resolve_param_groups
from stronghold.engine.runtime import StrongholdRuntime
from stronghold.engine.step_state import StepState
from stronghold.engine.telemetry import runtime_report

OWN_THREADS = "stronghold-"
"""The prefix of the names of the threads stronghold starts (the CPU optimizer's, the prefault's, ...)."""
CLOSE_THREAD = "stronghold-close"

logger = logging.getLogger(__name__)

FRAGMENTED = 0.125
"""An OOM with more than this share of the allocator's reserve unallocated is (also) fragmentation."""


def fragmentation_hint(device, reserved: Optional[int] = None, allocated: Optional[int] = None) -> str:
    """Advice for an OOM whose allocator holds much reserved but unallocated memory (Llama at seq 163840
    under a 32 GiB cap: 5.8 GiB of it); empty when there is little."""
    if reserved is None:
        if device is None or device.type != "cuda":
            return ""
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    idle = reserved - allocated
    if reserved <= 0 or idle <= FRAGMENTED * reserved:
        return ""
    return (f" {idle / 2 ** 30:.1f} GiB of the {reserved / 2 ** 30:.1f} GiB the allocator reserved was free but "
            "in pieces too small: start the process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")


def scheduler_from_config(name: Optional[str], params: dict, optimizer, default):
    """The ds.json "scheduler", as DeepSpeed builds it (`default()`), but for DeepSpeed's warm-up schedulers
    without the warning their constructors log on every run ("Attempting to get learning rate from scheduler
    before it has started"): at `last_batch_iteration` -1 (the default, a fresh start) the constructor reads
    its own rate before its first step to set the optimizer's starting rate. Built at -2 it skips that read;
    the starting rate that read returns (the warm-up's minimum: `min_lrs`, or 0 for WarmupCosineLR) and the
    iteration -1 are then set as the constructor would have, so the schedule is DeepSpeed's step for step."""
    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, name, None) if name is not None else None
    warmup = cls is not None and issubclass(cls, (lr_schedules.WarmupLR, lr_schedules.WarmupCosineLR))
    if not warmup or params.get("last_batch_iteration", -1) != -1:
        return default()
    scheduler = cls(optimizer, **{**params, "last_batch_iteration": -2})
    start = ([0.0] * len(scheduler.org_lrs) if isinstance(scheduler, lr_schedules.WarmupCosineLR)
             else scheduler.min_lrs)
    scheduler.last_batch_iteration = -1
    scheduler._last_lr = lr_schedules.update_lr(scheduler.optimizer.param_groups, start)
    return scheduler


class StrongholdEngine(DeepSpeedEngine):
    def __init__(self, *args, stronghold_config: StrongholdConfig, stronghold_settings: Settings,
                 blocks: Optional[Sequence[nn.Module]] = None, model_parameters=None, **kwargs):
        """`stronghold_config`: the section as given (checked against the other ranks', written into checkpoints);
        `stronghold_settings`: what it resolves to on this engine's device (config.resolve), which everything
        built here reads."""
        # Set before DeepSpeedEngine.__init__ (which calls the overrides below); via __dict__ because
        # nn.Module.__setattr__ refuses module-valued attributes before Module.__init__.
        self.__dict__["_sh_config"] = stronghold_config
        self.__dict__["_sh_settings"] = stronghold_settings
        self.__dict__["_sh_blocks"] = blocks
        self.__dict__["_sh_model_parameters"] = model_parameters
        self.__dict__["_sh_runtime"] = None
        self.__dict__["_sh_report_since"] = 0  # the optimizer step of the last stronghold_report(reset=True)
        self.__dict__["_sh_batches"] = BatchLengths()
        kwargs["dont_change_device"] = True
        start = time.perf_counter()
        free_dropped_engines()  # before this engine's plan reads the free GPU and host memory
        super().__init__(*args, model_parameters=model_parameters, **kwargs)
        self._sh_runtime.set_up["engine_s"] = time.perf_counter() - start
        # DeepSpeed's all-reduce would reduce every gradient after backward; the runtime reduces each
        # streamed block's gradients as they are produced and the resident ones at the step instead.
        self.enable_backward_allreduce = False

    # Construction -------------------------------------------------------------------------------
    def _configure_distributed_model(self, model: nn.Module) -> None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world > 1:  # before anything is built, so a mismatch fails on every rank instead of hanging later
            check_same_settings(replica_settings(self._sh_config.model_dump(), self, model))
        compute_dtype = (torch.bfloat16 if self.bfloat16_enabled() else torch.float16 if self.fp16_enabled()
                         else torch.float32)
        groups = resolve_param_groups(model, self.client_optimizer, self._sh_model_parameters,
                                      self.optimizer_name(), self.optimizer_params())
        scaler = None
        if self.fp16_enabled():
            scaler = LossScaler(LossScaleConfig.from_deepspeed(self._config.float16_config))
        optimizer = StrongholdOptimizer(groups, loss_scaler=scaler)
        parts = find_blocks(model, self._sh_blocks, self._sh_settings.blocks_path)
        device, settings = torch.device(self.device), self._sh_settings
        placement_plan = None
        planning = time.perf_counter()
        if device.type == "cuda":
            # Planned before anything large is allocated: a placement that cannot fit fails here.
            trainable = {id(p) for group in optimizer.param_groups for p in group["params"]}
            spec = plan_inputs.model_spec(model, parts, trainable, compute_dtype, self.gradient_accumulation_steps())
            budget = plan_inputs.budgets(model, settings, device)
            placement_plan = initial_plan.initial_plan(spec, budget, settings)
            # Re-plans keep the drive's staging buffers as built (the plan's count, where "auto" chose one).
            budget = dataclasses.replace(budget, drive=placement_plan.drive)
            resident, window = initial_plan.agree(placement_plan.resident_blocks, max(placement_plan.window_size, 2))
            lean = placement_plan.lean_blocks
            gpu_accumulation = placement_plan.gpu_accumulation
            cached_parts = initial_plan.agree_cached(placement_plan.cached_parts)
            spares = placement_plan.gradient_spares
            compact = placement_plan.compact_master
            pooled = placement_plan.pooled_grads
            nvme = placement_plan.nvme_blocks
        else:
            # Nothing to plan on the CPU: the settings hold numbers there (config.CPU_DEFAULTS for "auto").
            resident = settings.resident_blocks
            streamed = len(parts.blocks) - min(resident, len(parts.blocks))
            window = settings.window_size
            if settings.auto_window and streamed:  # clamped here, so the runtime's warning is kept for given numbers
                window = min(window, streamed)
            lean = settings.lean_blocks
            gpu_accumulation = settings.gpu_accumulation
            cached_parts = plan_inputs.cached_on_cpu(settings)
            spares = settings.gradient_spares
            compact = bool(settings.compact_master)
            pooled = bool(settings.pooled_grads)
            nvme = settings.nvme_blocks  # None: the fewest that fit
        # With several ranks the reducer comes first: the runtime builds the streamed blocks' host state
        # sharded with it, block by block, so no rank ever holds a full replica (sharding.py).
        data_parallel = data_parallel_for(self, resident, len(parts.blocks)) if world > 1 else None
        built = time.perf_counter()
        with self._guarded():
            runtime = StrongholdRuntime(model, parts, settings, optimizer.param_groups, device, compute_dtype,
                                        self.gradient_accumulation_steps(), self.gradient_clipping(),
                                        resident_blocks=resident, window_size=window, lean_blocks=lean,
                                        gpu_accumulation=gpu_accumulation, cached_parts=cached_parts,
                                        gradient_spares=spares, compact_master=compact, pooled_grads=pooled,
                                        nvme_blocks=nvme,
                                        data_parallel=data_parallel, host_planned=placement_plan is not None,
                                        planned=None if placement_plan is None else placement.PlannedStart(
                                            spec, budget, placement_plan),
                                        rank0=self.global_rank == 0)
        # Discovery, the parameter groups and the start-up plan (with data parallel the reducer too), before the
        # runtime's own parts: together what stronghold adds to DeepSpeed's construction (engine_s).
        runtime.set_up["parts_s"] = {"plan_s": built - planning, **runtime.set_up["parts_s"]}
        if placement_plan is not None and self.global_rank == 0:  # every rank agreed on this plan
            logger.info(f"placement at start-up:\n{plan_text.table(placement_plan)}")
        optimizer.bind(runtime)
        self.__dict__["_sh_runtime"] = runtime
        self.__dict__["_sh_optimizer"] = optimizer
        super()._configure_distributed_model(model)
        if data_parallel is not None:
            data_parallel.broadcast_resident(runtime)

    def _broadcast_model(self) -> None:
        """The runtime builds the streamed blocks from rank 0's values and `broadcast_resident` sends the
        rest (streamed weights live on the host, where DeepSpeed's broadcast of the module would not reach)."""

    def _configure_optimizer(self, client_optimizer, model_parameters) -> None:
        self.basic_optimizer = self.optimizer = self._sh_optimizer

    def _scheduler_from_config(self, optimizer):
        return scheduler_from_config(self.scheduler_name(), self.scheduler_params(), optimizer,
                                     lambda: super(StrongholdEngine, self)._scheduler_from_config(optimizer))

    # Training step --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _guarded(self):
        """Around each training call: whatever raises leaves the caller's grad mode as it found it, and a CUDA
        out-of-memory error gets the knobs that lower the memory. Why the grad mode: a Ctrl-C that lands between a
        `torch.no_grad()` block's enter and its `try` (or inside its exit), ours, DeepSpeed's or torch's, skips
        the restore, and a caller that catches the KeyboardInterrupt and trains on would build no graph."""
        grad_mode = torch.is_grad_enabled()
        try:
            yield
        except BaseException as err:
            torch.set_grad_enabled(grad_mode)
            if isinstance(err, torch.OutOfMemoryError):
                raise torch.OutOfMemoryError(f"{err}\n{self._oom_advice()}") from err
            raise

    def _oom_advice(self) -> str:
        rt, cfg = self._sh_runtime, self._sh_config
        window = rt.window_size if rt is not None else cfg.window_size
        resident = rt.resident_count if rt is not None else cfg.resident_blocks
        return (f"stronghold: the GPU ran out of memory with window_size={window} and "
                f"resident_blocks={resident}. Each resident block keeps its weights, gradients and fp32 "
                "AdamW states on the GPU (~16 bytes per parameter) and each window slot holds one block's "
                "weights: lower \"resident_blocks\" first, then \"window_size\", the micro-batch or the sequence "
                "length (long sequences: \"offload_activations\", then \"mlp_chunk_tokens\")."
                f"{self._sh_batches.advice()}{fragmentation_hint(rt.device if rt is not None else None)}")

    def forward(self, *inputs, **kwargs):
        runtime = self._sh_runtime
        with self._guarded():
            with runtime.first_step.phase("forward.placement"):
                training = torch.is_grad_enabled()
                if training:
                    self._sh_batches.see(inputs, kwargs)
                    if runtime.blockwise is not None:
                        runtime.blockwise.major.see_call(kwargs)
                        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
                            runtime.blockwise.major.refuse()  # every block's output is asked for: none is skipped
                if runtime.long_context is not None:  # before anything of the forward: it may install the offload
                    runtime.long_context.before_forward(inputs, kwargs, training=training)
                if runtime.placement is not None:  # before the window's first loads: it may promote blocks
                    runtime.placement.first_forward(inputs, kwargs, training=training)
                    runtime.placement.make_room(inputs, kwargs, training=training)
                runtime.begin_forward(training=training, boundary=self.is_gradient_accumulation_boundary())
                if runtime.placement is not None:
                    runtime.placement.before_forward(training=training)
            with runtime.first_step.phase("forward"):
                if training and runtime.compiled is not None:  # checkpointing and the KV cache (compile.training_call)
                    kwargs = runtime.compiled.training_call(self.module, kwargs)
                hooked = runtime.window is not None or runtime.activations is not None
                with runtime.hooks.saved_tensors() if hooked else contextlib.nullcontext():
                    out = super().forward(*inputs, **kwargs)
            if training:
                # After the first forward: after its promotion, so never a promoted block's moments, and after its
                # compile, which maps and unmaps memory all through and would wait on the populating (prefault.py).
                runtime.start_prefault()
            return out

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        if retain_graph:
            raise ValueError("retain_graph=True is not supported: stronghold hands each block's gradients to the "
                             "CPU optimizer as soon as they are complete")
        runtime = self._sh_runtime
        scale = self._sh_optimizer.cur_scale
        runtime.begin_backward(self.is_gradient_accumulation_boundary(), loss_scale=scale)
        try:
            with self._guarded(), runtime.first_step.phase("backward"):
                if self._sh_optimizer.loss_scaler is None:
                    result = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
                else:
                    # DeepSpeed's order (loss / GAS, then times the scale, in fp32 so the product cannot
                    # overflow) and its return value (the loss over GAS, unscaled), with the division done
                    # here so the scale can follow it.
                    result = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
                    super().backward(result.float() * scale, retain_graph=retain_graph, scale_wrt_gas=False)
                runtime.end_backward()
                if runtime.placement is not None:
                    runtime.placement.after_backward()
        except BaseException:
            # Leave the engine as before this backward (in-flight copies and CPU updates drained, the
            # partial step discarded), so the caller can catch the error and go on, or save.
            runtime.abort_backward()
            raise
        return result

    def step(self, lr_kwargs=None):
        runtime = self._sh_runtime
        clock = runtime.first_step
        with self._guarded():
            if self.is_gradient_accumulation_boundary() and runtime.state is not StepState.IDLE:
                with torch.no_grad(), clock.phase("step.wait"):  # interruptible: interrupted, step() does them again
                    runtime.prepare_step()
            with deferred_interrupt(), clock.phase("step.update"):  # all of it or none (engine/interrupts.py)
                result = super().step(lr_kwargs=lr_kwargs)
            with clock.phase("step.placement"):
                if runtime.placement is not None:
                    runtime.placement.after_step()
                if not runtime.mid_step:
                    runtime.collector.after_step()
        clock.step_ended(runtime.mid_step)
        return result

    def clip_fp32_gradients(self) -> None:
        """Clipping happens inside the optimizer step, over the global norm of all blocks."""

    def get_global_grad_norm(self) -> Optional[float]:
        return self._sh_runtime.grad_norm()

    # Stronghold-specific ------------------------------------------------------------------------
    @property
    def stronghold_runtime(self) -> StrongholdRuntime:
        return self._sh_runtime

    def stronghold_report(self, reset: bool = False) -> dict:
        """Window, residency, transfer volume and the overlap breakdown since the last reset."""
        report = runtime_report(self._sh_runtime, since_step=self._sh_report_since, reset=reset)
        if reset:
            self.__dict__["_sh_report_since"] = self._sh_runtime.steps
        return report

    def window_batches(self, batches: Sequence[dict]) -> None:
        """The accumulation window's micro-batches, each the keyword arguments of its forward, before the window's
        first forward. With "block_major_forward" under the blockwise backward that forward runs each block for all
        of them (engine/block_major.py); each forward is still called with its own batch, in order, and a batch
        other than the one given here runs as without this. Otherwise nothing happens."""
        if not isinstance(batches, (list, tuple)) or not all(isinstance(b, dict) for b in batches):
            raise ValueError("stronghold: window_batches takes a list of the window's micro-batches, each a dict of "
                             f"a forward's keyword arguments (got {type(batches).__name__})")
        if len(batches) > self.gradient_accumulation_steps():
            raise ValueError(f"stronghold: window_batches got {len(batches)} micro-batches, more than the "
                             f"{self.gradient_accumulation_steps()} of an accumulation window "
                             "(gradient_accumulation_steps): give one window's at a time")
        self._sh_runtime.offer_window(list(batches))

    def synchronize_host(self) -> None:
        """Wait for all CPU updates and move every streamed block back to its host copy."""
        self._sh_runtime.synchronize()

    # Checkpoints (stronghold/checkpoint/save.py): by parameter name, so they load across window/residency.
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        from stronghold.checkpoint.save import save_checkpoint
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None,
                        allow_non_finite=False):
        """DeepSpeed's, by parameter name into any layout (checkpoint/load.py). `allow_non_finite`
        (stronghold's): load a checkpoint with inf or NaN weights or moments, which is refused by default."""
        from stronghold.checkpoint.load import load_checkpoint
        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only, custom_load_fn=custom_load_fn,
                               allow_non_finite=allow_non_finite)

    def restore_counters(self, counters: dict[str, int]) -> None:
        """DeepSpeed's step and sample counters as a checkpoint recorded them (checkpoint/load.py)."""
        for name, value in counters.items():
            setattr(self, name, value)

    def destroy(self):
        if threading.current_thread().name.startswith(OWN_THREADS):
            # Called by the garbage collector on a thread of stronghold's own (an engine dropped without destroy(),
            # collected where the interpreter's collections run, "garbage_collection": "python"): the close waits
            # for the CPU optimizer's and the other threads' work, which that thread cannot do for itself.
            threading.Thread(target=self._destroy, name=CLOSE_THREAD).start()
            return
        self._destroy()

    def _destroy(self) -> None:
        if self._sh_runtime is not None:
            self._sh_runtime.close()
        super().destroy()
