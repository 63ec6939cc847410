"""The CPU AdamW kernel's interface (`AdamWKernel`) and its per-step scalars (`AdamWCoeffs`): what the native build
(cpu_adam.py) and the eager reference (cpu_adam_reference.py) both implement.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AdamWCoeffs:
    """The per-step scalars of AdamW, computed in double precision as torch.optim.AdamW does."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    def as_struct(self) -> "CCoeffs":
        bias_correction1 = 1 - self.beta1 ** self.step
        bias_correction2 = 1 - self.beta2 ** self.step
        return CCoeffs(1 - self.lr * self.weight_decay, 1 - self.beta1, self.beta2, 1 - self.beta2,
                        -(self.lr / bias_correction1), bias_correction2 ** 0.5, self.eps, float(self.step == 1))


class CCoeffs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float)
                for name in ("decay", "w1", "beta2", "omb2", "neg_step_size", "bc2_sqrt", "eps", "fresh")]


class AdamWKernel:
    """Interface of both implementations. All tensors are flat, contiguous and on the CPU; gradients are
    fp32, bf16 or fp16, and `out` (the working copy) is bf16, fp16 or None (fp32 mode)."""

    threads: int

    def kernel_seconds(self) -> Optional[float]:
        """Seconds spent inside the kernels so far, all calls of the process (None where not counted)."""
        return None

    def fault_in(self, t: torch.Tensor) -> bool:
        """Fault the tensor's pages in writable without changing them, safe beside a `step` writing the same
        tensor, and without the process-wide lock that madvise holds (csrc/adamw.c, sh_fault_in); False where this
        implementation cannot (the caller populates them by madvise instead)."""
        return False

    def step(self, p, m, v, g, out: Optional[torch.Tensor], coeffs: AdamWCoeffs, scale: float = 1.0) -> float:
        """AdamW update with gradient g * scale; writes p, rounded to out's dtype, into out; returns sum(g^2)
        of g as given (not scaled)."""
        raise NotImplementedError

    def preview(self, p, m, v, g, out: torch.Tensor, coeffs: AdamWCoeffs, scale: float = 1.0) -> None:
        """Write into `out` (bf16 or fp16) exactly what `step` with the same arguments would, leaving p, m and v as
        they are: the next forward's weights first, the fp32 state by a later `step`."""
        raise NotImplementedError

    def redo(self, p, m, v, g, out, spec: AdamWCoeffs, final: AdamWCoeffs, scale: float,
             spec_scale: float = 1.0) -> None:
        """Replace a step made by `step(..., spec, spec_scale)` with the step `final` and g * scale give."""
        raise NotImplementedError

    def undo(self, p, m, v, g, out, spec: AdamWCoeffs, spec_scale: float = 1.0) -> None:
        """Restore the state from before a step made by `step(..., spec, spec_scale)` (a skipped or aborted
        step)."""
        raise NotImplementedError

    def accumulate(self, acc: torch.Tensor, g: torch.Tensor, first: bool) -> float:
        """acc = (0 if first else acc) + g; returns sum(acc^2)."""
        raise NotImplementedError

    def accumulate2(self, acc: torch.Tensor, g: torch.Tensor, g2: torch.Tensor, first: bool) -> float:
        """acc = ((0 if first else acc) + g) + g2, rounded as two `accumulate` calls; returns sum(acc^2)."""
        self.accumulate(acc, g, first)
        return self.accumulate(acc, g2, False)

    def sum_squares(self, g: torch.Tensor) -> float:
        raise NotImplementedError

    def step_compact(self, hi, lo, m, v, g, coeffs: AdamWCoeffs, scale: float = 1.0) -> float:
        """`step` on a compact master in place: `merge_master`, `step` with the working copy as `out`, `split_master`,
        in one pass."""
        master = torch.empty(hi.numel(), dtype=torch.float32)
        self.merge_master(hi, lo, master)
        sq = self.step(master, m, v, g, hi, coeffs, scale)
        self.split_master(master, hi, lo)
        return sq

    def step_compact_master(self, hi, lo, m, v, g, coeffs: AdamWCoeffs, scale: float = 1.0) -> None:
        """The halves `step_compact` with the same arguments writes, m and v left as they are: the first pass of a
        compact master's update weights first (its working copy is the master's high half, so no preview can write
        the weights alone); `moments` makes the step."""
        self.step_compact(hi, lo, m.clone(), v.clone(), g, coeffs, scale)

    def moments(self, m, v, g, coeffs: AdamWCoeffs, scale: float = 1.0) -> float:
        """m and v as `step` with the same arguments writes them, no parameter touched; returns sum(g^2) of g as
        given."""
        return self.step(torch.zeros_like(m), m, v, g, None, coeffs, scale)

    def merge_master(self, hi: torch.Tensor, lo: torch.Tensor, master: torch.Tensor) -> None:
        """master = the fp32 value a compact master holds as its bf16 rounding `hi` and low half `lo` (int16)."""
        raise NotImplementedError

    def split_master(self, master: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
        """hi = master rounded to bf16 (nearest even), lo = its low half; an exact tie is moved one ulp towards hi
        (csrc/adamw.c, compact_store), so that `merge_master` gives the master back."""
        raise NotImplementedError
