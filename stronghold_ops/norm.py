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


def _forward(ctx, x, weight, bias, eps, is_rms):
    from .kernels import norm as kernels

    op = "rms_norm" if is_rms else "layer_norm"
    rt.check_inputs(op, x, weight, *([bias] if bias is not None else []))
    width = x.shape[-1]
    if weight.shape != (width,) or (bias is not None and bias.shape != (width,)):
        raise ValueError(f"{op}: weight and bias must have shape ({width},), the last dim of the input")
    x2 = rt.as_rows(x)
    rows = x2.shape[0]
    block, warps = rt.row_launch(width, op)
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if is_rms else x.dtype
    y = rt.new_empty((rows, width), out_dtype, x.device)
    rstd = rt.new_empty((rows,), torch.float32, x.device)
    mean = rstd if is_rms else rt.new_empty((rows,), torch.float32, x.device)
    if rows:
        kernels.norm_fwd[(rows,)](
            x2, weight, bias if bias is not None else weight, y, mean, rstd,
            x2.stride(0), y.stride(0), width, eps,
            BLOCK=block, IS_RMS=is_rms, HAS_BIAS=bias is not None, ROUND_XHAT=is_rms, num_warps=warps,
        )
    ctx.save_for_backward(x2, weight, mean, rstd)
    ctx.is_rms, ctx.has_bias, ctx.x_shape = is_rms, bias is not None, x.shape
    return y.view(*x.shape[:-1], width)


# Weight-gradient kernel tiles: BLOCK_M rows x BLOCK_N columns, accumulated elementwise in fp32
# (16 x 128 with 8 warps: 78 registers for RMSNorm, 102 with the bias; 32 x 128 needed 128 to 172).
_WEIGHT_BLOCK_M, _WEIGHT_BLOCK_N, _WEIGHT_WARPS = 16, 128, 8


def _backward(ctx, dy):
    from .kernels import norm as kernels

    x2, weight, mean, rstd = ctx.saved_tensors
    rows, width = x2.shape
    dy2 = rt.as_rows(dy)
    dx = rt.new_empty((rows, width), x2.dtype, x2.device)
    col_blocks = rt.cdiv(width, _WEIGHT_BLOCK_N)
    row_tiles = rt.cdiv(rows, _WEIGHT_BLOCK_M)
    tiles = rt.units_per_program(row_tiles, col_blocks, x2.device)
    splits = max(1, rt.cdiv(row_tiles, tiles))
    dw_partial = rt.new_empty((splits, width), torch.float32, x2.device)
    db_partial = rt.new_empty((splits, width), torch.float32, x2.device) if ctx.has_bias else dw_partial
    block, warps = rt.row_launch(width, "norm backward")
    if rows:
        kernels.norm_bwd_input[(rows,)](
            dy2, x2, weight, mean, rstd, dx, dy2.stride(0), x2.stride(0), dx.stride(0), width,
            BLOCK=block, IS_RMS=ctx.is_rms, num_warps=warps,
        )
        kernels.norm_bwd_weight[(col_blocks, splits)](
            dy2, x2, mean, rstd, dw_partial, db_partial, dy2.stride(0), x2.stride(0), rows, width,
            BLOCK_M=_WEIGHT_BLOCK_M, BLOCK_N=_WEIGHT_BLOCK_N, TILES=tiles,
            IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, num_warps=_WEIGHT_WARPS,
        )
    else:
        dw_partial.zero_()
        db_partial.zero_()
    dw = dw_partial.sum(0).to(weight.dtype)
    db = db_partial.sum(0).to(weight.dtype) if ctx.has_bias else None
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
