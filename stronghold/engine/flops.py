"""Training FLOPs of a transformer, by counting (no torch: the benchmark's parent process uses it too)."""
from __future__ import annotations


def transformer_flops_per_token(block_params: int, head_params: int, layers: int, hidden: int, seq: int,
                                 checkpointing: bool) -> float:
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward) and 12*L*h*s for attention
    (Q.K^T and P.V counted dense, as Megatron-LM does); activation checkpointing runs the blocks'
    forward once more (2 per block weight + 4*L*h*s), not the head's."""
    flops = 6 * (block_params + head_params) + 12 * layers * hidden * seq
    if checkpointing:
        flops += 2 * block_params + 4 * layers * hidden * seq
    return float(flops)
