"""AdamW with fp32 masters and a compute-dtype copy, over many tensors in one launch per dtype pair.

torch's fused AdamW wants the gradient in the parameter's dtype, so a bf16 model with fp32 masters pays
an fp32 copy of every gradient, a multiply by the clip coefficient, the update, and a cast back to bf16:
four passes over memory and three launches a parameter. Here the gradient is read once in its own dtype
and scaled in registers, and the bf16 copy is written beside the master in the same pass
(`kernels/adamw.py`). `adamw_reference` is the same update with torch's single-tensor AdamW.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

BLOCK = 2048
"""Elements per program: 8 per thread at WARPS warps, enough to keep the loads wide."""
WARPS = 4

_GRAD_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_OUT_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class AdamWHparams:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def row(self, step: int) -> list[float]:
        """The kernel's per-tensor row for update number `step` (1 for the first), computed in double as
        torch's fused AdamW does on the host side of its launch."""
        bias_correction1 = 1 - self.beta1 ** step
        bias_correction2 = 1 - self.beta2 ** step
        return [self.lr * self.weight_decay, self.beta1, 1 - self.beta1, self.beta2, 1 - self.beta2,
                self.lr / bias_correction1, math.sqrt(bias_correction2), self.eps]


@dataclass
class AdamWTensor:
    """One parameter's update: the fp32 `master`, its moments, the gradient (any float dtype, read as is),
    and `out`, the compute-dtype copy to refresh (None where the master is the parameter)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    out: Optional[torch.Tensor]
    hparams: AdamWHparams
    step: int
    """The update's number, 1 for the first (torch's state["step"] after its increment)."""


_tiles_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _tiles(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile table [programs, 2]: tensor index and first element; numel per tensor), on the device. Cached:
    a model's resident parameters are the same tensors step after step."""
    key = (numels, device, BLOCK)
    found = _tiles_cache.get(key)
    if found is None:
        sizes = torch.tensor(numels, dtype=torch.int64)
        per_tensor = (sizes + BLOCK - 1) // BLOCK
        tensor = torch.repeat_interleave(torch.arange(len(numels)), per_tensor)
        first_tile = torch.cumsum(per_tensor, 0) - per_tensor
        start = (torch.arange(tensor.numel()) - first_tile[tensor]) * BLOCK
        found = (torch.stack([tensor, start], 1).contiguous().to(device), sizes.to(device))
        if len(_tiles_cache) > 64:  # layouts change only with promotion: a bound, not an eviction policy
            _tiles_cache.clear()
        _tiles_cache[key] = found
    return found


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    # Pinned, so the copy is asynchronous; torch's host allocator keeps the buffer until the copy ran.
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _check(item: AdamWTensor) -> None:
    for name in ("master", "exp_avg", "exp_avg_sq"):
        tensor = getattr(item, name)
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"adamw_step: {name} must be a contiguous float32 tensor, got {tensor.dtype}")
        if tensor.numel() != item.master.numel():
            raise ValueError(f"adamw_step: {name} has {tensor.numel()} elements, the master {item.master.numel()}")
    if item.grad.dtype not in _GRAD_CODES or item.grad.numel() != item.master.numel():
        raise ValueError(f"adamw_step: a gradient of {item.grad.dtype} and {item.grad.numel()} elements for a "
                         f"master of {item.master.numel()}")
    if item.out is not None and (item.out.dtype not in _OUT_CODES or not item.out.is_contiguous()
                                 or item.out.numel() != item.master.numel()):
        raise ValueError(f"adamw_step: the output copy must be a contiguous bf16 or fp16 tensor of the master's "
                         f"size, got {item.out.dtype}")


@dataclass
class AdamWLaunch:
    """One launch's arguments, all but the clip coefficient and the per-tensor rows: the items of one (gradient
    dtype, output dtype) pair, their tile table and their addresses already on the device. Made by `prepare` while
    the GPU still runs the backward, so that once the coefficient is known (a host sync) only the launch is left."""

    items: list[AdamWTensor]
    grad_code: int
    out_code: int
    tiles: torch.Tensor
    numels: torch.Tensor
    addresses: torch.Tensor
    grads: list[torch.Tensor]
    """The gradients as read (a contiguous copy where one was not), kept alive until the launch is queued."""


