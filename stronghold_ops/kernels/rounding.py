"""Rounding to the output dtype that behaves the same on a GPU and in Triton's CPU interpreter.

On a GPU, `x.to(tl.bfloat16)` rounds to nearest even. Triton 3.6's interpreter truncates instead
(and its "rtne" mode carries wrongly), which would make CPU tests see twice the real bf16 error. Under
the interpreter only, round to nearest even by hand on the fp32 bit pattern first; the GPU code is the
plain conversion.
"""
import triton
import triton.language as tl

from .._runtime import interpreting

INTERPRETED: tl.constexpr = tl.constexpr(interpreting())


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """fp32 `x` as `dtype`, rounded to nearest even."""
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
