"""Plumbing shared by the kernel wrappers: where kernels can run, launch sizes, outputs, input checks.

Nothing here imports Triton: the `@triton.jit` code lives in `stronghold_ops.kernels`, which the op
modules import inside their autograd functions, so `import stronghold_ops` works without Triton.

Loop trip counts inside the kernels are always `tl.constexpr`. Triton 3.6's interpreter
(`TRITON_INTERPRET=1`, the CPU test path) cannot iterate over a runtime scalar with NumPy >= 2.4, and
on a GPU a constexpr trip count costs one compilation per distinct value, which is why the values
passed are powers of two or fixed per model (vocabulary size).
"""
import functools
import os

import torch

#: Test hook: when True, every output a wrapper allocates is first filled with NaN (floating types) so
#: a comparison against the reference catches any element a kernel failed to write.
POISON_OUTPUTS = False

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# A row-wise kernel keeps one whole row in registers; past this width it would spill.
MAX_ROW_WIDTH = 65536


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process, or None when they can."""
    if not (torch.cuda.is_available() or interpreting()):
        return "no CUDA device, and TRITON_INTERPRET=1 is not set for the CPU interpreter"
    try:
        import triton  # noqa: F401  (only probing that it loads)
    except Exception as exc:  # any import failure means the same thing: no kernels here
        return f"Triton cannot be imported ({type(exc).__name__}: {exc})"
    return None


def check_inputs(op: str, *tensors: torch.Tensor) -> None:
    """ValueError for inputs the kernels cannot take: wrong device or dtype, or mixed devices."""
    device = tensors[0].device
    for t in tensors:
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{op}: expected float32, bfloat16 or float16 tensors, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{op}: all inputs must be on one device, got {device} and {t.device}")
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"{op}: Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
        f"triton is imported); got a tensor on {device}. Move the inputs to a GPU or use the "
        f"eager reference function."
    )


def new_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_OUTPUTS and dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_empty_like(t: torch.Tensor) -> torch.Tensor:
    """Same shape, dtype and strides as `t` (dense non-contiguous layouts are kept)."""
    out = torch.empty_like(t)
    if POISON_OUTPUTS and out.dtype.is_floating_point:
        out.fill_(float("nan"))
    return out


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy when its last dim does not have unit stride (what the kernels index)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a [rows, width] matrix with unit stride along the width (copies only when it must)."""
    return unit_last_stride(x.reshape(-1, x.shape[-1]))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def row_launch(width: int, op: str) -> int:
    """BLOCK for a kernel that holds one row of `width` elements (ValueError past MAX_ROW_WIDTH)."""
    if width > MAX_ROW_WIDTH:
        raise ValueError(f"{op}: rows of {width} elements exceed the supported {MAX_ROW_WIDTH}")
    return next_power_of_2(width)


def warps_for(elements: int) -> int:
    """Warps for a program holding `elements` values of each tensor it touches in registers."""
    return 4 if elements < 2048 else 8 if elements < 8192 else 16 if elements < 32768 else 32


def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device; 1 under the interpreter, which runs programs one after another (a few
    programs are enough there to exercise the partial sums)."""
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 1


@functools.lru_cache(maxsize=None)
def _cuda_multiprocessors(index: int) -> int:
    # Cached: the kernels ask on every call, and the query is host time on the launch path.
    return torch.cuda.get_device_properties(index).multi_processor_count


def units_per_program(units: int, programs: int) -> int:
    """Work units (rows, row tiles) each program of a reduction walks so that about `programs` programs
    cover `units`. A power of two, so the constexpr loop bound it becomes compiles only a few variants."""
    return next_power_of_2(cdiv(units, programs))
