"""AdamW on the GPU for everything that stays there: resident blocks, embeddings, final norm, head.

torch.optim.AdamW does the arithmetic (fused on CUDA). In bf16 and fp16 mode the model's parameters
are bf16/fp16 and this keeps fp32 master copies on the GPU, made from the model's original fp32 values;
the gradients are upcast one chunk (about one block) at a time, so the transient fp32 gradient memory
is one block's worth rather than the whole resident model's. The upcast gradients are multiplied by one
coefficient before the update: the clip coefficient, and with fp16 the loss scale's inverse.

On a CUDA GPU with Triton the update is `stronghold_ops.adamw` instead: the same AdamW in one launch for
every parameter, reading each gradient once in its own dtype and writing the bf16 / fp16 copy beside the
master, where torch's path makes an fp32 copy of each gradient, scales it, updates and casts back (four
passes over memory and three launches a parameter). The states stay in torch's AdamW objects, so saving,
loading and promotion see one format either way. Its arithmetic is torch's single-tensor AdamW (1 - beta taken
in double); torch's fused CUDA kernel takes it in fp32, which moves exp_avg_sq by about 1e-5 relative.
Measured on GPT-2 1.72 B's parameters (H100): 24.7 ms a step against 35.5 ms (results/kernels/kernels.jsonl).
The launch's host work (a few microseconds a parameter: checks, addresses, states) is done by `prepare_update`
before the engine's one sync on the global norm, where the GPU still has the backward queued; after the sync
only the launch is left, so the GPU does not wait for the host's loop over hundreds of parameters.

With gradient accumulation each micro-step's gradients are added into an fp32 accumulator and the
parameters' `.grad` is cleared (the streamed blocks accumulate in fp32 on the host too): bf16 sums
over many micro-steps would lose the low bits, and a micro-step whose backward fails can then be
dropped by clearing `.grad`, leaving the earlier micro-steps' sum intact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from stronghold.planning.block_timer import record_event
from stronghold.engine.optimizer import HPARAMS
from stronghold_ops._runtime import unavailable_reason
from stronghold_ops.adamw import AdamWHparams, AdamWLaunch, AdamWTensor, launch, prepare, warm_up


@dataclass
class _Chunk:
    params: list[nn.Parameter]
    masters: list[torch.Tensor]
    """fp32 tensors the optimizer updates: the params themselves in fp32 mode, copies in bf16/fp16 mode."""
    optimizer: torch.optim.AdamW
    group_index: list[int]
    """The facade's param group index of each of this optimizer's groups."""
    param_of: dict[int, nn.Parameter]
    """id(master) -> the parameter it is the master of."""


@dataclass
class _Update:
    """The kernel path's update gathered before the clip coefficient is known (`prepare_update`)."""

    entries: list[tuple[nn.Parameter, torch.Tensor, torch.optim.AdamW, torch.Tensor]]
    """(parameter, master, the AdamW holding its state, its state["step"] tensor) of each item, in the items'
    order."""
    groups: list[tuple[dict, int, list[AdamWTensor]]]
    """(the optimizer's param group, the facade's group index, that group's items): hyperparameters are read
    again at the launch, as torch reads them at step()."""
    fresh: dict[int, tuple[torch.optim.AdamW, torch.Tensor, dict]]
    """id(master) -> (its AdamW, the master, the zero state made for its first update): put into the AdamW's state at
    the launch only, so a step skipped after the gather leaves no state behind (as torch's AdamW, whose state starts at
    the update)."""
    launches: list[AdamWLaunch]

    @property
    def items(self) -> list[AdamWTensor]:
        return [item for _, _, group_items in self.groups for item in group_items]


