"""The all-reduce of the resident part's gradients (resident blocks, embeddings, final norm, head), launched in the
boundary backward as the gradients complete, so that it runs under the rest of backward instead of after it.

Every rank holds the resident part whole and updates it on its GPU, so its gradients are all-reduced in place
(data_parallel.py says what is reduced where). Before, the whole resident part's reduction (every resident
block: a third of a model's gradients and more) started after backward and step() waited for all of it.

Order: collectives must pair up across ranks, so they are launched in one fixed order, that of the model's
parameters reversed (the order backward produces them: head, final norm, the last resident block first,
the embeddings last), each only once it and every parameter before it in that order have their gradient. A
parameter whose gradient comes out of that order holds the later ones back (less overlap, the same
collectives); what is still waiting at the end of backward is launched then, in the same order, as
DDP's buckets are. Every rank reaches the same parameters in backward (as data_parallel.py requires), so every
rank launches the same sequence.

Only where the reduction can be dropped if the backward fails: in a window of one micro-step (no
accumulation, or no parameter with gradients of earlier micro-steps) the reduction is of `param.grad`, which
a failed backward's `drop_micro_step` discards. With accumulation the reduction is of the fp32 accumulator,
which holds the earlier micro-steps' sum: reducing it before backward is over would leave a failed micro-step's
gradients in it, so such a window is reduced at the end of backward, as before (once per window: its cost is
spread over the window's micro-steps).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stronghold.distributed.data_parallel import DataParallel
from stronghold.optim.gpu_optim import ResidentOptimizer


class ResidentReductions:
    def __init__(self, data_parallel: DataParallel, resident: ResidentOptimizer, model: nn.Module):
        self.data_parallel = data_parallel
        self.resident = resident
        self.model = model
        self.order: list[nn.Parameter] = []
        """The resident trained parameters in launch order (the model's order reversed)."""
        self._handles: list[RemovableHandle] = []
        self._ready: set[int] = set()
        """id() of the parameters whose gradient of this backward is complete."""
        self._next = 0
        """Index into `order` of the first parameter not launched yet."""
        self._armed = False
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        """In-flight reductions: (work, buffer reduced, gradient it belongs to)."""

    def _attach(self) -> None:
        """Hook the resident parameters, in launch order; again after a promotion made more of them resident."""
        self.detach()
        trained = {id(p) for p in self.resident.params}
        self.order = [p for p in reversed(list(self.model.parameters())) if id(p) in trained]
        # By weak reference: a parameter's hooks live where the garbage collector cannot see a cycle through them
        # (streaming/hooks.py), and this object holds the model.
        arrived = weakref.WeakMethod(self._arrived)

        def hook(param: nn.Parameter) -> None:
            method = arrived()
            if method is not None:
                method(param)

        for param in self.order:
            self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def begin(self, boundary: bool) -> None:
        """A micro-step's backward begins: at the boundary of a window that holds no earlier micro-step's sum,
        launch the reductions as the gradients complete (see the module docstring)."""
        assert not self._pending, "the previous window's resident reductions were not finished"
        if len(self.order) != len(self.resident.params):
            self._attach()
        self._ready.clear()
        self._next = 0
        self._armed = boundary and not self.resident.accum

    def _arrived(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        self._ready.add(id(param))
        while self._next < len(self.order) and id(self.order[self._next]) in self._ready:
            self._launch(self.order[self._next])
            self._next += 1

    def _launch(self, param: nn.Parameter) -> None:
        grad = self.resident.window_grad(param)
        if grad is not None:
            self._pending.append((*self.data_parallel.start_all_reduce(grad), grad))

    def end_backward(self) -> None:
        """The boundary backward is over: launch what is left, in order (step() waits for all of it)."""
        self._armed = False
        for param in self.order[self._next:]:
            self._launch(param)
        self._next = len(self.order)

    def finish(self) -> None:
        """Wait for the reductions (in the current stream's order on a GPU) and apply the averaging's scale."""
        for work, buffer, grad in self._pending:
            self.data_parallel.finish_all_reduce(work, buffer, grad)
        self._pending = []

    def drop(self) -> None:
        """A backward failed: forget the reductions (their work objects keep the tensors alive)."""
        self._armed = False
        self._pending = []

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