def prepare(items: list[AdamWTensor]) -> list[AdamWLaunch]:
    """Check the items, group them by (gradient dtype, output dtype) and queue each group's addresses to its
    device: one AdamWLaunch a group."""
    groups: dict[tuple[int, int], list[AdamWTensor]] = {}
    for item in items:
        _check(item)
        key = (_GRAD_CODES[item.grad.dtype], _OUT_CODES[None if item.out is None else item.out.dtype])
        groups.setdefault(key, []).append(item)
    launches = []
    for (grad_code, out_code), group in groups.items():
        device = group[0].master.device
        tiles, numels = _tiles(tuple(item.master.numel() for item in group), device)
        grads = [item.grad if item.grad.is_contiguous() else item.grad.contiguous() for item in group]
        addresses = [ptr for item, grad in zip(group, grads) for ptr in (
            grad.data_ptr(), item.master.data_ptr(), item.exp_avg.data_ptr(), item.exp_avg_sq.data_ptr(),
            0 if item.out is None else item.out.data_ptr())]
        launches.append(AdamWLaunch(group, grad_code, out_code, tiles, numels,
                                    _to_device(addresses, torch.int64, device), grads))
    return launches


def launch(launches: list[AdamWLaunch], grad_coef: float) -> None:
    """Queue the prepared updates with the gradients times `grad_coef`, each item at its `hparams` and `step` as
    they are now."""
    from .kernels.adamw import adamw_kernel

    for prepared in launches:
        device = prepared.items[0].master.device
        rows: dict[tuple[int, int], list[float]] = {}  # one per param group and step count
        hparams: list[float] = []
        for item in prepared.items:
            key = (id(item.hparams), item.step)  # a group's items share one AdamWHparams: no hashing of its fields
            if key not in rows:
                rows[key] = item.hparams.row(item.step)
            hparams.extend(rows[key])
        # Triton launches on the current device: make it the tensors' one (a process may hold several GPUs).
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            adamw_kernel[(prepared.tiles.shape[0],)](
                prepared.tiles, prepared.addresses, prepared.numels, _to_device(hparams, torch.float32, device),
                float(grad_coef), GRAD=prepared.grad_code, OUT=prepared.out_code, BLOCK=BLOCK, num_warps=WARPS)


def adamw_step(items: list[AdamWTensor], grad_coef: float) -> None:
    """Update every item in place: the master, its moments and `out`, with the gradient times `grad_coef`.
    Items are grouped by (gradient dtype, output dtype); each group is one launch."""
    launch(prepare(items), grad_coef)


def warm_up(device: torch.device, pairs: set[tuple[torch.dtype, Optional[torch.dtype]]]) -> None:
    """Compile the kernel for each (gradient dtype, output dtype) on one-element tensors now, so that the first
    real step, which the placement times to plan from, does not carry Triton's compile time."""
    items = []
    for grad_dtype, out_dtype in pairs:
        zeros = [torch.zeros(1, device=device) for _ in range(3)]
        items.append(AdamWTensor(*zeros, torch.zeros(1, device=device, dtype=grad_dtype),
                                 None if out_dtype is None else torch.zeros(1, device=device, dtype=out_dtype),
                                 AdamWHparams(0.0, 0.9, 0.999, 1e-8, 0.0), 1))
    if items:
        adamw_step(items, 1.0)


def adamw_reference(items: list[AdamWTensor], grad_coef: float) -> None:
    """The same update with torch.optim.AdamW's single-tensor arithmetic (for tests)."""
    for item in items:
        hp = item.hparams
        grad = item.grad.float().reshape(item.master.shape) * grad_coef
        bias_correction1 = 1 - hp.beta1 ** item.step
        bias_correction2 = 1 - hp.beta2 ** item.step
        item.master.mul_(1 - hp.lr * hp.weight_decay)
        item.exp_avg.lerp_(grad, 1 - hp.beta1)
        item.exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)
        denom = (item.exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(hp.eps)
        item.master.addcdiv_(item.exp_avg, denom, value=-hp.lr / bias_correction1)
        if item.out is not None:
            item.out.copy_(item.master.reshape(item.out.shape))

