"""Row normalisation kernels: RMSNorm and LayerNorm (with or without bias), forward and backward.

Forward and input gradient: ROWS rows per program, each row whole in registers (its statistics are
reductions over it). Weight and bias gradients, two ways (norm.py picks one per launch):
- fused: the input-gradient kernel walks STEPS x ROWS rows per program and also sums dy * xhat (and dy)
  over them, writing one fp32 partial row per program; x and dy are read once in the backward.
- separate: a second kernel reduces over rows, one column block and one range of rows per program.
  It reads x and dy again but every program is small; a fused kernel that walked 8 rows at 16 warps
  ran at 0.4x of torch's LayerNorm on an H200.
Either way `norm_sum_partials` adds the partial rows and writes the gradients in the weight's dtype.
"""
import triton
import triton.language as tl

from .rounding import cast_to


@triton.jit
def _row_stats(x, mask, width, eps, IS_RMS: tl.constexpr):
    """(x - mean, mean, rstd) of each row of the fp32 tile x ([ROWS, BLOCK], zero where masked);
    RMSNorm has no mean (0.0, unused)."""
    if IS_RMS:
        xc = x
        mean = 0.0
    else:
        mean = tl.sum(x, axis=1) / width
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / width + eps)
    return xc, mean, rstd


@triton.jit
def norm_fwd(
    X, W, B, Y, MEAN, RSTD,
    rows, stride_x, stride_y, width, eps,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    cols = tl.arange(0, BLOCK)
    col_ok = cols < width
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + r[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xc, mean, rstd = _row_stats(x, mask, width, eps, IS_RMS)
    if not IS_RMS:
        tl.store(MEAN + r, mean, mask=row_ok)
    tl.store(RSTD + r, rstd, mask=row_ok)
    xhat = xc * rstd[:, None]
    if IS_RMS:
        # HF's RMSNorm casts the normalised row to the input dtype before scaling by the weight.
        xhat = cast_to(xhat, X.dtype.element_ty).to(tl.float32)
    y = xhat * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + r[:, None] * stride_y + cols[None, :], cast_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _dy_xhat_rstd(DY, X, MEAN, RSTD, r, cols, mask, row_ok, stride_dy, stride_x, IS_RMS: tl.constexpr):
    """dy, the normalised input xhat (zero where masked) and rstd of rows r, in fp32."""
    x = tl.load(X + r[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + r[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + r, mask=row_ok, other=0.0)
    if IS_RMS:
        xhat = x * rstd[:, None]
    else:
        xhat = tl.where(mask, (x - tl.load(MEAN + r, mask=row_ok, other=0.0)[:, None]) * rstd[:, None], 0.0)
    return dy, xhat, rstd


@triton.jit
def _input_grad(DY, X, MEAN, RSTD, DX, w, r, cols, mask, row_ok, stride_dy, stride_x, stride_dx, width,
                IS_RMS: tl.constexpr):
    """dx for rows r; returns (dy, xhat) in fp32 for the weight-gradient sums."""
    dy, xhat, rstd = _dy_xhat_rstd(DY, X, MEAN, RSTD, r, cols, mask, row_ok, stride_dy, stride_x, IS_RMS)
    wdy = w[None, :] * dy
    # d/dx of w * (x - mean) * rstd: the projection removes the components along xhat (and 1).
    dx = wdy - xhat * (tl.sum(xhat * wdy, axis=1) / width)[:, None]
    if not IS_RMS:
        dx -= (tl.sum(wdy, axis=1) / width)[:, None]
    tl.store(DX + r[:, None] * stride_dx + cols[None, :], cast_to(dx * rstd[:, None], DX.dtype.element_ty),
             mask=mask)
    return dy, xhat


@triton.jit
def norm_bwd_input(
    DY, X, W, MEAN, RSTD, DX,
    rows, stride_dy, stride_x, stride_dx, width,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, IS_RMS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    cols = tl.arange(0, BLOCK)
    col_ok = cols < width
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    _input_grad(DY, X, MEAN, RSTD, DX, w, r, cols, row_ok[:, None] & col_ok[None, :], row_ok,
                stride_dy, stride_x, stride_dx, width, IS_RMS)


@triton.jit
def norm_bwd_fused(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    rows, stride_dy, stride_x, stride_dx, width,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, STEPS: tl.constexpr, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """dx for STEPS x ROWS rows, and their partial column sums of dy * xhat (and dy), in one pass."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < width
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for step in range(STEPS):
        r = (pid.to(tl.int64) * STEPS + step) * ROWS + tl.arange(0, ROWS)
        row_ok = r < rows
        dy, xhat = _input_grad(DY, X, MEAN, RSTD, DX, w, r, cols, row_ok[:, None] & col_ok[None, :], row_ok,
                               stride_dy, stride_x, stride_dx, width, IS_RMS)
        dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    tl.store(DW_PARTIAL + pid * width + cols, dw, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid * width + cols, db, mask=col_ok)


@triton.jit
def norm_bwd_weight(
    DY, X, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL,
    stride_dy, stride_x, rows, width,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Partial column sums of dy * xhat (and dy) over TILES tiles of BLOCK_M rows."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    split = tl.program_id(1)
    # Elementwise accumulators, reduced over rows once at the end: no cross-thread traffic per tile.
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(TILES):
        r = (split * TILES + t).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = r < rows
        dy, xhat, _ = _dy_xhat_rstd(DY, X, MEAN, RSTD, r, cols, row_ok[:, None] & col_ok[None, :], row_ok,
                                    stride_dy, stride_x, IS_RMS)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PARTIAL + split * width + cols, tl.sum(dw, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + split * width + cols, tl.sum(db, axis=0), mask=col_ok)


@triton.jit
def norm_sum_partials(
    DW_PARTIAL, DB_PARTIAL, DW, DB, splits, width,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """DW (and DB) = column sums of the [splits, width] fp32 partials, in the weight's dtype.
    CHUNKS x BLOCK_S >= splits (a power of two, so few compiled variants)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for chunk in range(CHUNKS):
        s = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
        mask = (s < splits)[:, None] & col_ok[None, :]
        offsets = s[:, None] * width + cols[None, :]
        dw += tl.sum(tl.load(DW_PARTIAL + offsets, mask=mask, other=0.0), axis=0)
        if HAS_BIAS:
            db += tl.sum(tl.load(DB_PARTIAL + offsets, mask=mask, other=0.0), axis=0)
    tl.store(DW + cols, cast_to(dw, DW.dtype.element_ty), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB + cols, cast_to(db, DB.dtype.element_ty), mask=col_ok)
