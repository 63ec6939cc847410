"""Which placement settings go together with which run: the layouts that need one process, gradient accumulation
or a half-precision compute dtype, checked before anything is allocated (each error names the setting to change), and
whether a runtime may move to the blockwise backward between steps."""
from __future__ import annotations

from typing import Optional

import torch

from stronghold.config import Settings
from stronghold.distributed.data_parallel import DataParallel
from stronghold.integrations.discovery import tied_across


def check_layout(settings: Settings, compute_dtype: torch.dtype, accumulation_steps: int,
                 data_parallel: Optional[DataParallel], cached_parts: frozenset[str], gpu_accumulation: bool,
                 lean: int, compact_master: bool = False, pooled_grads: bool = False) -> None:
    """`lean`: the lean blocks the runtime would build (at most the streamed ones)."""
    processes = "data parallel" if data_parallel is not None else "one process"
    accumulate = accumulation_steps > 1
    if gpu_accumulation and (not accumulate or data_parallel is not None):
        raise ValueError(f"stronghold.gpu_accumulation needs gradient accumulation (here {accumulation_steps}) in "
                         f"one process (here: {processes}); set \"gpu_accumulation\" to \"auto\" or false")
    if lean and (compute_dtype == torch.float32 or accumulate or data_parallel is not None):
        raise ValueError(f"stronghold.lean_blocks {lean} needs bf16 or fp16, no gradient accumulation and one process "
                         f"(here: {compute_dtype}, accumulation {accumulation_steps}, {processes}); set "
                         "\"lean_blocks\" to \"auto\" or 0")
    if settings.nvme_path is not None and data_parallel is not None:
        raise ValueError("stronghold.nvme_path needs one process (here: data parallel); remove \"nvme_path\"")
    if compact_master and (compute_dtype != torch.bfloat16 or lean):
        raise ValueError(f"stronghold.compact_master needs bf16 and no lean blocks (here: "
                         f"{compute_dtype}, {lean} lean blocks); set \"compact_master\" to \"auto\" or false")
    if pooled_grads and (not accumulate or gpu_accumulation or data_parallel is not None):
        raise ValueError(f"stronghold.pooled_grads needs gradient accumulation on the host in one process (here: "
                         f"accumulation {accumulation_steps}, gpu_accumulation {gpu_accumulation}, {processes}); set "
                         "\"pooled_grads\" to \"auto\" or false")
    if settings.blockwise_backward is True:
        _check_blockwise(settings, accumulation_steps, data_parallel, gpu_accumulation, lean,
                         pooled_grads)


def _check_blockwise(settings: Settings, accumulation_steps: int, data_parallel: Optional[DataParallel],
                     gpu_accumulation: bool, lean: int, pooled_grads: bool) -> None:
    conflicts = blockwise_conflicts(settings, accumulation_steps, data_parallel is not None, gpu_accumulation, lean,
                                    pooled_grads, bool(settings.offload_activations))
    if conflicts:
        raise ValueError(f"stronghold.blockwise_backward needs {'; '.join(conflicts)}; set \"blockwise_backward\" to "
                         "false or change those settings")


def blockwise_conflicts(settings: Settings, accumulation_steps: int, data_parallel: bool, gpu_accumulation: bool,
                        lean: int, pooled_grads: bool, offloading: bool) -> list[str]:
    """What the blockwise backward (blockwise.py) does not combine with, of what is here (none: it can run)."""
    return [what for what, present in (
        (f"gradient accumulation (here {accumulation_steps})", accumulation_steps <= 1),
        ("one process (here: data parallel)", data_parallel),
        ("no \"gpu_accumulation\" (it sums every block's gradients on the GPU instead)", gpu_accumulation is True),
        (f"no lean blocks (here {lean})", lean > 0),
        ("no pooled gradients", pooled_grads),
        ("no NVMe tier", settings.nvme_path is not None),
        ("no activation offload", offloading),
    ) if present]


def blockwise_possible(settings: Settings, runtime, accumulation_steps: int) -> bool:
    """Whether a runtime built with host accumulation may move to the blockwise backward between steps (its
    "auto", planning/schedule_choice.py): nothing above rules it out (pooled buffers aside: the move frees them), and a
    cached input part is not tied to the head (its gradient would arrive outside the walk)."""
    if runtime.blockwise is not None:
        return False
    lean = sum(store.lean for store in runtime.stores.values())
    if blockwise_conflicts(settings, accumulation_steps, runtime.data_parallel is not None,
                           runtime.device_accum is not None, lean, False, runtime.activations is not None):
        return False
    return "input" not in runtime.cached_parts or not tied_across(runtime.model, runtime.blocks)
