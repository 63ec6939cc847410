"""AdamW on the GPU for everything that stays there: resident blocks, embeddings, final norm, head.

torch.optim.AdamW does the arithmetic (fused on CUDA). In bf16 mode the model's parameters are bf16
and this keeps fp32 master copies on the GPU, made from the model's original fp32 values; the bf16
gradients are upcast one chunk (about one block) at a time, so the transient fp32 gradient memory is
one block's worth rather than the whole resident model's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .optimizer import HPARAMS


@dataclass
class _Chunk:
    params: list[nn.Parameter]
    masters: list[torch.Tensor]
    """fp32 tensors the optimizer updates: the params themselves in fp32 mode, copies in bf16 mode."""
    optimizer: torch.optim.AdamW
    group_index: list[int]
    """The facade's param group index of each of this optimizer's groups."""


class ResidentOptimizer:
    def __init__(self, chunks: list[list[tuple[nn.Parameter, int]]], param_groups: list[dict],
                 master_values: dict[int, torch.Tensor], fused: bool):
        """`chunks`: lists of (parameter on the device, facade group index); `master_values`: id(param)
        -> the fp32 original (bf16 mode) — empty in fp32 mode, where the parameters are the masters."""
        self.param_groups = param_groups
        self.chunks: list[_Chunk] = []
        for chunk in chunks:
            if not chunk:
                continue
            by_group: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
            for param, group in chunk:
                master = master_values.get(id(param), param)
                by_group.setdefault(group, []).append((param, master))
            groups = sorted(by_group)
            optimizer = torch.optim.AdamW(
                [{"params": [m for _, m in by_group[g]], **self._hparams(g)} for g in groups],
                fused=fused or None, foreach=False if not fused else None)
            params = [p for g in groups for p, _ in by_group[g]]
            masters = [m for g in groups for _, m in by_group[g]]
            self.chunks.append(_Chunk(params, masters, optimizer, groups))

    def _hparams(self, index: int) -> dict:
        group = self.param_groups[index]
        return {key: group[key] for key in HPARAMS}

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.params]

    def grad_sq_sum(self) -> Optional[torch.Tensor]:
        """Sum of squared gradient entries (fp32, on the device; no synchronization)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return None
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).square().sum()

    @torch.no_grad()
    def step(self, clip_coef: float) -> None:
        for chunk in self.chunks:
            for opt_group, index in zip(chunk.optimizer.param_groups, chunk.group_index):
                opt_group.update(self._hparams(index))
            updated = []
            for param, master in zip(chunk.params, chunk.masters):
                if param.grad is None:
                    continue  # as torch: a parameter without a gradient is not updated
                if master is not param:
                    master.grad = param.grad.float()
                if clip_coef < 1.0:
                    master.grad.mul_(clip_coef)
                updated.append((param, master))
            if not updated:
                continue
            chunk.optimizer.step()
            for param, master in updated:
                if master is not param:
                    param.copy_(master)
                    master.grad = None
                param.grad = None

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
