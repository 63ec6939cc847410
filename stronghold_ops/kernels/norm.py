"""Row normalisation kernels: RMSNorm and LayerNorm (with or without bias), forward and backward.

One row per program in the forward pass. The backward pass walks ROWS rows per program so that the
weight and bias gradients are reduced in registers, and writes one fp32 partial sum per program; the
caller adds the partials (a [programs, width] buffer, a small fraction of the activations).
"""
import triton
import triton.language as tl

from .rounding import cast_to


@triton.jit
def norm_fwd(
    X, W, B, Y, MEAN, RSTD,
    stride_x, stride_y, width, eps,
    BLOCK: tl.constexpr, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_XHAT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / width
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / width + eps)
    tl.store(RSTD + row, rstd)
    xhat = xc * rstd
    if ROUND_XHAT:
        # HF's RMSNorm casts the normalised row to the input dtype before scaling by the weight.
        xhat = cast_to(xhat, X.dtype.element_ty).to(tl.float32)
    y = xhat * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, cast_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def norm_bwd(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    stride_dy, stride_x, stride_dx, rows, width,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < width
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = (pid * ROWS + i).to(tl.int64)
        row_ok = row < rows
        mask = col_ok & row_ok
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(MEAN + row, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        # d/dx of w * (x - mean) * rstd: the projection removes the components along xhat (and 1).
        dx = wdy - xhat * (tl.sum(xhat * wdy, axis=0) / width)
        if not IS_RMS:
            dx -= tl.sum(wdy, axis=0) / width
        tl.store(DX + row * stride_dx + cols, cast_to(dx * rstd, DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PARTIAL + pid * width + cols, dw, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid * width + cols, db, mask=col_ok)
