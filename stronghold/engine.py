"""StrongholdEngine: DeepSpeed's engine with stronghold's placement, window and optimizer. Glue only.

DeepSpeed keeps doing what it does well: configuration, the batch / accumulation bookkeeping, LR
schedulers, timers, monitoring, launching. The engine overrides exactly the places where the whole
model would otherwise be moved to or optimized on the GPU:
- `_configure_distributed_model`: split the model into streamed blocks (host) and the rest (GPU)
  before DeepSpeed casts anything, so fp32 masters come from the original fp32 values;
- `_configure_optimizer`: the AdamW facade over the runtime (no ZeRO / BF16 optimizer wrappers);
- `forward` / `backward` / `step` bracket DeepSpeed's own with the runtime's phases;
- `clip_fp32_gradients`: clipping is done exactly inside the optimizer step (global norm).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from torch import nn

from .config import StrongholdConfig
from .discovery import find_blocks
from .optimizer import StrongholdOptimizer, resolve_param_groups
from .runtime import StrongholdRuntime
from .telemetry import runtime_report


class StrongholdEngine(DeepSpeedEngine):
    def __init__(self, *args, stronghold_config: StrongholdConfig, blocks: Optional[Sequence[nn.Module]] = None,
                 model_parameters=None, **kwargs):
        # Set before DeepSpeedEngine.__init__ (which calls the overrides below); via __dict__ because
        # nn.Module.__setattr__ refuses module-valued attributes before Module.__init__.
        self.__dict__["_sh_config"] = stronghold_config
        self.__dict__["_sh_blocks"] = blocks
        self.__dict__["_sh_model_parameters"] = model_parameters
        self.__dict__["_sh_runtime"] = None
        kwargs["dont_change_device"] = True
        super().__init__(*args, model_parameters=model_parameters, **kwargs)
        # One process, one GPU: there is nothing to all-reduce (data parallel is on the roadmap).
        self.enable_backward_allreduce = False

    # Construction -------------------------------------------------------------------------------
    def _configure_distributed_model(self, model: nn.Module) -> None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world > 1:
            raise ValueError(f"stronghold runs one process on one GPU for now (world size {world}); data "
                             "parallel training over several GPUs is on the roadmap")
        compute_dtype = torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        groups = resolve_param_groups(model, self.client_optimizer, self._sh_model_parameters,
                                      self.optimizer_name(), self.optimizer_params())
        optimizer = StrongholdOptimizer(groups)
        parts = find_blocks(model, self._sh_blocks, self._sh_config.blocks_path)
        with self._oom_advice():
            runtime = StrongholdRuntime(model, parts, self._sh_config, optimizer.param_groups,
                                        torch.device(self.device), compute_dtype, self.gradient_accumulation_steps(),
                                        self.gradient_clipping())
        optimizer.runtime = runtime
        self.__dict__["_sh_runtime"] = runtime
        self.__dict__["_sh_optimizer"] = optimizer
        super()._configure_distributed_model(model)

    def _broadcast_model(self) -> None:
        """One process: nothing to broadcast (and streamed weights live on the host)."""

    def _configure_optimizer(self, client_optimizer, model_parameters) -> None:
        self.basic_optimizer = self.optimizer = self._sh_optimizer

    # Training step --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _oom_advice(self):
        try:
            yield
        except torch.OutOfMemoryError as err:
            rt, cfg = self._sh_runtime, self._sh_config
            window = rt.window_size if rt is not None else cfg.window_size
            resident = rt.resident_count if rt is not None else cfg.resident_blocks
            raise torch.OutOfMemoryError(
                f"{err}\nstronghold: the GPU ran out of memory with window_size={window} and "
                f"resident_blocks={resident}. Each resident block keeps its weights, gradients and fp32 "
                "AdamW states on the GPU (~16 bytes per parameter) and each window slot holds one block's "
                "weights: lower \"resident_blocks\" first, then \"window_size\", the micro-batch or the sequence "
                "length.") from err

    def forward(self, *inputs, **kwargs):
        runtime = self._sh_runtime
        runtime.begin_forward(training=torch.is_grad_enabled())
        saved = runtime.hooks.saved_tensors() if runtime.window is not None else contextlib.nullcontext()
        with self._oom_advice(), saved:
            return super().forward(*inputs, **kwargs)

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        if retain_graph:
            raise ValueError("retain_graph=True is not supported: stronghold hands each block's gradients to the "
                             "CPU optimizer as soon as they are complete")
        self._sh_runtime.begin_backward(self.is_gradient_accumulation_boundary())
        with self._oom_advice():
            result = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
            self._sh_runtime.end_backward()
        return result

    def step(self, lr_kwargs=None):
        with self._oom_advice():
            return super().step(lr_kwargs=lr_kwargs)

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
        return runtime_report(self._sh_runtime, reset=reset)

    def synchronize_host(self) -> None:
        """Wait for all CPU updates and move every streamed block back to its host copy."""
        self._sh_runtime.synchronize()

    # Checkpoints (stronghold/checkpoint.py): by parameter name, so they load across window/residency.
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        from .checkpoint import load_checkpoint
        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only, custom_load_fn=custom_load_fn)

    def destroy(self):
        if self._sh_runtime is not None:
            self._sh_runtime.close()
        super().destroy()
