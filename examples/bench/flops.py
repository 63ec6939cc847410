"""Parameter count and analytic FLOP count of the benchmark model (pure arithmetic, no torch)."""
from __future__ import annotations

from stronghold.engine.flops import transformer_flops_per_token

from .point import Point


def _kv_width(point: Point) -> int:
    """The width of one of k and v: the key/value heads times the head dimension."""
    return point.num_kv_heads * (point.hidden // point.heads)


def block_matmul_params(point: Point) -> int:
    """Weights one block multiplies every token by (biases and norms take no matmul FLOPs).

    GPT-2: q, k, v, out h² each, MLP h x 4h and 4h x h: 12·h².
    Llama: q and o h² each; k and v h x (kv_heads · h/heads) each (grouped-query attention shares
    them, so they shrink with kv_heads); SwiGLU MLP gate, up (h x I) and down (I x h): 3·h·I.
    So 2·h² + 2·h·kv·(h/heads) + 3·h·I, which is 12·h² at kv = heads and I = 8/3·h."""
    h = point.hidden
    if point.arch == "gpt2":
        return 12 * h * h
    return 2 * h * h + 2 * h * _kv_width(point) + 3 * h * point.intermediate_size


def param_count(point: Point) -> int:
    """Exact parameter count of the HF model (a tied LM head counted once)."""
    h, L, V = point.hidden, point.layers, point.vocab
    if point.arch == "gpt2":
        # Per block: the matmul weights, their biases (3h + h + 4h + h) and 2 LayerNorms (2 x 2h);
        # then wte, wpe (learned positions) and the final LayerNorm; lm_head is tied to wte.
        return L * (block_matmul_params(point) + 13 * h) + V * h + point.seq * h + 2 * h
    # Per block: 2 RMSNorm weights, and for Qwen2 the biases of q, k and v (h + 2 x kv width); then
    # embed_tokens, the untied lm_head and the final RMSNorm; RoPE has no parameters.
    biases = h + 2 * _kv_width(point) if point.arch == "qwen2" else 0
    return L * (block_matmul_params(point) + 2 * h + biases) + 2 * V * h + h


def tokens_per_step(point: Point) -> int:
    """Tokens of one optimizer step: every micro-batch of the accumulation."""
    return point.batch * point.accumulation * point.seq


def flops_per_step(point: Point) -> tuple[float, float]:
    """(hardware FLOPs, model FLOPs) of one optimizer step; model FLOPs leave out the recompute.

    Per token, one block's forward does 2·P_b matmul FLOPs (P_b = block_matmul_params: 12·h² for
    GPT-2, 2·h² + 2·h·kv·h/heads + 3·h·I for Llama) and 4·s·h for attention (Q·Kᵀ and P·V over
    every query head, counted dense as Megatron-LM does; GQA shares keys and values but each query
    head still does its own products, so this term does not shrink); the LM head does 2·V·h.
    Backward costs twice the forward. So model FLOPs = tokens · (6·(L·P_b + V·h) + 12·L·s·h),
    i.e. 6·N·tokens over the matmul weights plus the attention term. Gradient checkpointing runs
    every block's forward once more in backward: + tokens · L · (2·P_b + 4·s·h). tokens counts
    all `accumulation` micro-batches of the step.
    """
    h, L, s = point.hidden, point.layers, point.seq
    tokens = tokens_per_step(point)
    count = dict(block_params=L * block_matmul_params(point), head_params=point.vocab * h, layers=L, hidden=h, seq=s)
    model = tokens * transformer_flops_per_token(**count, checkpointing=False)
    return tokens * transformer_flops_per_token(**count, checkpointing=point.checkpointing), model
