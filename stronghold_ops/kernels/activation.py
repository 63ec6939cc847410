"""Elementwise activation kernels: SwiGLU (silu(gate) * up) and tanh-approximated GeLU with an optional
fused bias, forward and backward. All arithmetic in fp32; the backward passes recompute from inputs.
"""
import triton
import triton.language as tl

from .rounding import cast_to

# Module constants must be tl.constexpr to be visible in kernels; keep them to the right of tensors.
# The compiler folds `constexpr * tensor` into tensor arithmetic, but the CPU interpreter runs the
# Python operators, and constexpr.__mul__ returns a constexpr wrapping the tensor. Triton 3.6's
# interpreter unwrapped that where it needed a tensor; 3.7 and later do not (tl.abs of it raises "cannot
# convert ... to tensor"). `tensor * constexpr` is a tensor everywhere, and a * b == b * a in IEEE
# arithmetic, so the results are bit-identical to the other order.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_CUBIC = tl.constexpr(0.044715)


@triton.jit
def swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    # HF computes act(gate) in the activation dtype, then multiplies: round silu(gate) once here too.
    silu = cast_to(g * tl.sigmoid(g), Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, cast_to(silu * u, Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = cast_to(g * sig, DU.dtype.element_ty).to(tl.float32)
    tl.store(DU + offs, cast_to(dy * silu, DU.dtype.element_ty), mask=mask)
    dsilu = sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + offs, cast_to(dy * u * dsilu, DG.dtype.element_ty), mask=mask)


@triton.jit
def _tanh(x):
    # From exp(-2|x|) <= 1: no overflow for large |x|, and no libdevice call.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def gelu_fwd(
    X, BIAS, Y, rows, cols, stride_x, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(X + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(BIAS + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
    t = _tanh((x + x * GELU_CUBIC * x * x) * SQRT_2_OVER_PI)
    tl.store(Y + r[:, None] * stride_y + c[None, :], cast_to(0.5 * x * (1.0 + t), Y.dtype.element_ty), mask=mask)


@triton.jit
def gelu_bwd(
    DY, X, BIAS, DX, DB_PARTIAL, rows, cols, stride_dy, stride_x, stride_dx,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = c < cols
    mask = (r[:, None] < rows) & col_ok[None, :]
    x = tl.load(X + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(BIAS + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dy = tl.load(DY + r[:, None] * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
    t = _tanh((x + x * GELU_CUBIC * x * x) * SQRT_2_OVER_PI)
    dgelu = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + x * (3.0 * GELU_CUBIC) * x)
    dx = dy * dgelu
    tl.store(DX + r[:, None] * stride_dx + c[None, :], cast_to(dx, DX.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        # Column sums of this tile (masked lanes hold dy = 0); the caller adds the row-block partials.
        tl.store(DB_PARTIAL + pid_m * cols + c, tl.sum(dx, axis=0), mask=col_ok)