class ResidentOptimizer:
    def __init__(self, chunks: list[list[tuple[nn.Parameter, int]]], param_groups: list[dict],
                 master_values: dict[int, torch.Tensor], fused: bool, accumulate: bool = False):
        """`chunks`: lists of (parameter on the device, facade group index); `master_values`: id(param)
        -> the fp32 original (bf16/fp16 mode) — empty in fp32 mode, where the parameters are the masters."""
        self.param_groups = param_groups
        self.accumulate = accumulate
        self.accum: dict[int, torch.Tensor] = {}
        """id(param) -> fp32 sum of its gradients over this window's earlier micro-steps."""
        self.fused = fused
        self.kernel = fused and unavailable_reason() is None
        """The update through stronghold_ops.adamw (a CUDA GPU with Triton); torch's AdamW otherwise."""
        self._steps: dict[int, tuple[torch.Tensor, int]] = {}
        """id(master) -> (its state["step"] tensor, that tensor's value): the step count on the host, read
        from the device once per state tensor (a load or promotion puts new ones in)."""
        self._update: Optional[_Update] = None
        """The next step()'s update as `prepare_update` gathered it (kernel path), while it is still current."""
        self.timings: Optional[list[tuple]] = None
        """While the placement times steps (placement.py): (start event, end event, parameters updated) per step()."""
        self.chunks: list[_Chunk] = []
        for chunk in chunks:
            self.add_chunk(chunk, master_values)
        if self.kernel and self.chunks:
            # The placement plans from the first step's update time: Triton's compile must not be in it.
            param = self.chunks[0].params[0]
            out = None if param is self.chunks[0].masters[0] else param.dtype
            warm_up(param.device, {(param.dtype if out else torch.float32, out)} | (
                {(torch.float32, out)} if accumulate else set()))

    def time_steps(self, on: bool) -> None:
        """Record each step()'s events in `timings` from now on (cleared), or stop recording."""
        self.timings = [] if on else None

    def add_chunk(self, chunk: list[tuple[nn.Parameter, int]], master_values: dict[int, torch.Tensor]) -> None:
        """One more group of parameters with its own AdamW (a resident block; also a block promoted
        from streamed after the first step, runtime.promote)."""
        if not chunk:
            return
        by_group: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for param, group in chunk:
            master = master_values.get(id(param), param)
            by_group.setdefault(group, []).append((param, master))
        groups = sorted(by_group)
        optimizer = torch.optim.AdamW(
            [{"params": [m for _, m in by_group[g]], **self._hparams(g)} for g in groups],
            fused=self.fused or None, foreach=False if not self.fused else None)
        params = [p for g in groups for p, _ in by_group[g]]
        masters = [m for g in groups for _, m in by_group[g]]
        self.chunks.append(_Chunk(params, masters, optimizer, groups, {id(m): p for p, m in zip(params, masters)}))

    def _hparams(self, index: int) -> dict:
        group = self.param_groups[index]
        return {key: group[key] for key in HPARAMS}

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.params]

    def end_micro_step(self) -> None:
        """After a non-boundary backward: move this micro-step's gradients into the fp32 accumulators."""
        if not self.accumulate:
            return
        with torch.no_grad():
            for param in self.params:
                if param.grad is None:
                    continue
                acc = self.accum.get(id(param))
                if acc is None:
                    self.accum[id(param)] = param.grad.float()
                else:
                    acc.add_(param.grad)
                param.grad = None

    def add_sums(self, sums: dict[int, torch.Tensor]) -> None:
        """fp32 gradient sums of a whole window, by id(param), into the accumulators (the blockwise backward's walk,
        engine/blockwise_walk.py, once it has finished)."""
        for key, total in sums.items():
            acc = self.accum.get(key)
            if acc is None:
                self.accum[key] = total
            else:
                acc.add_(total)

    def window_grad(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """The window's whole gradient of a parameter: accumulator plus the boundary micro-step's."""
        acc = self.accum.get(id(param))
        if acc is None:
            return param.grad
        if param.grad is not None:
            acc.add_(param.grad)
            param.grad = None
        return acc

    def window_grads(self) -> list[torch.Tensor]:
        """The accumulation window's gradients (of the parameters that have one), to reduce in place."""
        return [g for g in (self.window_grad(p) for p in self.params) if g is not None]

    def grad_sq_sum(self) -> Optional[torch.Tensor]:
        """Sum of squared gradient entries (fp32, on the device; no synchronization)."""
        grads = self.window_grads()
        if not grads:
            return None
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).square().sum()

    @torch.no_grad()
    def prepare_update(self) -> None:
        """Gather the kernel path's update (every parameter's tensors, checked, their addresses queued to the GPU)
        before the clip coefficient is known. The engine calls this before the host sync that reads the global
        norm: the host work then runs while the GPU finishes the backward, and step() only launches. The first
        update's states are made here too (zeros, held by the update until its launch)."""
        self._update = None  # a gathered update's fresh states are dropped before new ones are made
        self._update = self._gather() if self.kernel else None

    @torch.no_grad()
    def step(self, grad_coef: float) -> None:
        """AdamW on every parameter that has a gradient, with the gradient times `grad_coef` (the clip
        coefficient over the loss scale)."""
        start = record_event() if self.timings is not None else None
        update, self._update = self._update, None
        numel = None
        if self.kernel:
            if update is None or not self._current(update):
                update = None  # its fresh states, if any, go before the new gather makes others
                update = self._gather()
            numel = None if update is None else self._launch(update, grad_coef)
        if numel is None:
            numel = self._torch_step(grad_coef)
            self._steps.clear()  # torch counted the steps in place: the host copies are behind
        self.accum.clear()
        if start is not None:
            self.timings.append((start, record_event(), numel))

    def _torch_step(self, grad_coef: float) -> int:
        numel = 0
        for chunk in self.chunks:
            for opt_group, index in zip(chunk.optimizer.param_groups, chunk.group_index):
                opt_group.update(self._hparams(index))
            updated = []
            for param, master in zip(chunk.params, chunk.masters):
                grad = self.window_grad(param)
                if grad is None:
                    continue  # as torch: a parameter without a gradient is not updated
                # fp32 gradients (an accumulator, or fp32 mode) are used as they are; bf16/fp16 ones upcast.
                master.grad = grad if grad.dtype == torch.float32 else grad.float()
                if grad_coef != 1.0:
                    master.grad.mul_(grad_coef)
                updated.append((param, master))
                numel += master.numel()
            if not updated:
                continue
            chunk.optimizer.step()
            for param, master in updated:
                if master is not param:
                    param.copy_(master)
                master.grad = None
                param.grad = None
        return numel

    def _gather(self) -> Optional[_Update]:
        """The update through stronghold_ops.adamw, gathered; None where a master or parameter is not contiguous,
        which the kernel's flat indexing needs (torch's path takes any layout). A parameter without state gets a
        zero one held by the update (`_Update.fresh`), which the launch puts in place."""
        entries, groups, items, fresh = [], [], [], {}
        for chunk in self.chunks:
            for opt_group, index in zip(chunk.optimizer.param_groups, chunk.group_index):
                group_items: list[AdamWTensor] = []
                hparams = self._kernel_hparams(opt_group, index)
                for master in opt_group["params"]:
                    param = chunk.param_of[id(master)]
                    if not (master.is_contiguous() and param.is_contiguous()):
                        return None
                    grad = self.window_grad(param)
                    if grad is None:
                        continue  # as torch: a parameter without a gradient is not updated
                    state = chunk.optimizer.state.get(master)  # (a lookup that leaves no empty state behind)
                    if not state:  # as torch's fused AdamW starts a parameter's state
                        state = {"step": torch.zeros((), dtype=torch.float32, device=master.device),
                                 "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format)}
                        fresh[id(master)] = (chunk.optimizer, master, state)
                        self._steps[id(master)] = (state["step"], 0)  # known: no read of the device's zero
                    entries.append((param, master, chunk.optimizer, state["step"]))
                    group_items.append(AdamWTensor(master, state["exp_avg"], state["exp_avg_sq"], grad,
                                                   None if master is param else param.data, hparams, 0))
                groups.append((opt_group, index, group_items))
                items.extend(group_items)
        for item, count in zip(items, self._host_steps([(master, step) for _, master, _, step in entries])):
            item.step = count + 1
        return _Update(entries, groups, fresh, prepare(items))

    def _kernel_hparams(self, opt_group: dict, index: int) -> AdamWHparams:
        opt_group.update(self._hparams(index))
        beta1, beta2 = opt_group["betas"]
        return AdamWHparams(float(opt_group["lr"]), float(beta1), float(beta2), float(opt_group["eps"]),
                            float(opt_group["weight_decay"]))

    def _current(self, update: _Update) -> bool:
        """Whether a gathered update still reads each parameter's whole gradient and its states (a backward, an
        accumulation or a state load since then makes it stale)."""
        with_grad = sum(1 for p in self.params if p.grad is not None or id(p) in self.accum)
        if with_grad != len(update.entries):
            return False
        for (param, master, optimizer, step), item in zip(update.entries, update.items):
            acc = self.accum.get(id(param))
            grad = param.grad if acc is None else (acc if param.grad is None else None)
            state = optimizer.state.get(master) or update.fresh.get(id(master), (None, None, {}))[2]
            if grad is not item.grad or state.get("step") is not step or state.get("exp_avg") is not item.exp_avg:
                return False
        return True

    def _launch(self, update: _Update, grad_coef: float) -> int:
        items = update.items
        if not items:
            return 0
        for opt_group, index, group_items in update.groups:
            hparams = self._kernel_hparams(opt_group, index)
            for item in group_items:
                item.hparams = hparams
        for optimizer, master, state in update.fresh.values():
            optimizer.state[master] = state
        launch(update.launches, grad_coef)
        torch._foreach_add_([step for _, _, _, step in update.entries], 1.0)
        for (param, master, _, step), item in zip(update.entries, items):
            self._steps[id(master)] = (step, item.step)
            param.grad = None
        return sum(item.master.numel() for item in items)

    def _host_steps(self, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        """Each master's step count: the host copy while its state tensor is the one it was read from, else
        read once for all of them (a load or a promotion put new state tensors in)."""
        values: list[int] = []
        stale: list[int] = []
        for i, (master, step) in enumerate(steps):
            known = self._steps.get(id(master))
            if known is None or known[0] is not step:
                stale.append(i)
            values.append(0 if known is None else known[1])
        if stale:
            read = torch.stack([steps[i][1].detach().to(torch.float32) for i in stale]).tolist()
            for i, value in zip(stale, read):
                values[i] = int(value)
        return values

    def zero_grad(self) -> None:
        """Drop every gradient, accumulated or not (a skipped step, or a new window)."""
        for param in self.params:
            param.grad = None
        self.accum.clear()
        self._update = None

    def drop_micro_step(self) -> None:
        """Forget the gradients of a micro-step whose backward failed; earlier micro-steps stay."""
        for param in self.params:
            param.grad = None
        self._update = None


def place_resident(model: nn.Module, streamed_ids: set[int], device: torch.device,
                   compute_dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Move every parameter not in `streamed_ids` (and every buffer) to the device in the compute dtype;
    return the fp32 masters of the trained ones (bf16 / fp16), by id(param)."""
    masters: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        if id(param) in streamed_ids:
            continue
        if param.is_floating_point() and compute_dtype != torch.float32 and param.requires_grad:
            # An fp32 master for every trained parameter, whatever dtype the model was loaded in
            # (as DeepSpeed's bf16 and fp16 optimizers): made from the original values before the cast.
            master = param.data.to(device, torch.float32, copy=True)
            masters[id(param)] = master
            param.data = master.to(compute_dtype)
        elif param.is_floating_point():
            param.data = param.data.to(device, compute_dtype)
        else:
            param.data = param.data.to(device)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return masters
