"""AdamW's new compute-dtype weights on the GPU, bit for bit those of the CPU kernel (stronghold/csrc/adamw.c).

The CPU optimizer's `preview` (weights_first.py) writes a block's next weights before its fp32 state; at the update
boundary those previews, bound by host memory bandwidth, set when the next forward can start. This kernel computes the
same weights on the GPU from the block's fp32 master, moments and gradient copied up over PCIe, so the GPU can take
part of the boundary (stronghold/gpu_preview.py). Same operations in the same order as `adamw_math`, each rounded
once: the launch turns fused multiply-adds off (the C file is built with -ffp-contract=off), and division and square
root are the correctly rounded ones (Triton's default `/` and `sqrt` on the GPU are approximate).
"""
import triton
import triton.language as tl

from .rounding import cast_to


@triton.jit
def adamw_preview(P, M, V, G, OUT, n, scale, decay, w1, beta2, omb2, neg_step_size, bc2_sqrt, eps,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    p = tl.load(P + offs, mask=ok, other=0.0)
    m = tl.load(M + offs, mask=ok, other=0.0)
    v = tl.load(V + offs, mask=ok, other=0.0)
    gs = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32) * scale
    pi = p * decay
    mi = m + w1 * (gs - m)
    vi = v * beta2
    vi = vi + omb2 * gs * gs
    denom = tl.math.div_rn(tl.math.sqrt_rn(vi), bc2_sqrt) + eps
    pi = pi + neg_step_size * tl.math.div_rn(mi, denom)
    tl.store(OUT + offs, cast_to(pi, OUT.dtype.element_ty), mask=ok)
