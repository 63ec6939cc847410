"""Each peer of the HF Trainer point as its own documentation configures it for a Trainer user (hf_peers.py runs them).

| peer | the Trainer run |
| --- | --- |
| `stronghold` | the one line, `stronghold.initialize(model, config={"gpu_memory_limit_gb": cap})` (examples/hf_trainer.py's) |
| `plain` | plain Trainer: fp32 weights moved to the GPU, bf16 autocast, Trainer's default (fused) AdamW |
| `torchao` | `optimizers=(CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True, fused=True, ...), None)`, the model in bf16 on the GPU (torchao's README) |
| `torchao_accumulate` | the same with `offload_gradients=False`, the setting torchao's README leaves for gradient accumulation: the bf16 gradients stay on the GPU |
| `fsdp2` | `TrainingArguments(fsdp=True, fsdp_config=fsdp2_config(...))`: Trainer's own FSDP2 path (accelerate shards the embedding, each decoder layer, [final norm, head] and the root, as torchtitan does) with CPU offload and FSDP's activation checkpointing (transformers' advice under FSDP, instead of `gradient_checkpointing`), accelerate's plugin given torchtitan's mixed precision (bf16 parameters, fp32 reduction), on a "cuda:nccl,cpu:gloo" group of one rank |
| `zero3_offload` | `TrainingArguments(deepspeed=ZERO3_OFFLOAD)`: transformers' ZeRO-3 example with parameter and optimizer offload to pinned host memory, the model built under `deepspeed.zero.Init` (transformers' advice for ZeRO-3) |
| `zenflow` | `TrainingArguments(deepspeed=...)` with ZeRO-2 optimizer offload and the zenflow block of `systems.ZENFLOW` |

The DeepSpeed configs leave to Trainer ("auto") what Trainer's arguments set: batch sizes, accumulation, clipping,
bf16, AdamW's hyper-parameters; no scheduler section, so every peer gets Trainer's cosine schedule.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from .peer_engines import FSDP2_MIXED_PRECISION, TORCHAO, TORCHAO_ACCUMULATE, torchao_caveats
from .systems import ZENFLOW, ZENFLOW_CAVEAT

AUTO_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
DEEPSPEED_TRAINER_KEYS = {
    "bf16": {"enabled": "auto"}, "optimizer": AUTO_ADAMW, "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000, "wall_clock_breakdown": False,
}
ZERO3_OFFLOAD = {**DEEPSPEED_TRAINER_KEYS, "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True},
    "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
    "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": True,
}}
"""transformers' docs (deepspeed.md, "ZeRO-3"): the zero_optimization block as given there, the rest "auto"."""
ZENFLOW_OFFLOAD = {**DEEPSPEED_TRAINER_KEYS, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "zenflow": dict(ZENFLOW)}}
"""DeepSpeed's ZenFlow tutorial and the ZenFlow authors' example: ZeRO-2 with optimizer offload plus the block."""


def fsdp2_config(block_class: str, checkpointing: bool) -> dict[str, Any]:
    """TrainingArguments.fsdp_config of the fsdp2 peer, `block_class` the model's decoder layer class name; with
    `checkpointing`, FSDP's activation checkpointing of those layers."""
    return {"version": 2, "cpu_offload": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": [block_class], "reshard_after_forward": True,
            "activation_checkpointing": checkpointing}


def fsdp2_mixed_precision() -> dict[str, torch.dtype]:
    """torchtitan's MixedPrecisionPolicy as accelerate's FullyShardedDataParallelPlugin takes it (a dict with
    FSDP2's three dtypes): without it accelerate reduces in bf16 under bf16."""
    return {"param_dtype": getattr(torch, FSDP2_MIXED_PRECISION["param_dtype"]),
            "reduce_dtype": getattr(torch, FSDP2_MIXED_PRECISION["reduce_dtype"]),
            "output_dtype": getattr(torch, FSDP2_MIXED_PRECISION["param_dtype"])}


def trainer_arguments(opts, peer: str) -> dict[str, Any]:
    """TrainingArguments' keywords: examples/hf_trainer.py's, the same for every peer, plus the peer's own."""
    kwargs: dict[str, Any] = dict(
        output_dir=opts.output_dir, per_device_train_batch_size=opts.batch, gradient_accumulation_steps=opts.accumulation,
        max_steps=opts.steps, learning_rate=opts.lr, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=opts.max_grad_norm,
        lr_scheduler_type="cosine", warmup_steps=max(1, opts.steps // 10), bf16=opts.bf16,
        gradient_checkpointing=opts.gradient_checkpointing, logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True, seed=0)
    if peer == "fsdp2":
        kwargs.update(fsdp=True, fsdp_config=fsdp2_config(block_class_name(opts.arch), opts.gradient_checkpointing),
                      gradient_checkpointing=False)  # FSDP's activation checkpointing instead (fsdp2_config)
    elif peer == "zero3_offload":
        kwargs["deepspeed"] = copy.deepcopy(ZERO3_OFFLOAD)
    elif peer == "zenflow":
        kwargs["deepspeed"] = copy.deepcopy(ZENFLOW_OFFLOAD)
    return kwargs


def block_class_name(arch: str) -> str:
    return {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer"}[arch]


TORCHAO_PEERS = {"torchao": TORCHAO, "torchao_accumulate": TORCHAO_ACCUMULATE}
"""Each torchao peer's CPUOffloadOptimizer settings."""


def torchao_optimizer(model: torch.nn.Module, args, peer: str = "torchao") -> Any:
    """CPUOffloadOptimizer with `peer`'s settings and TrainingArguments' AdamW hyper-parameters."""
    from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, **TORCHAO_PEERS[peer], **torchao_adamw(args))


def torchao_adamw(args) -> dict[str, Any]:
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay}


def peer_config(peer: str, args, opts) -> dict[str, Any]:
    """The recorded configuration of `peer` (JSON-ready)."""
    if peer in ("zero3_offload", "zenflow"):
        return {"deepspeed": args.hf_deepspeed_config.config if args.deepspeed else None}
    if peer == "fsdp2":
        return {"fsdp_config": args.fsdp_config, "mixed_precision_policy": dict(FSDP2_MIXED_PRECISION),
                "process_group": "cuda:nccl,cpu:gloo", "optim": str(args.optim)}
    if peer in TORCHAO_PEERS:
        return {"optimizer": "torchao.optim.CPUOffloadOptimizer", "optimizer_class": "torch.optim.AdamW",
                **TORCHAO_PEERS[peer], **torchao_adamw(args), "weights": "bfloat16"}
    if peer == "stronghold":
        return {"stronghold": stronghold_section(opts)}
    return {"optim": str(args.optim)}


def stronghold_section(opts) -> dict[str, Any]:
    """The one line's config: the cap (and hf_trainer.py's --window / --resident / --stronghold-config if given)."""
    from examples.hf_trainer import stronghold_section as trainers

    return trainers(opts)


def peer_caveats(peer: str, opts) -> list[str]:
    if peer in TORCHAO_PEERS:
        return torchao_caveats(opts.accumulation, clipping=opts.max_grad_norm,
                               offload_gradients=TORCHAO_PEERS[peer]["offload_gradients"])
    if peer == "zenflow":
        return [ZENFLOW_CAVEAT]
    return []
