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


def initialize_engine(*, args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                      lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required=None,
                      collate_fn=None, config=None, config_params=None, blocks=None):
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.module import PipelineModule

    from stronghold.config import check_deepspeed_keys, parse_stronghold_section
    from stronghold.engine.engine import StrongholdEngine
    from stronghold.integrations.kernels import apply_kernels

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
