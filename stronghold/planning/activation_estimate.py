"""An upper estimate of a checkpointed decoder's activation memory from its first batch's shape.

The construction-time plan cannot know the batch, so it holds half the GPU budget back for the first step's
activations (initial_plan.ACTIVATION_RESERVES); a checkpointed decoder at the usual batch sizes needs a small part of
that, and the first step then streams blocks that the plan after it makes resident (Llama 2.70 B, 2 x 2048 tokens,
32 GiB: 26 streamed blocks in the first step, 17 after it). At the first training forward the batch's shape is
known: this estimate replaces the reserve there (placement.Placement.first_forward), and the measured peak after the
first step replaces the estimate.

Only where the estimate can be an upper bound: a model running with HF activation checkpointing, whose
activations are the blocks' inputs, one block's recompute and backward, and the loss. The loss's tensors and a
recompute's never live at once: the loss's backward frees them before the last block recomputes, and the forward is
done with every block before the loss runs. What may outlive the loss is the logits the model returned (a caller
holding the model's output keeps them through backward): the peak is the larger of the loss's and a block's working
set beside those logits, over the blocks' inputs. Without checkpointing
every block's activations stay and depend on the attention implementation: the construction-time reserve stays.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

from stronghold.integrations.hf_compat import is_checkpointing
from stronghold.planning.plan_types import (ACTIVATION_PREFETCH_BLOCKS, FP32_BYTES, KEPT_PENDING,
                                            STREAMED_GRADS_IN_FLIGHT, Activations, ModelSpec)

BLOCK_WORKING_SET = (32, 8)
"""Elements a token of one block's recompute plus backward holds at its peak, as (per hidden unit, per MLP unit).
A Llama block saves about 9 hidden-sized tensors, 4 MLP-sized ones and two fp32 norms (16 more hidden-sized
elements in the compute dtype's terms); its backward's gradients add up to as much again while they are freed."""
LOSS_BYTES_PER_LOGIT = (2, 12)
"""Bytes a token's logit holds at HF's loss, as (times the compute dtype's element size, plus fp32 bytes): the
logits and their gradient in the compute dtype, and HF's fp32 upcast, its softmax and its gradient. A model whose
head runs stronghold_ops' fused linear + cross-entropy (the engine installs it at the first forward where the logits
would be large, memory/long_context.py, before this estimate is made) holds none of them: `loss_bytes`."""
FUSED_HEAD = "fused_linear_cross_entropy"
FRAGMENTATION = 1.25
"""Allocator blocks reserved beyond the allocated peak, and what the sizes above miss (a model's own extra
tensors): the re-plan after the first step counts the measured reserved-over-allocated gap the same way."""


def _config_int(config, *names: str) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def checkpointed_decoder_activations(model: nn.Module, tokens: Optional[int],
                                     element_bytes: int) -> Optional[Activations]:
    """The estimate for `tokens` tokens a micro-batch (batch x sequence), or None where it cannot be an upper
    bound (no checkpointing, no config to read the sizes from, an unknown batch)."""
    config = getattr(model, "config", None)
    if not tokens or config is None or not is_checkpointing(model):
        return None
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    vocab = _config_int(config, "vocab_size")
    if hidden is None or vocab is None:
        return None
    mlp = _config_int(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    per_hidden, per_mlp = BLOCK_WORKING_SET
    block = tokens * (per_hidden * hidden + per_mlp * mlp) * element_bytes
    loss = loss_bytes(model, tokens, vocab, hidden, element_bytes)
    returned = 0 if fused_head(model) else tokens * vocab * element_bytes
    per_block = tokens * hidden * element_bytes
    return Activations(fixed_peak_bytes=int(FRAGMENTATION * max(loss, block + returned)),
                       per_block_bytes=int(FRAGMENTATION * per_block))


def block_input_bytes(model: nn.Module, tokens: Optional[int], element_bytes: int) -> Optional[int]:
    """One block's input of a micro-batch of `tokens` tokens (hidden states), or None where the sizes are unknown."""
    config = getattr(model, "config", None)
    hidden = None if config is None else _config_int(config, "hidden_size", "n_embd", "d_model")
    return tokens * hidden * element_bytes if tokens and hidden else None


def fused_head(model: nn.Module) -> bool:
    """Whether the model's head runs stronghold_ops' fused linear + cross-entropy (no logits exist)."""
    from stronghold_ops.patching import PATCH_MARK

    return any(module.__dict__.get(PATCH_MARK) == FUSED_HEAD for module in model.modules())  # PEFT nests the model


def loss_bytes(model: nn.Module, tokens: int, vocab: int, hidden: int, element_bytes: int) -> int:
    """What the loss holds at its peak. HF's: every token's logits (LOSS_BYTES_PER_LOGIT). The fused head's
    (stronghold_ops/linear_cross_entropy.py): one chunk of logits, and from its forward to its backward the weight's
    gradient and the hidden states' gradient, in the compute dtype, and an fp32 loss a token."""
    from stronghold_ops.linear_cross_entropy import default_chunk_tokens

    if fused_head(model):
        chunk = min(tokens, default_chunk_tokens(vocab, element_bytes))
        return (chunk * vocab + vocab * hidden + tokens * hidden) * element_bytes + 4 * tokens
    scaled, fp32 = LOSS_BYTES_PER_LOGIT
    return tokens * vocab * (scaled * element_bytes + fp32)


def split_measured(activations: int, offload, blocks: int, gap: int = 0) -> tuple[Activations, int]:
    """The first step's measured activations, with the block inputs offloaded (memory/activations.py measured them,
    `offload`), as a fixed part and one block input per block kept on the GPU in that step, and the offload count to
    plan with: the configured one. ("auto" never offloads yet; once measured on a GPU, planning with None, the fewest
    blocks that fit, is the planner's way to choose.) `gap`: of `activations`, Activations.allocator_gap_bytes."""
    per_block = max(offload.block_input_bytes.values())
    chosen = len(offload.chosen)
    on_gpu = blocks - chosen + min(chosen, ACTIVATION_PREFETCH_BLOCKS)
    fixed = max(0, activations - per_block * on_gpu)
    return Activations(fixed_peak_bytes=fixed, per_block_bytes=per_block, allocator_gap_bytes=min(gap, fixed)), chosen


def blockwise(estimate: Activations, spec: ModelSpec, cached_parts: frozenset[str], on_host: bool,
              ahead: bool = False) -> Activations:
    """The batch's checkpointed estimate as the blockwise backward (engine/blockwise.py) uses the GPU: every block's
    input kept for each micro-batch of the window, or with the inputs kept on the host (`on_host`,
    engine/kept_inputs.py) the first block's, two blocks' during the walk and those whose D2H is in flight. During the
    walk, the larger of its two phases: over the blocks, the fp32 sums of the blocks whose D2H is in flight (planned as
    compute-dtype gradients); then, for a cached input part, its fp32 sum beside its gradient, with the last block's
    sum possibly still in flight (the embeddings' backward runs after every block's). An embedding table's sum holds
    only the rows of the window's tokens (PartSpec.row_gradients): at most the window's tokens x the hidden size, which
    is the window's block inputs over the compute dtype's bytes.

    A measured `estimate` (a step of host accumulation) holds in its allocator gap the table's whole gradient where it
    waited for its D2H after a micro-batch: a block freed but held for the side stream, so the allocator reserved
    beside it. A walk that sums the table's rows never makes that gradient, so the gap comes off, up to the gradient's
    bytes. (Should the walk fall back to the whole table's sum, the planner's margin is larger than that gradient on
    the shapes with a large vocabulary.)

    `ahead`: the window's forwards run block by block (engine/block_major.py): every micro-batch's last block output
    and collected first block input wait on the GPU for its own forward, two block inputs a micro-batch more."""
    cb, fp32 = spec.compute_bytes, FP32_BYTES
    largest = max((b.trainable_numel for b in spec.blocks), default=0)
    blocks = largest * (fp32 - cb) * STREAMED_GRADS_IN_FLIGHT
    summed, unheld = 0, 0
    for part in spec.rest_parts:
        if part.name == "input" and part.name in cached_parts:
            rows = estimate.per_block_bytes * spec.accumulation_steps // cb if part.row_gradients else None
            summed += part.trainable_numel if rows is None else min(part.trainable_numel, rows)
            if rows is not None:
                unheld = min(estimate.allocator_gap_bytes, part.trainable_numel * cb)
    walk = max(blocks, summed * (fp32 + cb) + largest * (fp32 - cb)) if summed else blocks
    fixed = estimate.fixed_peak_bytes - unheld + walk
    if ahead:
        fixed += 2 * spec.accumulation_steps * estimate.per_block_bytes
    estimate = dataclasses.replace(estimate, allocator_gap_bytes=estimate.allocator_gap_bytes - unheld)
    if on_host:
        walk_inputs = estimate.per_block_bytes * (3 * spec.accumulation_steps + KEPT_PENDING)
        return dataclasses.replace(estimate, fixed_peak_bytes=fixed + walk_inputs)
    return dataclasses.replace(estimate, fixed_peak_bytes=fixed,
                               per_block_bytes=estimate.per_block_bytes * spec.accumulation_steps)
