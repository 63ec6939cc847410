"""The four systems as DeepSpeed configs and engines, the offloading peers as DeepSpeed documents them.

Every system trains the same model with the same optimizer hyper-parameters (AdamW, lr 1e-4,
clipping 1.0 unless the point turns it off, bf16) so that only the memory strategy differs:
- no_offload: stage 0, bf16, a client torch.optim.AdamW(fused=True): everything on the GPU.
- zero_offload: stage 2, optimizer states + fp32 master on the host (pinned), DeepSpeedCPUAdam.
- zero_infinity: stage 3, parameters and optimizer states on the host, model built under zero.Init.
- stronghold: stage 0 + a "stronghold" section, through stronghold.initialize.
- zero_infinity_nvme (run when named): ZeRO-Infinity with parameters and optimizer states on NVMe, configured as
  DeepSpeed's ZeRO-Infinity documentation does (offload_param / offload_optimizer device "nvme", its "aio" section).
  It needs DeepSpeed's async_io op (libaio); where that does not build it raises PeerUnavailable, which run_one
  records as the outcome "unavailable" with the reason.
- zenflow: zenflow below; torchao and fsdp2_offload are not DeepSpeed engines: peer_engines.py.
A DeepSpeed system with `cpu_checkpointing` (the seqlen sweep's ZeRO-Infinity) also gets DeepSpeed's
`activation_checkpointing` section, and its model's checkpointed blocks call DeepSpeed's checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .model import build_model, build_model_zero_init
from .point import Point

ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
# No DeepSpeed progress lines between our timed steps.
STEPS_PER_PRINT = 1 << 30
# DeepSpeed's activation checkpointing with each checkpoint's inputs on the host: Megatron's pair,
# partition_activations + cpu_checkpointing (configure()'s docstring: checkpoint_in_cpu "only works
# with partition_activation"). With one GPU the "partition" is the whole tensor: forward clones it to
# the host and empties the GPU copy; backward copies it back before the recompute (checkpointing.py:
# partition_activations, gather_partitioned_activations). This path trains a tiny Llama on the CPU
# with the same losses as torch's checkpointing (tests/bench). The other path, cpu_checkpointing
# alone, cannot be checked without a GPU: on the CPU accelerator it empties the very tensor it meant
# to keep (the host copy of a host tensor is itself), so the recompute gets an empty input.
# The partitioned path breaks on GPT-2, whose blocks take None positionally (a size is saved per
# argument and too many are merged back: "got multiple values for argument"): Point refuses GPT-2.
# contiguous_memory_optimization preallocates number_checkpoints buffers per input: off.
CPU_CHECKPOINTING = {
    "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
    "synchronize_checkpoint_boundary": False, "profile": False,
}

# ZenFlow (DeepSpeed's ZeRO-Offload with the top-k gradient columns updated on the GPU every step and the rest on
# the host every update_interval steps), as the ZenFlow authors' fine-tuning example configures it
# (DeepSpeedExamples training/DeepSpeed-ZenFlow/finetuning/zf_config.json: stage 2, offload_optimizer cpu pinned,
# this block; select_strategy and select_interval left to ZenFlowConfig's defaults, "auto"). DeepSpeed's ZenFlow
# tutorial recommends update_interval "auto" too, but through HF Trainer accelerate refuses any "auto" it cannot
# fill ("zero_optimization.zenflow.... not found in kwargs"), so both paths use the example's 4.
# ZenFlow sets the engine's gradient_accumulation_steps to update_interval: with accumulation its optimizer steps
# do not line up with a timed step's micro-batches (the record's optimizer_steps says how many it took).
ZENFLOW = {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
ZENFLOW_CAVEAT = ("ZenFlow updates the top-k gradient columns (topk_ratio) on the GPU every step and accumulates the "
                  "others on the host for a later update (update_interval): not the same update as AdamW")


# DeepSpeed's ZeRO-Infinity NVMe example values (docs: config-json "Parameter offloading", "Optimizer offloading",
# "Asynchronous I/O"); buffer_size is raised to the largest parameter where that is larger (the embedding), and
# buffer_count to what one swap needs at once (`_param_swap_buffers`).
NVME_PARAM = {"buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}
# The weight matrices of one block, each a parameter above ZeRO's persistence threshold and so swapped one per buffer.
BLOCK_MATRICES = {"gpt2": 4, "llama": 7}
NVME_OPTIMIZER = {"buffer_count": 4, "fast_init": False}
AIO = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True}


def _param_swap_buffers(point: Point) -> int:
    """Swap buffers for the parameters ZeRO-3 may hold on the host at once, one each: the block being computed, up to
    one more prefetched (stage3_prefetch_bucket_size), the two embedding-sized parameters (the input embedding and the
    LM head or the position table) and one spare. The example's 5 run out in a forward at GPT-2 h2048 x 56 ("Not
    enough buffers 0 for swapping 1")."""
    return 2 * BLOCK_MATRICES[point.arch] + 2 + 1


