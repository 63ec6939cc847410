"""The peers that are not DeepSpeed engines, in the training loop their own documentation shows, behind the
engine calls run_one makes (engine(**batch), engine.backward(loss), engine.step()):

- torchao: torchao.optim.CPUOffloadOptimizer (torchao 0.18) with `offload_gradients=True` around a fused
  torch.optim.AdamW, the model in bf16 on the GPU (torchao's README: the fused CPU AdamW; bf16 weights, no fp32
  master). The optimizer asserts a CUDA (or XPU) device: on the CPU this system is refused.
- fsdp2_offload: torch FSDP2 (`fully_shard`) with `CPUOffloadPolicy` on one rank, set up as torchtitan's
  `apply_fsdp` does: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the input embedding its own unit,
  each block a unit, the final norm and an untied LM head one unit that is not resharded after forward, then the
  root; fp32 master weights built on the CPU (torchtitan's init device under CPU offload); a fused AdamW over the
  sharded (here: whole, host-resident) parameters; torchtitan's clipping (the DTensor norm made whole first).
  The process group is "cuda:nccl,cpu:gloo" (torchtitan's backend under CPU offload: the norm of host gradients
  is reduced on the CPU); on a machine without a GPU, gloo and unpinned host memory, so the path runs in CPU tests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .model import build_model
from .point import Point
from .systems import ADAMW, Built

TORCHAO = {"offload_gradients": True, "fused": True}
"""CPUOffloadOptimizer's settings besides AdamW's hyper-parameters (fused: the fused CPU AdamW its README advises)."""
TORCHAO_ACCUMULATE = {"offload_gradients": False, "fused": True}
"""The setting torchao's README leaves for gradient accumulation: the gradients stay on the GPU between micro-batches
("offload_gradients=True is not compatible with gradient accumulation")."""
FSDP2_MIXED_PRECISION = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
"""torchtitan's default training.mixed_precision_param / mixed_precision_reduce."""
TORCHAO_ACCUMULATION_CAVEAT = (
    "offload_gradients=True copies each gradient to the host and frees it on the GPU as it is produced, so with "
    "accumulation each parameter keeps its last micro-batch's gradient only (torchao's docstring: not compatible "
    "with gradient accumulation): the update is not the accumulated one")
TORCHAO_CLIPPING_CAVEAT = (
    "clip_grad_norm_ sees only the gradients still on the GPU (parameters under minimal_size=4096 elements): "
    "offload_gradients freed the others in backward, so the norm and the clipping leave them out")
TORCHAO_BF16_SUM_CAVEAT = (
    "offload_gradients=False sums the micro-batches' gradients on the GPU in the parameters' bf16, not in fp32, and "
    "copies them to the host after every micro-batch's backward")
TORCHAO_CLIPPING_AFTER_COPY_CAVEAT = (
    "the CPU AdamW steps on the host copies of the gradients taken in backward, before Trainer's clip_grad_norm_ "
    "scales those on the GPU: the clipping does not reach the update (torchao's README: clipping is not supported)")


@dataclass(kw_only=True)
class LoopEngine:
    """A model and its optimizer behind DeepSpeed's engine calls, as the plain loop of torchao's and torchtitan's
    documentation runs them: each micro-batch's loss divided by the accumulation (what DeepSpeed's backward does,
    so every system averages the same micro-batches), and after the last one the global norm clipped, the
    optimizer step and zero_grad."""

    module: torch.nn.Module
    optimizer: Any
    accumulation: int
    clipping: float
    """Global gradient-norm limit; 0 = no clipping."""
    global_steps: int = 0
    """Optimizer steps taken (DeepSpeed's name, which run_one records)."""
    micro_steps: int = 0
    _grad_norm: torch.Tensor | None = field(default=None, repr=False)

    def __call__(self, **batch: torch.Tensor) -> Any:
        return self.module(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accumulation).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        if self.clipping > 0:
            self._grad_norm = clip_grad_norm(self.module.parameters(), self.clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1

    def get_global_grad_norm(self) -> float | None:
        """The last step's norm before clipping (None without clipping); reading it waits for the device."""
        return None if self._grad_norm is None else float(self._grad_norm)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torchtitan's clip_grad_norm_ for one data-parallel mesh: the global 2-norm of the gradients present (a
    DTensor norm made whole), every gradient scaled by min(1, max_norm / norm); returns the norm."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total


