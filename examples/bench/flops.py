"""Parameter count and analytic FLOP count of the benchmark model (pure arithmetic, no torch)."""
from __future__ import annotations

from stronghold.flops import transformer_flops_per_token

from .point import Point


def param_count(point: Point) -> int:
    """Exact GPT2LMHeadModel parameter count (lm_head is tied to wte, so it adds nothing)."""
    h, L = point.hidden, point.layers
    per_block = 12 * h * h + 13 * h  # qkv + proj + 2 MLP matrices; their biases and 2 LayerNorms
    return L * per_block + point.vocab * h + point.seq * h + 2 * h


def flops_per_step(point: Point) -> tuple[float, float]:
    """(hardware FLOPs, model FLOPs) of one training step; model FLOPs leave out the recompute.

    Per token, one block's forward does 24·h² matmul FLOPs (2 FLOPs x 12·h² weights) and 4·s·h
    for attention (Q·Kᵀ and P·V, counted dense as Megatron-LM does); the LM head does 2·V·h.
    Backward costs twice the forward. So model FLOPs = tokens · (6·(12·L·h² + V·h) + 12·L·s·h),
    i.e. 6·N·tokens over the matmul weights plus the attention term. Gradient checkpointing runs
    every block's forward once more in backward: + tokens · L · (24·h² + 4·s·h).
    """
    h, L, s, V = point.hidden, point.layers, point.seq, point.vocab
    tokens = point.batch * s
    count = dict(block_params=12 * L * h * h, head_params=V * h, layers=L, hidden=h, seq=s)
    model = tokens * transformer_flops_per_token(**count, checkpointing=False)
    return tokens * transformer_flops_per_token(**count, checkpointing=point.checkpointing), model
