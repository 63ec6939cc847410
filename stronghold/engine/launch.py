"""`stronghold.initialize`: deepspeed.initialize's steps, building a StrongholdEngine.

Mirrors deepspeed.initialize (distributed init, config resolution, DeepSpeedConfig) because
DeepSpeed has no hook to choose the engine class; pipeline and hybrid engines are not supported.
"""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

if TYPE_CHECKING:  # config imports DeepSpeed, which single_process_env must run before
    from stronghold.config import StrongholdConfig


def load_config(config: Any) -> dict:
    """A ds.json path or dict, as a dict (hjson, like DeepSpeed, so comments are allowed)."""
    if isinstance(config, Mapping):
        return dict(config)
    import hjson  # a DeepSpeed dependency

    with open(config) as f:
        return dict(hjson.load(f))


def single_process_env() -> None:
    """What DeepSpeed's launcher sets for one process on one device (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, on a free port), so a script also runs without the launcher; DeepSpeed's CPU
    accelerator where there is no GPU. A launcher's variables are left alone. Call it before DeepSpeed
    is imported."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if any(key in os.environ for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def apply_gpu_memory_limit(limit_gb, device: torch.device) -> None:
    """Emulate a smaller card: cap this process's share of the GPU (no effect on the CPU)."""
    if limit_gb is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = limit_gb * 2 ** 30 / total
    if fraction >= 1.0:
        return
    torch.cuda.set_per_process_memory_fraction(fraction, device)


def kernels_to_apply(model, config: StrongholdConfig, long_context: bool = False) -> Optional[list[str]]:
    """The stronghold_ops kinds the "kernels" key asks for on this model (None: every one that applies).
    "auto" is the family's defaults, or all of the family's kernels for long sequences (activations
    offloaded by the config, or `long_context` decided at the first forward: long_context.py), where their
    memory savings count (stronghold_ops.default_kernels)."""
    import stronghold_ops

    if config.kernels is True:
        return None
    if config.kernels == "auto":
        long_context = long_context or config.offload_activations not in ("auto", False, 0)
        return list(stronghold_ops.default_kernels(model, long_context=long_context))
    return list(config.kernels or [])


def apply_kernels(model, config: StrongholdConfig, long_context: bool = False) -> list[str]:
    """stronghold_ops' Triton kernels, on this model's instances only (parameters are unchanged); the kinds
    that patched something (a module already patched is left as it is)."""
    import stronghold_ops
    from deepspeed.utils import logger

    kinds = kernels_to_apply(model, config, long_context)
    if kinds == []:
        logger.info("stronghold kernels: none for this model (\"kernels\": \"auto\" keeps those that won end to end)")
        return []
    report = stronghold_ops.apply(model, kernels=kinds)
    logger.info(f"stronghold kernels:\n{report}")
    return sorted(report.patched)


def initialize_engine(*, args, model, optimizer, model_parameters, training_data, lr_scheduler, distributed_port,
                      mpu, dist_init_required, collate_fn, config, config_params, blocks):
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.module import PipelineModule

    from stronghold.config import check_deepspeed_keys, parse_stronghold_section
    from stronghold.engine.engine import StrongholdEngine

    if model is None:
        raise ValueError("stronghold.initialize needs model=")
    if isinstance(model, PipelineModule):
        raise ValueError("pipeline-parallel models are not supported by stronghold; pass the plain model")
    if config is None:
        config = config_params
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ValueError("a DeepSpeed config was given both in args.deepspeed_config and config=; pass one")
        config = args.deepspeed_config
    if config is None:
        raise ValueError("stronghold needs a DeepSpeed config: pass config= (path or dict) or --deepspeed_config")
    config = load_config(config)
    check_deepspeed_keys(config)
    stronghold_config = parse_stronghold_section(config)
    if config.get("hybrid_engine", {}).get("enabled", False):
        raise ValueError("hybrid_engine: not supported with stronghold; remove the section")

    accelerator = get_accelerator()
    if stronghold_config.kernels and accelerator.device_name() == "cuda":
        apply_kernels(model, stronghold_config)
    dist.init_distributed(dist_backend=accelerator.communication_backend_name(), distributed_port=distributed_port,
                          dist_init_required=dist_init_required)
    if accelerator.device_name() == "cuda":
        # This rank's GPU (DeepSpeed selects it later, from LOCAL_RANK, in the engine's constructor).
        apply_gpu_memory_limit(stronghold_config.gpu_memory_limit_gb,
                               torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    ds_config = {key: value for key, value in config.items() if key != "stronghold"}
    config_class = DeepSpeedConfig(ds_config, mpu)
    engine = StrongholdEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                              training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                              dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                              config_class=config_class, stronghold_config=stronghold_config, blocks=blocks)
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
