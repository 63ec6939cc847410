"""The eager reference of the CPU AdamW kernel (adamw_kernel.AdamWKernel), with torch.optim.AdamW's single-tensor
arithmetic: the tests' reference, and the kernel where no C compiler builds the native one (cpu_adam.load_kernel).
"""
from __future__ import annotations

import torch

from stronghold.optim.adamw_kernel import AdamWCoeffs, AdamWKernel


class TorchAdamW(AdamWKernel):
    """Eager reference with torch.optim.AdamW's single-tensor arithmetic (used where no C compiler is)."""

    def __init__(self, threads: int):
        self.threads = threads

    @staticmethod
    def _adamw(p, m, v, g, c: AdamWCoeffs):
        bias_correction2_sqrt = (1 - c.beta2 ** c.step) ** 0.5
        step_size = c.lr / (1 - c.beta1 ** c.step)
        p.mul_(1 - c.lr * c.weight_decay)
        m.lerp_(g, 1 - c.beta1)
        v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
        p.addcdiv_(m, (v.sqrt() / bias_correction2_sqrt).add_(c.eps), value=-step_size)

    def step(self, p, m, v, g, out, coeffs, scale=1.0):
        g32 = g.float()
        sq = float(g32.double().square().sum())
        self._adamw(p, m, v, g32 * scale if scale != 1.0 else g32, coeffs)
        if out is not None:
            out.copy_(p)
        return sq

    def preview(self, p, m, v, g, out, coeffs, scale=1.0):
        p, m, v = p.clone(), m.clone(), v.clone()  # the reference's way to leave the state alone: a copy
        self.step(p, m, v, g, out, coeffs, scale)

    @staticmethod
    def _invert(p, m, v, g32, spec: AdamWCoeffs) -> None:
        s = spec.as_struct()
        upd = m / (v.sqrt() / s.bc2_sqrt + s.eps)
        p.sub_(s.neg_step_size * upd).div_(s.decay)
        if spec.step == 1:  # the first step started from m = v = 0 exactly
            m.zero_()
            v.zero_()
            return
        m.sub_(s.w1 * g32).div_(1.0 - s.w1)
        v.sub_(s.omb2 * g32 * g32).div_(s.beta2).clamp_(min=0.0)

    def redo(self, p, m, v, g, out, spec, final, scale, spec_scale=1.0):
        g32 = g.float()
        self._invert(p, m, v, g32 * spec_scale, spec)
        self._adamw(p, m, v, g32 * scale, final)
        if out is not None:
            out.copy_(p)

    def undo(self, p, m, v, g, out, spec, spec_scale=1.0):
        self._invert(p, m, v, g.float() * spec_scale, spec)
        if out is not None:
            out.copy_(p)

    def accumulate(self, acc, g, first):
        if first:
            acc.copy_(g)
        else:
            acc.add_(g)
        return float(acc.double().square().sum())

    def sum_squares(self, g):
        return float(g.double().square().sum())

    # The halves in int64, a chunk at a time: int32 would overflow on shifts, and a block at once would hold
    # several times its size in temporaries.
    _CHUNK = 1 << 20

    def merge_master(self, hi, lo, master):
        for start in range(0, master.numel(), self._CHUNK):
            s = slice(start, start + self._CHUNK)
            high = hi[s].view(torch.int16).to(torch.int64) & 0xFFFF
            low = lo[s].to(torch.int64) & 0xFFFF
            bits = (((high - (low > 0x8000).to(torch.int64)) & 0xFFFF) << 16) | low
            master[s].view(torch.int32).copy_(torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits))

    def split_master(self, master, hi, lo):
        for start in range(0, master.numel(), self._CHUNK):
            s = slice(start, start + self._CHUNK)
            bits = master[s].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            low, odd = bits & 0xFFFF, (bits >> 16) & 1
            low = torch.where(low == 0x8000, torch.where(odd == 1, 0x8001, 0x7FFF), low)
            hi[s].copy_(master[s])
            lo[s].copy_(torch.where(low >= 0x8000, low - 0x10000, low))
