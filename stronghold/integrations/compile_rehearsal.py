"""A rehearsal of the blocks' first compile: a block in miniature compiled on the set-up thread (compiler_setup.py).

The first compile in a process pays twice: for its own graph, and once for the process, as Dynamo, AOTAutograd and
Inductor build their tables, import their lazy parts, start Inductor's cache (on a cold one, its compile workers too)
and load Triton's driver on first use. Only its own graph depends on the model. So the set-up thread compiles a
small block of the same kinds of ops (an RMS norm, bias-free projections, causal attention, a gated MLP; a few KiB of
tensors) the way a checkpointed block is compiled: its training graph, forward and backward, with grad on, and its
inference graph under no_grad (compile.py, reentrant.py). The blocks' first compiled call waits for the thread, and is
left its own graphs.

What the rehearsal leaves as it found: the random streams (its tensors are made by linspace, never drawn), the
model (it compiles a module of its own) and the blocks' compile report (the thread is done before the first compiled
call counts graphs).

The main thread goes on meanwhile. Dynamo's frame callback, the dispatch modes and the tracing context are per thread.
While AOTAutograd traces a graph on a cache miss, torch.fx patches nn.Module's `__call__` and `__getattr__` for the
whole process, with wrappers that call the originals for a call that carries no traced value: a module that the main
thread calls in that time runs as it would; a training call waits for the thread first (compile.training_call). The
engine's CPU probe waits for it too (compiler_setup.py): it has the cores to itself.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.nn import functional as F

WIDTH, HEADS, TOKENS = 64, 2, 16
"""The miniature's size: large enough for the attention kernels' shape rules (a head of 32), small enough to cost
nothing on any device."""


class MiniatureBlock(nn.Module):
    """A pre-norm decoder block of the kinds of ops a Llama or GPT-2 block runs; weights made by linspace."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.norm = nn.Parameter(_values((WIDTH,), device, dtype))
        self.qkv = _linear(WIDTH, 3 * WIDTH, device, dtype)
        self.out = _linear(WIDTH, WIDTH, device, dtype)
        self.up = _linear(WIDTH, 4 * WIDTH, device, dtype)
        self.down = _linear(2 * WIDTH, WIDTH, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        heads = self.qkv(x * scale * self.norm).view(batch, tokens, 3, HEADS, width // HEADS).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, tokens, width))
        gate, up = self.up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _values(shape: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, math.prod(shape), device=device, dtype=torch.float32).reshape(shape).to(dtype)


def _linear(inputs: int, outputs: int, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    layer = nn.Linear(inputs, outputs, bias=False, device="meta")  # on meta: nn.Linear's own init draws from the RNG
    layer.weight = nn.Parameter(_values((outputs, inputs), device, dtype) / inputs)
    return layer


def rehearse(device: torch.device, backend: Union[str, Callable] = "inductor", options: Optional[dict] = None,
             dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile and run the miniature as a checkpointed block is compiled: with grad on (forward and backward), then
    under no_grad. Raises what the compile raises; the caller reports it."""
    block = MiniatureBlock(device, dtype)
    compiled = torch.compile(type(block).forward, backend=backend, options=options)
    x = _values((1, TOKENS, WIDTH), device, dtype).requires_grad_()
    with torch.enable_grad():
        out = compiled(block, x)
        torch.autograd.grad(out, [x, *block.parameters()], torch.ones_like(out))
    with torch.no_grad():
        compiled(block, x.detach())
