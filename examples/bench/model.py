"""The benchmark model: HF GPT-2, Llama or Qwen2 of a point's shape, random seeded init, random token batches.

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

from examples.llama import llama_config
from stronghold.integrations.hf_compat import enable_checkpointing

from .point import Point

# GPT-2's init: N(0, 0.02) for matrices and embeddings; residual projections scaled by
# 1/sqrt(2 * n_layer) (GPT-2 paper, sec. 2.3); LayerNorm weight 1, biases 0. Llama's (HF's
# LlamaPreTrainedModel): N(0, 0.02) for every matrix and the embedding, RMSNorm weight 1.
INIT_STD = 0.02
SEED = 1234
# Buffers a model may hold, by name prefix; build_model recomputes them after materialising.
# Llama's rotary inverse frequencies are computed, not learned: they must not be left empty.
COMPUTED_BUFFERS = {"gpt2": (), "llama": ("model.rotary_emb.",), "qwen2": ("model.rotary_emb.",)}
# Every point runs the model's SDPA attention (flash / memory-efficient kernels on the GPU), the
# default transformers picks here anyway: named so that no version change swaps in the eager
# attention, whose seq x seq scores would decide the long-sequence limits (issue 13).
ATTENTION = "sdpa"


def gpt2_config(point: Point):
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=point.hidden, n_layer=point.layers, n_head=point.heads, n_positions=point.seq,
        vocab_size=point.vocab, use_cache=False,
    )


def hf_config(point: Point):
    """The transformers config of `point`'s architecture and shape, with SDPA attention."""
    if point.arch == "gpt2":
        config = gpt2_config(point)
    else:
        config = llama_config(hidden=point.hidden, layers=point.layers, heads=point.heads, seq=point.seq,
                              vocab=point.vocab, intermediate=point.intermediate_size, kv_heads=point.num_kv_heads,
                              qwen2=point.arch == "qwen2")
    config._attn_implementation = ATTENTION  # the config's setter; the model checks it is supported
    return config


def model_class(point: Point):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM

    return {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[point.arch]


def _init_value(name: str, shape: torch.Size, point: Point, generator: torch.Generator, device) -> torch.Tensor:
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    if ".ln_" in name or name.endswith("norm.weight"):  # GPT-2's ln_1/ln_2/ln_f, Llama's *_layernorm/norm
        return torch.ones(shape, device=device)
    residual = point.arch == "gpt2" and name.endswith("c_proj.weight")
    std = INIT_STD / math.sqrt(2 * point.layers) if residual else INIT_STD
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def _init_parameters(model: torch.nn.Module, point: Point, gather=None) -> None:
    """Seeded init of every parameter (GPT-2's or Llama's), the same values whatever the system.

    `gather(param)` is a context manager that makes a partitioned (ZeRO-3) parameter whole while
    it is written. Random numbers come from the GPU when there is one: its generator fills GBs
    per second, where the CPU's fills about 0.1 GB/s on one core."""
    draw_on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator(device=draw_on).manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied lm_head.weight is listed once, as wte
            with gather(param) if gather else contextlib.nullcontext():
                param.copy_(_init_value(name, param.shape, point, generator, draw_on))


def _recompute_buffers(model: torch.nn.Module, point: Point, device: torch.device) -> None:
    """Replace the computed buffers that to_empty left uninitialised with freshly computed ones."""
    prefixes = COMPUTED_BUFFERS[point.arch]
    unknown = [name for name, _ in model.named_buffers() if not name.startswith(prefixes)]
    if unknown:
        raise AssertionError(f"{point.arch} grew buffers {unknown}; build_model recomputes only {prefixes}")
    if point.arch != "gpt2":
        # Built off the meta device, in fp32 as HF computes them; a few KB.
        rotary = model.model.rotary_emb
        model.model.rotary_emb = type(rotary)(model.config).to(device)


def build_model(point: Point, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model of `point`'s arch and shape with every tensor on `device` in `dtype`, seeded init."""
    with torch.device("meta"):
        model = model_class(point)(hf_config(point))
    model = model.to(dtype=dtype).to_empty(device=device)
    _recompute_buffers(model, point, device)
    _init_parameters(model, point)
    model.tie_weights()  # GPT-2's lm_head is wte; Llama's is its own (tie_word_embeddings=False)
    return _finish(model, point)


def build_model_zero_init(point: Point, ds_config: dict) -> torch.nn.Module:
    """Build under deepspeed.zero.Init (ZeRO-3 partitions and offloads each layer as it is made),
    as DeepSpeed recommends for models that do not fit in one device's memory."""
    import deepspeed

    # Import the model's module first: importing it under zero.Init (which patches tensor
    # construction) breaks torch._dynamo's import.
    cls, config = model_class(point), hf_config(point)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = cls(config)
    # HF's own init wrote into the empty partitions; write ours through whole parameters.
    _init_parameters(model, point, lambda p: deepspeed.zero.GatheredParameters([p], modifier_rank=0))
    return _finish(model, point)


def _finish(model: torch.nn.Module, point: Point) -> torch.nn.Module:
    assert model.config._attn_implementation == ATTENTION, model.config._attn_implementation
    model.config.use_cache = False
    if point.checkpointing:
        enable_checkpointing(model)
    model.train()
    return model


def random_batches(point: Point, count: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Seeded random token batches (labels = inputs: HF shifts them for the LM loss). The first
    batches are the same whatever `count`, so a longer accumulation keeps the first loss."""
    generator = torch.Generator().manual_seed(SEED + 1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, point.vocab, (point.batch, point.seq), generator=generator)
        ids = ids.to(device)
        batches.append({"input_ids": ids, "labels": ids})
    return batches
