"""`stronghold.initialize`: deepspeed.initialize's steps, building a StrongholdEngine.

Mirrors deepspeed.initialize (distributed init, config resolution, DeepSpeedConfig) because
DeepSpeed has no hook to choose the engine class; pipeline and hybrid engines are not supported.
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Iterator, Mapping

import torch

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
"""Set by mpirun (Open MPI, MPICH / Intel MPI, PMIx): DeepSpeed's MPI discovery maps them to the launcher's."""
SHM_COMM_OP = "deepspeed_shm_comm"


def load_config(config: Any) -> dict:
    """A ds.json path or dict, as a dict (hjson, like DeepSpeed, so comments are allowed)."""
    if isinstance(config, Mapping):
        return dict(config)
    import hjson  # a DeepSpeed dependency

    with open(config) as f:
        return dict(hjson.load(f))


def default_accelerator() -> None:
    """DeepSpeed's CPU accelerator where torch sees no GPU (DS_ACCELERATOR=cpu, unless already set): DeepSpeed
    then skips its accelerator probing and the warning it logs when the probing ends on the CPU. Read when
    DeepSpeed is first imported, so call this before."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def single_process_env() -> None:
    """What DeepSpeed's launcher sets for one process on one device (RANK, LOCAL_RANK, WORLD_SIZE, and
    MASTER_ADDR/PORT where unset: localhost, a free port), so a script also runs without the launcher
    (plain `python`, where DeepSpeed would otherwise look for an MPI launch and fail without mpi4py);
    DeepSpeed's CPU accelerator where there is no GPU. A launcher's variables, and an MPI launch's, are
    left alone. Call it before DeepSpeed is imported."""
    default_accelerator()
    if any(key in os.environ for key in LAUNCHER_VARIABLES + MPI_VARIABLES):
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a rendezvous the user chose is kept
    os.environ.setdefault("MASTER_PORT", str(port))


@contextlib.contextmanager
def deepspeed_comm_without_shm() -> Iterator[None]:
    """DeepSpeed's communication backend set up inside this block skips its CPU shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed JIT-compiles that op (about 20 s the first time; a "built successfully"
    line on every run) and, under its launcher, creates a 69 MB /dev/shm/deepspeed_allreduce_buffer_* that
    it never removes. Only `inference_all_reduce` (tensor-parallel inference) uses the op, and without it
    that falls back to torch.distributed's all-reduce; training's collectives never use it. The op is
    marked incompatible in DeepSpeed's table of ops for the block only (the table is a dict DeepSpeed keeps
    for such edits), so a backend built outside it is unchanged."""
    import deepspeed.ops

    ops = deepspeed.ops.__compatible_ops__
    had, before = SHM_COMM_OP in ops, ops.get(SHM_COMM_OP)
    ops[SHM_COMM_OP] = False
    try:
        yield
    finally:
        if had:
            ops[SHM_COMM_OP] = before
        else:
            ops.pop(SHM_COMM_OP, None)


def apply_gpu_memory_limit(limit_gb, device: torch.device) -> None:
    """Emulate a smaller card: cap this process's share of the GPU (no effect on the CPU)."""
    if limit_gb is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = limit_gb * 2 ** 30 / total
    if fraction >= 1.0:
        return
    torch.cuda.set_per_process_memory_fraction(fraction, device)


def unsynchronized_timer(ds_config: dict) -> dict:
    """`ds_config` with DeepSpeed's throughput timer left unsynchronized where the config says nothing of timers.

    By default that timer synchronizes the whole device at every forward and every step(), micro-steps included
    (utils/timer.py, `"timers": {"throughput": {"synchronized": true}}`), which waits for the side streams too: the
    window's prefetches and the gradients' copies down, which otherwise run on under the next micro-batch's compute.
    Unsynchronized, its samples/s log line times the host's side of each step. A config that sets "timers" is kept
    as written."""
    if "timers" in ds_config:
        return ds_config
    return {**ds_config, "timers": {"throughput": {"enabled": True, "synchronized": False}}}


def initialize_engine(*, args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                      lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required=None,
                      collate_fn=None, config=None, config_params=None, blocks=None):
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.module import PipelineModule

    from stronghold.config import parse_stronghold_section, resolve
    from stronghold.deepspeed_keys import check_deepspeed_keys, warn_near_section
    from stronghold.engine.cores import share_cores
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
    warn_near_section(config)
    stronghold_config = parse_stronghold_section(config)
    if config.get("hybrid_engine", {}).get("enabled", False):
        raise ValueError("hybrid_engine: not supported with stronghold; remove the section")

    share_cores()  # before the engine's threads start: each local rank its share of the node's cores
    accelerator = get_accelerator()
    # The engine's device is the accelerator's (DeepSpeed picks the index): its type is all `resolve` reads.
    settings = resolve(stronghold_config, torch.device(accelerator.device_name()))
    if (settings.kernels is None or settings.kernels) and accelerator.device_name() == "cuda":  # None: the defaults
        apply_kernels(model, settings)
    if not torch.distributed.is_initialized():
        single_process_env()
    with deepspeed_comm_without_shm():
        dist.init_distributed(dist_backend=accelerator.communication_backend_name(),
                              distributed_port=distributed_port, dist_init_required=dist_init_required)
    if accelerator.device_name() == "cuda":
        # This rank's GPU (DeepSpeed selects it later, from LOCAL_RANK, in the engine's constructor).
        apply_gpu_memory_limit(settings.gpu_memory_limit_gb,
                               torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    ds_config = unsynchronized_timer({key: value for key, value in config.items() if key != "stronghold"})
    config_class = DeepSpeedConfig(ds_config, mpu)
    engine = StrongholdEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                              training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                              dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                              config_class=config_class, stronghold_config=stronghold_config,
                              stronghold_settings=settings, blocks=blocks)
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
