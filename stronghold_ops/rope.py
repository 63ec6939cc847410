"""Rotary position embedding applied to q and k in one kernel, in HF's `rotate_half` convention.

Positions come from `position_ids` through the model's own rotary module: HF turns `position_ids` into
per-position `cos`/`sin` tables of shape [batch or 1, seq, head_dim] (with any rope scaling applied),
and this op reads the row of each (batch, position) from them. So packed sequences and offsets in
`position_ids` work exactly as in HF. `cos`/`sin` get no gradient (HF computes them under no_grad).

Layout: q is [batch, heads_q, seq, head_dim] and k [batch, heads_k, seq, head_dim], any strides with a
unit stride on head_dim (HF passes transposed views of the projections; they are not copied). Outputs
keep the input's layout. Arithmetic in fp32, rounded once to the input dtype.
"""
import torch

from . import _runtime as rt


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(q, k, cos, sin):
    """HF's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _launch(q, k, cos, sin, backward: bool):
    from .kernels import rope as kernels

    batch, heads_q, seq, dim = q.shape
    q_out, k_out = rt.new_empty_like(q), rt.new_empty_like(k)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    cos_batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    kernels.rope[(batch * seq,)](
        q, k, cos, sin, q_out, k_out, seq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_batch_stride, cos.stride(1), heads_q, k.shape[1],
        HALF=dim // 2, BLOCK_HQ=rt.next_power_of_2(heads_q), BLOCK_HK=rt.next_power_of_2(k.shape[1]),
        BLOCK_D=rt.next_power_of_2(dim // 2), BACKWARD=backward, num_warps=4 if heads_q * dim <= 1024 else 8,
    )
    return q_out, k_out


def _check(q, k, cos, sin):
    rt.check_inputs("rope", q, k, cos, sin)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("rope: q and k must be [batch, heads, seq, head_dim] (HF's layout after transpose(1, 2))")
    batch, _, seq, dim = q.shape
    if k.shape[0] != batch or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or head_dim")
    if dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {dim}")
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (seq, dim) or cos.shape[0] not in (1, batch):
        raise ValueError(
            f"rope: cos and sin must be [{batch} or 1, {seq}, {dim}] (HF's rotary output), got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rope: cos and sin must not require grad (compute them under torch.no_grad, as HF does)")
    return cos, sin


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = _check(q, k, cos, sin)
        q, k, cos, sin = (rt.unit_last_stride(t) for t in (q, k, cos, sin))
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rt.unit_last_stride(dq), rt.unit_last_stride(dk)
        dq, dk = _launch(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q_rotated, k_rotated), as HF's `apply_rotary_pos_emb(q, k, cos, sin)` returns them."""
    return RopeFunction.apply(q, k, cos, sin)
