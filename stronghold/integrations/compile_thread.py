"""The blocks' compile off the training's critical path: the first training calls run eager while one thread compiles
the block (compile.py decides when; this module runs the compile).

Why: Inductor's first compile of a decoder block takes seconds (several on a fresh machine, where its on-disk caches
are cold), more than a whole training step, and a synchronous compile puts all of it into the first step. Eager
blocks train the same model at most a few tens of percent slower, so running eager until the compiled code is ready
costs a fraction of that.

What the thread compiles: the block's forward and backward, by calling the compiled function once on a shadow of the
block (`shadow`: the same module objects' settings, parameters and buffers that alias the block's tensors, never
copies, so it costs no memory) and on detached aliases of the first call's inputs, with AOTAutograd told to lower the
backward with the forward (`force_non_lazy_backward_lowering`): a lazily compiled backward would compile on
autograd's device thread, inside the training's own backward. The compile reads only shapes, strides and dtypes;
what the shadow's tensors hold while the window reuses their slots does not matter, and its outputs are dropped.
The call runs under the training call's thread-local state (grad mode, autocast, device), which Dynamo guards on,
so the training's later calls find the graph.

Blocks that draw random numbers in training (dropout) compile synchronously instead: the generator is global, and a
probe drawing from it on another thread would shift the training's draws by an amount that depends on timing.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import time
import types
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map_only


def draws_random(block: nn.Module) -> bool:
    """Whether a training forward of `block` draws from the random generator: a dropout module with p > 0, or a
    dropout probability kept as a number (HF attention's `attention_dropout`, `attn_pdrop` and the like)."""
    for module in block.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for name, value in vars(module).items():
            if "dropout" in name.lower() and isinstance(value, float) and value > 0:
                return True
    return False


def shadow(module: nn.Module) -> nn.Module:
    """A module that computes like `module`, with its own parameter objects aliasing `module`'s tensors (Dynamo lifts
    them into graph inputs and guards on their metadata only), its submodules shadowed in turn, and any forward bound
    to `module` (an installed instance forward) bound to the shadow. Everything else is shared, not copied."""
    new = copy.copy(module)
    new._parameters = {name: None if p is None else nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                       for name, p in module._parameters.items()}
    new._buffers = {name: None if b is None else b.detach() for name, b in module._buffers.items()}
    new._modules = {name: None if m is None else shadow(m) for name, m in module._modules.items()}
    for name, value in vars(module).items():
        if isinstance(value, types.MethodType) and value.__self__ is module:
            new.__dict__[name] = types.MethodType(value.__func__, new)
    return new


class _CallState:
    """The thread-local state of the training call that Dynamo guards on, to be entered on the compile thread."""

    def __init__(self, device: torch.device):
        self.device, self.grad = device, torch.is_grad_enabled()
        self.autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cuda", "cpu")
                         if torch.is_autocast_enabled(kind)]

    @contextlib.contextmanager
    def entered(self):
        with contextlib.ExitStack() as stack:
            if self.device.type == "cuda":
                stack.enter_context(torch.cuda.device(self.device))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype))
            yield


class CompileThread:
    """One thread that compiles, job after job (Dynamo compiles one frame at a time anyway). `submit` hands it a
    block call; `finished` says whether every job so far is done; `results` gives each job's seconds and error."""

    def __init__(self):
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._jobs: list[concurrent.futures.Future] = []

    def submit(self, compiled: Callable, block: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> None:
        state = _CallState(device)

        def detached(t: torch.Tensor) -> torch.Tensor:
            alias = t.detach()
            return alias.requires_grad_() if t.requires_grad and (t.is_floating_point() or t.is_complex()) else alias

        # Taken now, on the training's thread, while the block's tensors are the ones this call computes with.
        twin = shadow(block)
        args, kwargs = tree_map_only(torch.Tensor, detached, (args, kwargs))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stronghold-compile")
        self._jobs.append(self._pool.submit(_compile, compiled, twin, args, kwargs, state))

    @property
    def started(self) -> bool:
        return bool(self._jobs)

    def finished(self) -> bool:
        return all(job.done() for job in self._jobs)

    def wait(self) -> None:
        concurrent.futures.wait(self._jobs)

    def results(self) -> list[tuple[float, Optional[BaseException]]]:
        """(seconds, error or None) of each job, in order; only once `finished`."""
        return [job.result() for job in self._jobs]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _compile(compiled: Callable, block: nn.Module, args: tuple, kwargs: dict,
             state: _CallState) -> tuple[float, Optional[BaseException]]:
    start = time.perf_counter()
    try:
        with state.entered(), torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = compiled(block, *args, **kwargs)
            del out
    except Exception as err:  # whatever compiling raised: the caller falls back to eager
        return time.perf_counter() - start, err
    return time.perf_counter() - start, None