class PeerUnavailable(RuntimeError):
    """A peer that cannot run on this machine (a missing native op): recorded with its reason, not as a crash."""


@dataclass(kw_only=True)
class Built:
    """An initialised engine and what it took to get there."""

    engine: Any
    """The DeepSpeed (or stronghold) engine: engine(**batch), engine.backward(loss), engine.step()."""
    device: torch.device
    """Where the input batches go."""
    ds_config: dict
    build_s: float = 0.0
    """Seconds to construct and initialise the model."""
    engine_init_s: float = 0.0
    """Seconds in {deepspeed,stronghold}.initialize (includes DeepSpeedCPUAdam's JIT build on first use)."""
    checkpoint_calls: Callable[[], int] | None = None
    """cpu_checkpointing points: how many times DeepSpeed's checkpoint has run (run_one checks it ran
    for every block in the first step, so that torch's checkpointing never stands in unnoticed)."""
    record: dict[str, Any] = field(default_factory=dict)
    """Fields for the point's record: a peer's configuration (`peer_config`), and whether its update is exact
    AdamW with this point's clipping and accumulation (`exact`, and the `caveats` where it is not)."""


def ds_config(point: Point) -> dict:
    """The ds.json dict for `point`'s system."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": point.batch,
        "gradient_accumulation_steps": point.accumulation,
        "gradient_clipping": point.clipping,
        "bf16": {"enabled": True},
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    offload = {"device": "cpu", "pin_memory": True}
    if point.system == "no_offload":
        config["zero_optimization"] = {"stage": 0}
    elif point.system == "zero_offload":
        config["zero_optimization"] = {"stage": 2, "offload_optimizer": dict(offload)}
        config["optimizer"] = {"type": "AdamW", "params": dict(ADAMW)}
    elif point.system == "zero_infinity":
        config["zero_optimization"] = {"stage": 3, "offload_param": dict(offload), "offload_optimizer": dict(offload)}
        config["optimizer"] = {"type": "AdamW", "params": dict(ADAMW)}
    elif point.system == "zero_infinity_nvme":
        nvme = {"device": "nvme", "nvme_path": point.nvme_path, "pin_memory": True}
        param = {**nvme, **NVME_PARAM}
        param["buffer_size"] = max(param["buffer_size"], point.vocab * point.hidden)
        param["buffer_count"] = max(param["buffer_count"], _param_swap_buffers(point))
        config["zero_optimization"] = {"stage": 3, "offload_param": param,
                                       "offload_optimizer": {**nvme, **NVME_OPTIMIZER}}
        config["aio"] = dict(AIO)
        config["optimizer"] = {"type": "AdamW", "params": dict(ADAMW)}
    elif point.system == "zenflow":
        config["zero_optimization"] = {"stage": 2, "offload_optimizer": dict(offload), "zenflow": dict(ZENFLOW)}
        config["optimizer"] = {"type": "AdamW", "params": dict(ADAMW)}
    else:
        config["zero_optimization"] = {"stage": 0}
        config["optimizer"] = {"type": "AdamW", "params": dict(ADAMW)}
        section = dict(point.stronghold)
        # The cap is enforced the same way for every system (the memory fraction, see run_one);
        # stronghold is also told it, so that its planner sizes the window for the same limit.
        if point.gpu_cap_GB is not None:
            section.setdefault("gpu_memory_limit_gb", point.gpu_cap_GB)
        config["stronghold"] = section
    if point.cpu_checkpointing:
        config["activation_checkpointing"] = {**CPU_CHECKPOINTING, "number_checkpoints": point.layers}
    return config


def use_deepspeed_checkpointing(model: torch.nn.Module, config: dict) -> Callable[[], int]:
    """Make `model`'s checkpointed blocks call deepspeed.checkpointing.checkpoint, configured from
    `config`'s activation_checkpointing section; returns a counter of its calls.

    DeepSpeed's section acts only through its own checkpoint function, and HF models call
    `self._gradient_checkpointing_func` (GradientCheckpointingLayer.__call__), which
    gradient_checkpointing_enable sets to torch's checkpoint on every module with a
    `gradient_checkpointing` flag; its gradient_checkpointing_kwargs can change the arguments, not
    the function. So after enabling, each of those modules gets ours: an instance attribute on this
    model's modules only (HF's own mechanism), nothing global. HF binds the block's keyword
    arguments (Llama's masks, rotary cos/sin) into the function it passes, so the hidden states are
    the only positional input, the one DeepSpeed moves to the host. configure() reads DeepSpeed's config
    (and the process group), so this runs after deepspeed.initialize."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing

    deepspeed.checkpointing.configure(mpu_=None, deepspeed_config=config)
    assert checkpointing.CPU_CHECKPOINT and checkpointing.PARTITION_ACTIVATIONS, \
        "deepspeed.checkpointing.configure did not take the activation_checkpointing section"
    calls = 0

    def checkpoint(function, *args, **kwargs):
        nonlocal calls
        calls += 1
        return deepspeed.checkpointing.checkpoint(function, *args, **kwargs)

    swapped = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint
            swapped += 1
    if swapped == 0:
        raise RuntimeError(f"{type(model).__name__} has no module with gradient checkpointing on: "
                           "DeepSpeed's cpu_checkpointing would do nothing")
    return lambda: calls


def build(point: Point, device: torch.device) -> Built:
    """Construct the model and the engine for `point` on `device` (cuda, or cpu for tests)."""
    if point.system in ("torchao", "fsdp2_offload"):
        from .peer_engines import BUILDERS

        return BUILDERS[point.system](point, device)
    config = ds_config(point)
    if point.system == "zero_infinity_nvme":
        from stronghold.streaming.nvme_io import aio_available
        if not aio_available():
            raise PeerUnavailable("DeepSpeed's async_io op (libaio) does not build here, and ZeRO-Infinity's NVMe "
                                  "offload needs it: install libaio-dev (apt), or build libaio's interface from "
                                  "examples/bench/libaio_shim (eval \"$(bash examples/bench/libaio_shim/build.sh)\"), "
                                  "and run again")
    if point.system == "stronghold":
        return _build_stronghold(point, device, config)
    from stronghold.engine.launch import deepspeed_comm_without_shm

    # DeepSpeed's process group is set up in zero.Init or deepspeed.initialize. On the CPU accelerator it first
    # JIT-builds a shared-memory all-reduce op that only inference uses (no such op on a GPU): skipped, as
    # stronghold.initialize skips it. A rank killed while it builds leaves the build's lock file, and every later
    # DeepSpeed process on the machine waits on it forever: the data-parallel bench kills a failed
    # configuration's surviving ranks.
    with deepspeed_comm_without_shm():
        return _build_deepspeed(point, device, config)


def _build_stronghold(point: Point, device: torch.device, config: dict) -> Built:
    import stronghold

    # The engine keeps fp32 masters on the host and moves to the GPU only what it streams or
    # keeps resident, so it gets the model on the CPU, in fp32, as a user would hand it over.
    start = time.perf_counter()
    model = build_model(point, torch.device("cpu"), torch.float32)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    engine, *_ = stronghold.initialize(model=model, model_parameters=model.parameters(), config=config)
    return Built(engine=engine, device=device, ds_config=config, build_s=build_s,
                 engine_init_s=time.perf_counter() - start, checkpoint_calls=None)


def _build_deepspeed(point: Point, device: torch.device, config: dict) -> Built:
    import deepspeed

    start = time.perf_counter()
    if point.system in ("zero_infinity", "zero_infinity_nvme"):
        model = build_model_zero_init(point, config)
    else:
        # DeepSpeed would move the model to the GPU and cast it to bf16 anyway; building it there
        # in bf16 directly avoids a transient fp32 copy that could trip the cap.
        model = build_model(point, device, torch.bfloat16)
    build_s = time.perf_counter() - start

    start = time.perf_counter()
    optimizer = None
    if point.system == "no_offload":
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
            weight_decay=ADAMW["weight_decay"], fused=True,
        )
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=config,
    )
    engine_init_s = time.perf_counter() - start
    checkpoint_calls = use_deepspeed_checkpointing(engine.module, config) if point.cpu_checkpointing else None
    record = {}
    if point.system == "zenflow":
        record = {"peer_config": config["zero_optimization"], "exact": False, "caveats": [ZENFLOW_CAVEAT]}
    if point.system == "zero_infinity_nvme":
        from stronghold.streaming.nvme_io import loaded_libaio
        record = {"libaio": loaded_libaio()}  # the system's, or examples/bench/libaio_shim's
    return Built(engine=engine, device=device, ds_config=config, build_s=build_s, engine_init_s=engine_init_s,
                 checkpoint_calls=checkpoint_calls, record=record)
