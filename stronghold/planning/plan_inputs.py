"""The planner's inputs taken from the live model and machine: element counts per block (`model_spec`) and the GPU
and host budgets (`budgets`). The placement (placement.py) plans with them at construction and after the first step."""
from __future__ import annotations

import psutil
import torch
from torch import nn

from stronghold.planning import planner
from stronghold.config import StrongholdConfig
from stronghold.integrations.discovery import ModelParts
from stronghold.streaming.store import cpu_param_bytes


def model_spec(model: nn.Module, parts: ModelParts, trainable_ids: set[int], compute_dtype: torch.dtype,
               accumulation_steps: int) -> planner.ModelSpec:
    """Element counts per block and for the rest of the model; tied parameters counted once."""
    seen: set[int] = set()

    def count(params) -> tuple[int, int]:
        numel = trainable = 0
        for param in params:
            if id(param) in seen:
                continue
            seen.add(id(param))
            numel += param.numel()
            trainable += param.numel() if id(param) in trainable_ids else 0
        return numel, trainable

    blocks = []
    for block in parts.blocks:
        numel, trainable = count(block.parameters())
        blocks.append(planner.BlockSpec(numel=numel, trainable_numel=trainable))
    rest_numel, rest_trainable = count(model.parameters())
    return planner.ModelSpec(blocks=tuple(blocks), rest_numel=rest_numel, rest_trainable_numel=rest_trainable,
                             compute_bytes=torch.tensor([], dtype=compute_dtype).element_size(),
                             accumulation_steps=accumulation_steps)


def budgets(model: nn.Module, config: StrongholdConfig, device: torch.device) -> planner.Budgets:
    """GPU: the cap, or what is free plus what this process's allocator already holds (our own
    placement reuses it). Host: available RAM plus the model's own CPU storage, which each block
    gives back as its parameters move into stronghold's buffers."""
    free, total = torch.cuda.mem_get_info(device)
    gpu = free + torch.cuda.memory_reserved(device)
    if config.gpu_memory_limit_gb is not None:
        gpu = min(gpu, int(config.gpu_memory_limit_gb * planner.GIB))
    # What this process already holds on the GPU, except the model's own parameters (placement
    # replaces them), is not ours to plan with: another model, an evaluation copy, cached tensors.
    on_gpu = sum(p.numel() * p.element_size() for p in _unique(model.parameters()) if p.device == device)
    gpu -= max(0, torch.cuda.memory_allocated(device) - on_gpu)
    own = cpu_param_bytes(model)
    # Data parallel (data_parallel.py): the ranks split the host states and a node's ranks share one working
    # copy, so the node's available memory is the budget for the whole plan, not per rank. Across nodes a node
    # holds only its own ranks' shards: counting them all keeps the check on the safe side.
    local_ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    process = max(0, psutil.Process().memory_info().rss - own)
    return planner.Budgets(gpu_bytes=max(1, gpu), host_bytes=psutil.virtual_memory().available + own,
                           local_ranks=local_ranks, host_process_bytes=process)


def _unique(params):
    return {id(p): p for p in params}.values()
