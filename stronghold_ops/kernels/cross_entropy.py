"""Cross-entropy over rows of logits, with the logits' gradient written over the logits in place.

One program per row. Pass 1 keeps a running max and sum of exponentials over the vocabulary in blocks
(an online log-sum-exp, fp32); pass 2 writes `(softmax - onehot(target)) * scale` over the same
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
    running_max = float("-inf")
    running_sum = 0.0
    for i in range(N_BLOCKS):
        c = i * BLOCK_V + cols
        x = tl.load(base + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
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
