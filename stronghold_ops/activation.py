"""MLP activations: SwiGLU (`silu(gate) * up`, Llama/Qwen2/Mistral) and tanh-approximated GeLU with a
fused bias (GPT-2's `gelu_new`). Autograd functions on the Triton kernels, and eager references.

The backward passes recompute the activation from the saved inputs, so they keep nothing beyond what
eager autograd keeps. Non-contiguous inputs are copied to contiguous ones (elementwise kernels walk
flat memory); outputs are contiguous.
"""
import torch
import torch.nn.functional as F

from . import _runtime as rt

_ELEMENTWISE_BLOCK = 1024
# GeLU tiles: rows x columns per program. Bias gradients are summed per row block. 8 warps keep the
# backward at 16 elements per thread (168 registers at 4 warps).
_GELU_BLOCK_M, _GELU_BLOCK_N, _GELU_WARPS = 32, 128, 8


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's `act_fn(gate_proj(x)) * up_proj(x)` with `hidden_act="silu"`."""
    return F.silu(gate) * up


def gelu_tanh_reference(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """GPT-2's `gelu_new` (the tanh approximation) of `x + bias`."""
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        from .kernels import activation as kernels

        rt.check_inputs("swiglu", gate, up)
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(
                f"swiglu: gate and up must have the same shape and dtype, got "
                f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}"
            )
        gate, up = gate.contiguous(), up.contiguous()
        out = rt.new_empty(gate.shape, gate.dtype, gate.device)
        n = gate.numel()
        if n:
            kernels.swiglu_fwd[(rt.cdiv(n, _ELEMENTWISE_BLOCK),)](gate, up, out, n, BLOCK=_ELEMENTWISE_BLOCK)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dy):
        from .kernels import activation as kernels

        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        d_gate = rt.new_empty(gate.shape, gate.dtype, gate.device)
        d_up = rt.new_empty(up.shape, up.dtype, up.device)
        n = gate.numel()
        if n:
            kernels.swiglu_bwd[(rt.cdiv(n, _ELEMENTWISE_BLOCK),)](
                dy, gate, up, d_gate, d_up, n, BLOCK=_ELEMENTWISE_BLOCK
            )
        return d_gate, d_up


class GeLUTanhFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        from .kernels import activation as kernels

        rt.check_inputs("gelu_tanh", x, *([bias] if bias is not None else []))
        if bias is not None and bias.shape != (x.shape[-1],):
            raise ValueError(f"gelu_tanh: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")
        x2 = rt.as_rows(x)
        rows, cols = x2.shape
        out = rt.new_empty((rows, cols), x.dtype, x.device)
        if x2.numel():
            grid = (rt.cdiv(rows, _GELU_BLOCK_M), rt.cdiv(cols, _GELU_BLOCK_N))
            kernels.gelu_fwd[grid](
                x2, bias if bias is not None else x2, out, rows, cols, x2.stride(0), out.stride(0),
                BLOCK_M=_GELU_BLOCK_M, BLOCK_N=_GELU_BLOCK_N, HAS_BIAS=bias is not None, num_warps=_GELU_WARPS,
            )
        ctx.save_for_backward(x2, bias)
        ctx.x_shape = x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        from .kernels import activation as kernels

        x2, bias = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = rt.as_rows(dy)
        dx = rt.new_empty((rows, cols), x2.dtype, x2.device)
        row_blocks = rt.cdiv(rows, _GELU_BLOCK_M)
        db_partial = rt.new_empty((row_blocks, cols), torch.float32, x2.device) if bias is not None else dx
        if x2.numel():
            kernels.gelu_bwd[(row_blocks, rt.cdiv(cols, _GELU_BLOCK_N))](
                dy2, x2, bias if bias is not None else x2, dx, db_partial,
                rows, cols, dy2.stride(0), x2.stride(0), dx.stride(0),
                BLOCK_M=_GELU_BLOCK_M, BLOCK_N=_GELU_BLOCK_N, HAS_BIAS=bias is not None, num_warps=_GELU_WARPS,
            )
        # Without elements db_partial is empty too, and its sum over no row blocks is the zero gradient.
        d_bias = db_partial.sum(0).to(bias.dtype) if bias is not None else None
        return dx.view(ctx.x_shape), d_bias


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, elementwise."""
    return SwiGLUFunction.apply(gate, up)


def gelu_tanh(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Tanh-approximated GeLU of `x + bias` (bias over the last dim, optional)."""
    return GeLUTanhFunction.apply(x, bias)
