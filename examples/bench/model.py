"""The benchmark model: HF GPT-2 of a point's shape, random seeded init, random token batches.

Nothing here is downloaded: the model is built from a config and initialised from a seeded
generator. Building a 5 B model the usual way (allocate fp32 on the CPU, then HF's `_init_weights`
one tensor at a time on one core) takes minutes, so `build_model` constructs it on the meta device
and materialises each tensor on its target device, drawing the random values on the GPU when there
is one (a few seconds for 5 B) and copying them over.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .point import Point

# GPT-2's init: N(0, 0.02) for matrices and embeddings; residual projections scaled by
# 1/sqrt(2 * n_layer) (GPT-2 paper, sec. 2.3); LayerNorm weight 1, biases 0.
INIT_STD = 0.02
SEED = 1234


def gpt2_config(point: Point):
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=point.hidden, n_layer=point.layers, n_head=point.heads, n_positions=point.seq,
        vocab_size=point.vocab, use_cache=False,
    )


def _init_value(name: str, shape: torch.Size, layers: int, generator: torch.Generator, device) -> torch.Tensor:
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    if ".ln_" in name:
        return torch.ones(shape, device=device)
    std = INIT_STD / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else INIT_STD
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def _init_parameters(model: torch.nn.Module, layers: int, gather=None) -> None:
    """Seeded GPT-2 init of every parameter, the same values whatever the system.

    `gather(param)` is a context manager that makes a partitioned (ZeRO-3) parameter whole while
    it is written. Random numbers come from the GPU when there is one: its generator fills GBs
    per second, where the CPU's fills about 0.1 GB/s on one core."""
    draw_on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator(device=draw_on).manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied lm_head.weight is listed once, as wte
            with gather(param) if gather else contextlib.nullcontext():
                param.copy_(_init_value(name, param.shape, layers, generator, draw_on))


def build_model(point: Point, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """GPT2LMHeadModel of `point`'s shape with every tensor on `device` in `dtype`, seeded init."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(point))
    if any(True for _ in model.buffers()):
        raise AssertionError("GPT-2 grew buffers; build_model materialises parameters only")
    model = model.to(dtype=dtype).to_empty(device=device)
    _init_parameters(model, point.layers)
    model.tie_weights()
    return _finish(model, point)


def build_model_zero_init(point: Point, ds_config: dict) -> torch.nn.Module:
    """Build under deepspeed.zero.Init (ZeRO-3 partitions and offloads each layer as it is made),
    as DeepSpeed recommends for models that do not fit in one device's memory."""
    import deepspeed
    from transformers import GPT2LMHeadModel

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = GPT2LMHeadModel(gpt2_config(point))
    # HF's own init wrote into the empty partitions; write ours through whole parameters.
    _init_parameters(model, point.layers, lambda p: deepspeed.zero.GatheredParameters([p], modifier_rank=0))
    return _finish(model, point)


def _finish(model: torch.nn.Module, point: Point) -> torch.nn.Module:
    model.config.use_cache = False
    if point.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def random_batches(point: Point, count: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Seeded random token batches (labels = inputs: HF shifts them for the LM loss)."""
    generator = torch.Generator().manual_seed(SEED + 1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, point.vocab, (point.batch, point.seq), generator=generator)
        ids = ids.to(device)
        batches.append({"input_ids": ids, "labels": ids})
    return batches