def adamw_kwargs() -> dict[str, Any]:
    """The bench's AdamW hyper-parameters (systems.ADAMW) as torch.optim.AdamW's keyword arguments."""
    return {"lr": ADAMW["lr"], "betas": tuple(ADAMW["betas"]), "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}


def torchao_caveats(accumulation: int, clipping: float, offload_gradients: bool = True) -> list[str]:
    """Where torchao's settings make the update differ from exact AdamW with clipping and accumulation."""
    if not offload_gradients:
        return ([TORCHAO_BF16_SUM_CAVEAT] if accumulation > 1 else []) + (
            [TORCHAO_CLIPPING_AFTER_COPY_CAVEAT] if clipping > 0 else [])
    return ([TORCHAO_ACCUMULATION_CAVEAT] if accumulation > 1 else []) + ([TORCHAO_CLIPPING_CAVEAT] if clipping > 0 else [])


def build_torchao(point: Point, device: torch.device) -> Built:
    if device.type != "cuda":
        raise ValueError("torchao's CPUOffloadOptimizer runs on a CUDA (or XPU) device only: run --system torchao "
                         "on a GPU machine")
    from torchao.optim import CPUOffloadOptimizer

    start = time.perf_counter()
    model = build_model(point, device, torch.bfloat16)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, **TORCHAO, **adamw_kwargs())
    engine_init_s = time.perf_counter() - start
    caveats = torchao_caveats(point.accumulation, point.clipping)
    return Built(engine=LoopEngine(module=model, optimizer=optimizer, accumulation=point.accumulation,
                                   clipping=point.clipping),
                 device=device, ds_config={}, build_s=build_s, engine_init_s=engine_init_s,
                 record={"peer_config": {"optimizer_class": "torch.optim.AdamW", **TORCHAO, **adamw_kwargs(),
                                         "weights": "bfloat16"},
                         "exact": not caveats, "caveats": caveats})


def init_one_rank_group(device: torch.device):
    """The default process group of this single rank (RANK/WORLD_SIZE/MASTER_* from single_process_env) and its
    one-device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo")
    assert dist.get_world_size() == 1, f"fsdp2_offload runs on one rank; WORLD_SIZE is {dist.get_world_size()}"
    return init_device_mesh(device.type, (1,))


def model_parts(model: torch.nn.Module) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """(transformer blocks, final norm) of the bench's HF GPT-2 or Llama."""
    if hasattr(model, "transformer"):  # GPT2LMHeadModel
        return list(model.transformer.h), model.transformer.ln_f
    return list(model.model.layers), model.model.norm


def apply_fsdp2(model: torch.nn.Module, mesh, *, offload: bool = True, param_dtype: torch.dtype = torch.bfloat16,
                reduce_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """fully_shard `model` as torchtitan's apply_fsdp does (module docstring); in place, returned for chaining."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    config: dict[str, Any] = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                              reduce_dtype=reduce_dtype)}
    if offload:
        # Pinned host shards where there is a device to copy them to (pinning needs one).
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks, final_norm = model_parts(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    if not tied:  # a tied table is used at both ends: it stays in the root's unit, as accelerate's FSDP2 keeps it
        fully_shard(embedding, **config)
    for block in blocks:
        fully_shard(block, **config)
    if not tied:
        fully_shard([final_norm, head], **config, reshard_after_forward=False)  # backward starts with them
    fully_shard(model, **config)
    return model


def build_fsdp2_offload(point: Point, device: torch.device) -> Built:
    start = time.perf_counter()
    model = build_model(point, torch.device("cpu"), torch.float32)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    mesh = init_one_rank_group(device)
    apply_fsdp2(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **adamw_kwargs())
    engine_init_s = time.perf_counter() - start
    return Built(engine=LoopEngine(module=model, optimizer=optimizer, accumulation=point.accumulation,
                                   clipping=point.clipping),
                 device=device, ds_config={}, build_s=build_s, engine_init_s=engine_init_s,
                 record={"peer_config": {"fully_shard": "embedding, each block, [final norm, head], root",
                                         "offload_policy": f"CPUOffloadPolicy(pin_memory={torch.cuda.is_available()})",
                                         "mp_policy": dict(FSDP2_MIXED_PRECISION), "optimizer": "torch.optim.AdamW",
                                         "fused": True, **adamw_kwargs()},
                         "exact": True, "caveats": []})


BUILDERS = {"torchao": build_torchao, "fsdp2_offload": build_fsdp2_offload}
