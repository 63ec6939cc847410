"""The `"stronghold"` section of ds.json, and the checks on the DeepSpeed keys stronghold relies on.

The section is validated the way DeepSpeed validates its own sections (a pydantic model derived from
`DeepSpeedConfigModel`, so unknown keys are rejected), and every failure becomes a `ValueError` that
names the key path and what is allowed. Optimizer, scheduler, clipping, accumulation and precision
come from the usual DeepSpeed keys, with DeepSpeed's defaults.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, ValidationError, field_validator

SECTION = "stronghold"


class StrongholdConfig(DeepSpeedConfigModel):
    """Knobs of the working-window engine (the `"stronghold"` section of ds.json)."""

    window_size: int = Field(4, ge=2)
    """Streamed blocks that may be on the GPU at once (GPU slots). Larger hides more transfer
    latency at the cost of `window_size` x (largest block's bytes) of GPU memory. Clamped, with a
    warning, to the number of streamed blocks."""

    resident_blocks: int = Field(1, ge=0)
    """Leading blocks whose params, grads and optimizer states stay on the GPU and are updated
    there by a fused optimizer. Their backward runs last, so they hide the CPU optimizer's tail.
    Equal to the block count means no offload at all."""

    pin_memory: bool = True
    """Page-lock the host buffers that the GPU copies from and to (working copies, gradients).
    Without it transfers are synchronous and much slower; only turn off where pinning fails."""

    cpu_optimizer_threads: Optional[int] = Field(None, ge=1)
    """Threads of the CPU AdamW; None means all cores this process may use but one (left to the
    thread that launches GPU work)."""

    gpu_memory_limit_gb: Optional[float] = Field(None, gt=0)
    """Cap this process's GPU memory (GiB) with torch.cuda.set_per_process_memory_fraction, to
    emulate a smaller card. None leaves the card as it is."""

    kernels: Union[bool, list[str]] = True
    """Swap the blocks' compute for stronghold_ops' Triton kernels (norms, activations, rotary, fused
    linear + cross-entropy): true (all that apply to the model), false, or a list of kernel names.
    Applied when training on a GPU only: on the CPU, Triton's interpreter is for tests, far too slow
    to train with (call stronghold_ops.apply(model) yourself to force it)."""

    @field_validator("kernels")
    @classmethod
    def _known_kernels(cls, value):
        from stronghold_ops import KINDS
        if isinstance(value, list):
            unknown = sorted(set(value) - set(KINDS))
            if unknown:
                raise ValueError(f"unknown kernels {unknown}; pick from {list(KINDS)}")
        return value

    blocks_path: Optional[str] = None
    """Dotted path of the transformer block list inside the model (e.g. "model.layers"), for
    models the automatic discovery does not know. None means discover."""


def _key_path(loc: tuple) -> str:
    return ".".join([SECTION, *[str(part) for part in loc]])


def parse_stronghold_section(ds_config: Mapping[str, Any]) -> StrongholdConfig:
    """Validate the `"stronghold"` section of a ds.json dict (absent means all defaults)."""
    section = ds_config.get(SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"'{SECTION}' must be a JSON object of stronghold settings, got {type(section).__name__}")
    try:
        return StrongholdConfig(**section)
    except ValidationError as err:
        problems = []
        for item in err.errors():
            path = _key_path(item["loc"])
            if item["type"] == "extra_forbidden":
                allowed = ", ".join(sorted(StrongholdConfig.model_fields))
                problems.append(f"{path}: unknown key; allowed keys are {allowed}")
            else:
                problems.append(f"{path}: {item['msg']} (got {item.get('input')!r})")
        raise ValueError("invalid stronghold configuration:\n  " + "\n  ".join(problems)) from None


def check_deepspeed_keys(ds_config: Mapping[str, Any]) -> None:
    """Reject DeepSpeed settings the engine does not implement, before anything is built."""
    fp16 = ds_config.get("fp16", {}) or {}
    if fp16.get("enabled", False) in (True, "true"):
        raise ValueError("fp16: stronghold does not support fp16 with loss scaling yet; "
                         "use bf16 ({\"bf16\": {\"enabled\": true}}) or fp32 (neither enabled)")
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (0, "auto"):
        raise ValueError(f"zero_optimization.stage: stronghold replaces ZeRO's partitioning and offload, so the "
                         f"stage must be 0 (got {stage!r}); keep the section as {{\"stage\": 0}} or remove it")
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key):
            raise ValueError(f"zero_optimization.{key}: stronghold does its own offload; remove this key")
    optimizer = ds_config.get("optimizer")
    if optimizer is not None:
        name = str(optimizer.get("type", "")).lower()
        if name not in ("adam", "adamw"):
            raise ValueError(f"optimizer.type: stronghold implements AdamW only (got {optimizer.get('type')!r}); "
                             "use \"AdamW\" (or \"Adam\", which DeepSpeed runs in AdamW mode)")
    if ds_config.get("torch_autocast", {}).get("enabled", False):
        raise ValueError("torch_autocast: not supported with stronghold; bf16 runs the model in bf16 with fp32 "
                         "master weights, so remove the torch_autocast section")
