"""AdamW over many tensors in one launch: fp32 master, moments and a compute-dtype copy of the parameter.

Each program takes one tile of one tensor: `tiles` holds (tensor index, first element) per program, and
`addresses` the data pointers of each tensor's gradient, master, exp_avg, exp_avg_sq and output copy, so
a step over hundreds of parameters of any sizes is one launch. The arithmetic is torch's fused AdamW
(`_fused_adamw_`, ADAMW mode) in fp32 with IEEE-rounded square root and division.
"""
import triton
import triton.language as tl

from .rounding import cast_to

HPARAM_COLUMNS = 8
"""Per-tensor fp32 row: lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, lr / bias_correction1,
sqrt(bias_correction2), eps."""


@triton.jit
def _pointer(addresses, row, column, DTYPE: tl.constexpr):
    return tl.load(addresses + row * 5 + column).to(tl.pointer_type(DTYPE))


@triton.jit
def adamw_kernel(tiles, addresses, numels, hparams, grad_coef,
                 GRAD: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
    """GRAD: the gradients' dtype (0 bf16, 1 fp16, 2 fp32); OUT: the copy written beside the master
    (0 none, 1 bf16, 2 fp16)."""
    pid = tl.program_id(0)
    tensor = tl.load(tiles + pid * 2)
    start = tl.load(tiles + pid * 2 + 1)
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < tl.load(numels + tensor)

    if GRAD == 0:
        grad_ptr = _pointer(addresses, tensor, 0, tl.bfloat16)
    elif GRAD == 1:
        grad_ptr = _pointer(addresses, tensor, 0, tl.float16)
    else:
        grad_ptr = _pointer(addresses, tensor, 0, tl.float32)
    master_ptr = _pointer(addresses, tensor, 1, tl.float32)
    exp_avg_ptr = _pointer(addresses, tensor, 2, tl.float32)
    exp_avg_sq_ptr = _pointer(addresses, tensor, 3, tl.float32)

    row = hparams + tensor * 8
    lr_decay = tl.load(row)
    beta1 = tl.load(row + 1)
    one_minus_beta1 = tl.load(row + 2)
    beta2 = tl.load(row + 3)
    one_minus_beta2 = tl.load(row + 4)
    step_size = tl.load(row + 5)
    bias_correction2_sqrt = tl.load(row + 6)
    eps = tl.load(row + 7)

    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * grad_coef
    param = tl.load(master_ptr + offsets, mask=mask, other=0.0)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)

    param = param - lr_decay * param
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - tl.div_rn(step_size * exp_avg, denom)

    tl.store(master_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    if OUT == 1:
        tl.store(_pointer(addresses, tensor, 4, tl.bfloat16) + offsets, cast_to(param, tl.bfloat16), mask=mask)
    elif OUT == 2:
        tl.store(_pointer(addresses, tensor, 4, tl.float16) + offsets, cast_to(param, tl.float16), mask=mask)
