"""RMSNorm and LayerNorm over the last dimension: autograd functions on the Triton kernels, and the
eager references they are tested against.

Numerics: statistics and gradients in fp32 whatever the input dtype. `rms_norm` follows HF's
LlamaRMSNorm (also Qwen2's and Mistral's): the normalised row is rounded to the input dtype before the
weight multiply, and the output has the promoted dtype of input and weight. `layer_norm` follows
`torch.nn.functional.layer_norm`: fp32 throughout, output in the input dtype.
"""
import torch
import torch.nn.functional as F

from . import _runtime as rt


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm.forward, as a function."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# Launch settings (module-level so `python -m examples.bench.kernels_micro --sweep-norms` can time alternatives):
# - _ROW_ELEMENTS: elements per program in the row kernels (several short rows share one program);
# - _FUSED_BACKWARD: one backward pass for dx, dw and db instead of an input kernel and a weight kernel
#   (H200, 8192 x 4096 bf16, device time of forward + backward: LayerNorm 0.120 ms fused at 2 programs
#   per SM, 0.153 at 4, 0.215 at 8, 0.145 separate; torch 0.172);
# - _FUSED_PROGRAMS_PER_SM: programs of the fused backward per SM (each walks its share of the rows);
# - _WEIGHT_BLOCK_M/N, _WEIGHT_WARPS: the separate weight kernel's tile (16 x 128 with 8 warps: 78
#   registers for RMSNorm, 102 with the bias; 32 x 128 needed 128 to 172).
_ROW_ELEMENTS = 4096
_FUSED_BACKWARD = True
_FUSED_PROGRAMS_PER_SM = 2
_WEIGHT_BLOCK_M, _WEIGHT_BLOCK_N, _WEIGHT_WARPS = 16, 128, 8
_SUM_BLOCK_S, _SUM_BLOCK_N = 32, 128


def _row_launch(width: int, op: str) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) for the row kernels."""
    block = rt.row_launch(width, op)
    rows = max(1, _ROW_ELEMENTS // block)
    return block, rows, rt.warps_for(rows * block)


def _forward(ctx, x, weight, bias, eps, is_rms):
    from .kernels import norm as kernels

    op = "rms_norm" if is_rms else "layer_norm"
    rt.check_inputs(op, x, weight, *([bias] if bias is not None else []))
    width = x.shape[-1]
    if weight.shape != (width,) or (bias is not None and bias.shape != (width,)):
        raise ValueError(f"{op}: weight and bias must have shape ({width},), the last dim of the input")
    x2 = rt.as_rows(x)
    rows = x2.shape[0]
    block, per_program, warps = _row_launch(width, op)
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if is_rms else x.dtype
    y = rt.new_empty((rows, width), out_dtype, x.device)
    rstd = rt.new_empty((rows,), torch.float32, x.device)
    mean = rstd if is_rms else rt.new_empty((rows,), torch.float32, x.device)
    if rows:
        kernels.norm_fwd[(rt.cdiv(rows, per_program),)](
            x2, weight, bias if bias is not None else weight, y, mean, rstd,
            rows, x2.stride(0), y.stride(0), width, eps,
            BLOCK=block, ROWS=per_program, IS_RMS=is_rms, HAS_BIAS=bias is not None, num_warps=warps,
        )
    ctx.save_for_backward(x2, weight, mean, rstd)
    ctx.is_rms, ctx.has_bias, ctx.x_shape = is_rms, bias is not None, x.shape
    ctx.launch = block, per_program, warps
    return y.view(*x.shape[:-1], width)


def _backward(ctx, dy):
    from .kernels import norm as kernels

    x2, weight, mean, rstd = ctx.saved_tensors
    rows, width = x2.shape
    dy2 = rt.as_rows(dy)
    dx = rt.new_empty((rows, width), x2.dtype, x2.device)
    block, per_program, warps = ctx.launch
    strides = (dy2.stride(0), x2.stride(0), dx.stride(0))
    # The backward settings are read per call (the bench's --sweep-norms and the tests set them at run time).
    if _FUSED_BACKWARD:
        groups = rt.cdiv(rows, per_program)
        steps = rt.units_per_program(groups, _FUSED_PROGRAMS_PER_SM * rt.multiprocessors(x2.device))
        splits = rt.cdiv(groups, steps)
    else:
        col_blocks = rt.cdiv(width, _WEIGHT_BLOCK_N)
        row_tiles = rt.cdiv(rows, _WEIGHT_BLOCK_M)
        # About 8 programs per SM in all, col_blocks of them per row range; 4 under the interpreter
        # (multiprocessors() is 1 there), enough to exercise the partial sums.
        programs = 8 * rt.multiprocessors(x2.device) if x2.device.type == "cuda" else 4
        tiles = rt.units_per_program(row_tiles, max(1, programs // col_blocks))
        splits = rt.cdiv(row_tiles, tiles)
    # splits is 0 only without rows: no partials then, and the sum below writes zero gradients.
    dw_partial = rt.new_empty((splits, width), torch.float32, x2.device)
    db_partial = rt.new_empty((splits, width), torch.float32, x2.device) if ctx.has_bias else dw_partial
    if rows and _FUSED_BACKWARD:
        kernels.norm_bwd_fused[(splits,)](
            dy2, x2, weight, mean, rstd, dx, dw_partial, db_partial, rows, *strides, width,
            BLOCK=block, ROWS=per_program, STEPS=steps, IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias,
            num_warps=warps,
        )
    elif rows:
        kernels.norm_bwd_input[(rt.cdiv(rows, per_program),)](
            dy2, x2, weight, mean, rstd, dx, rows, *strides, width,
            BLOCK=block, ROWS=per_program, IS_RMS=ctx.is_rms, num_warps=warps,
        )
        kernels.norm_bwd_weight[(col_blocks, splits)](
            dy2, x2, mean, rstd, dw_partial, db_partial, dy2.stride(0), x2.stride(0), rows, width,
            BLOCK_M=_WEIGHT_BLOCK_M, BLOCK_N=_WEIGHT_BLOCK_N, TILES=tiles,
            IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, num_warps=_WEIGHT_WARPS,
        )
    dw = rt.new_empty((width,), weight.dtype, x2.device)
    db = rt.new_empty((width,), weight.dtype, x2.device) if ctx.has_bias else None
    kernels.norm_sum_partials[(rt.cdiv(width, _SUM_BLOCK_N),)](
        dw_partial, db_partial, dw, db if db is not None else dw, splits, width,
        BLOCK_S=_SUM_BLOCK_S, BLOCK_N=_SUM_BLOCK_N, CHUNKS=rt.next_power_of_2(rt.cdiv(splits, _SUM_BLOCK_S)),
        HAS_BIAS=ctx.has_bias, num_warps=4,
    )
    return dx.view(ctx.x_shape), dw, db


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        return _forward(ctx, x, weight, None, eps, is_rms=True)

    @staticmethod
    def backward(ctx, dy):
        dx, dw, _ = _backward(ctx, dy)
        return dx, dw, None


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        return _forward(ctx, x, weight, bias, eps, is_rms=False)

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _backward(ctx, dy)
        return dx, dw, db, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`weight * normalise(x)` over the last dim, as HF's LlamaRMSNorm computes it."""
    return RMSNormFunction.apply(x, weight, float(eps))


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim with an affine weight and an optional bias."""
    return LayerNormFunction.apply(x, weight, bias, float(eps))
