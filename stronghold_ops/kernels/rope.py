"""Rotary embedding on q and k in HF's `rotate_half` convention, one program per (batch, position).

With x = [x1, x2] split at half the head dim, HF computes `x * cos + rotate_half(x) * sin`, i.e.
    out1 = x1 * cos1 - x2 * sin1,   out2 = x2 * cos2 + x1 * sin2.
The backward pass is the transpose of that linear map,
    dx1 = dy1 * cos1 + dy2 * sin2,  dx2 = dy2 * cos2 - dy1 * sin1,
which is the same kernel with (sin1, sin2) replaced by (-sin2, -sin1).
"""
import triton
import triton.language as tl

from .rounding import cast_to


@triton.jit
def _rotate_heads(X, OUT, base_x, base_out, sh_x, sh_out, heads, c1, c2, s1, s2,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < heads) & (d[None, :] < HALF)
    x_ptr = X + base_x + h[:, None] * sh_x + d[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    o_ptr = OUT + base_out + h[:, None] * sh_out + d[None, :]
    tl.store(o_ptr, cast_to(x1 * c1[None, :] - x2 * s1[None, :], OUT.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, cast_to(x2 * c2[None, :] + x1 * s2[None, :], OUT.dtype.element_ty), mask=mask)


@triton.jit
def rope(
    Q, K, COS, SIN, QO, KO, seq,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s,
    sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s,
    sc_b, sc_s, heads_q, heads_k,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // seq).to(tl.int64)
    s = (pid % seq).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    cs = b * sc_b + s * sc_s + d
    c1 = tl.load(COS + cs, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + HALF, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + HALF, mask=d_ok, other=0.0).to(tl.float32)
    if BACKWARD:
        s1, s2 = -s2, -s1
    _rotate_heads(Q, QO, b * sq_b + s * sq_s, b * sqo_b + s * sqo_s, sq_h, sqo_h, heads_q,
                  c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_D)
    _rotate_heads(K, KO, b * sk_b + s * sk_s, b * sko_b + s * sko_s, sk_h, sko_h, heads_k,
                  c1, c2, s1, s2, HALF, BLOCK_HK, BLOCK_D)
