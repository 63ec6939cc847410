"""Cross-entropy over rows of logits, with the logits' gradient written over the logits in place.

One program per row. Pass 1 keeps a running max and sum of exponentials over the vocabulary in blocks
(an online log-sum-exp, fp32, per lane); pass 2 writes `(softmax - onehot(target)) * scale` over the same
memory, so the [rows, vocab] buffer is the only one of that size. Rows whose target is `ignore_index`
get loss 0 and gradient 0. A target outside [0, vocab) reads no logit (its loss is the log-sum-exp).
"""
import triton
import triton.language as tl

from .rounding import cast_to


@triton.jit
def cross_entropy_rows(
    LOGITS, stride_row, TARGETS, LOSS, SCALE, vocab, ignore_index,
    BLOCK_V: tl.constexpr, N_BLOCKS: tl.constexpr, WRITE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)
    # Per-lane running max and sum, combined once after the loop: no cross-thread reduction per block.
    # The finite start keeps exp(max_old - max_new) defined for lanes that only ever see padding.
    lane_max = tl.full([BLOCK_V], -1.0e30, tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    for i in range(N_BLOCKS):
        c = i * BLOCK_V + cols
        x = tl.load(base + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0))
    in_vocab = (target >= 0) & (target < vocab)
    target_logit = tl.load(base + target, mask=valid & in_vocab, other=0.0).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - target_logit, 0.0))
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(SCALE), 0.0)
        for i in range(N_BLOCKS):
            c = i * BLOCK_V + cols
            x = tl.load(base + c, mask=c < vocab, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(c == target, 1.0, 0.0)
            tl.store(base + c, cast_to(grad * scale, LOGITS.dtype.element_ty), mask=c < vocab)
