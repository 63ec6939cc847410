"""Long sequences: each block's MLP computed over the sequence in chunks, so one block's forward, recompute
and backward hold one chunk's MLP intermediates instead of the whole sequence's.

Why: with activation offload, what limits a long sequence is one block's peak during its backward. A Llama
2.7 B under a 32 GiB cap failed at seq 163840 allocating 2.11 GiB, one MLP intermediate (163840 x 6912 x 2
bytes), and the MLP holds several of those at once.

How (`ChunkedMLP`, an autograd Function): forward runs the MLP chunk by chunk without building a graph
and saves only its input; backward recomputes one chunk at a time and takes its gradients with
`torch.autograd.grad`, summing the parameters' gradients over the chunks in fp32. The parameters are
inputs of the Function, so each gets its gradient once per backward, like the unchunked MLP (the
engine's per-parameter gradient hooks count on that). The MLP is computed per token, so chunks give
the same result up to the rounding of the parameter-gradient sums.

The saved input goes through the engine's saved-tensor hooks like any other activation (offloaded when
activations are; recomputed by gradient checkpointing). An MLP with active dropout is left alone: its
recompute would draw different masks.

DeepSpeed's TiledMLP (sequence_parallel/ulysses_sp.py) does the same tiling but runs a nested
`backward` per tile, which accumulates each parameter's `.grad` once per tile: the engine's gradient
hooks would fire once per tile, so it cannot be used here.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional, Union

import torch
from torch import nn

from stronghold.integrations import forwards

logger = logging.getLogger(__name__)

AUTO_MIN_BYTES = 2 ** 30
"""Under "auto", an MLP call is chunked when one of its intermediates (tokens x width x element size)
exceeds 1 GiB: a sequence long enough that the MLP's peak matters (Llama h2560: from ~78k tokens)."""
AUTO_CHUNK_BYTES = 2 ** 28
"""Under "auto", chunks hold at most 256 MiB per intermediate: small beside the attention's own buffers
at those lengths, large enough that each chunk's matmuls stay efficient (~19k tokens at width 6912)."""
FORWARD = "_stronghold_mlp_forward"  # the instance's own forward before chunking, if it had one


def mlp_width(mlp: nn.Module) -> int:
    """The MLP's intermediate width: the larger dimension of its largest matrix (HF's Linear and GPT-2's
    Conv1D alike)."""
    return max((max(p.shape) for p in mlp.parameters() if p.dim() == 2), default=0)


def _has_active_dropout(mlp: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in mlp.modules())


class ChunkedMLP(torch.autograd.Function):
    """y = forward(x) computed over chunks of `chunk_rows` tokens; `params` are the MLP's trainable
    parameters, inputs here so that autograd hands each its summed gradient once."""

    @staticmethod
    def forward(ctx, forward, chunk_rows: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # The parameters are kept as objects, not saved tensors: a streamed block's parameters point at a
        # window slot, and the recompute must read wherever the block is loaded at backward time.
        ctx.forward, ctx.chunk_rows, ctx.params = forward, chunk_rows, params
        ctx.save_for_backward(x)
        pieces = x.reshape(-1, x.shape[-1]).split(chunk_rows)
        with torch.no_grad():
            # Each chunk's output straight into the result (its width is known from the first chunk): a
            # torch.cat would hold every chunk and the result at once, twice the output at these lengths.
            first = forward(pieces[0])
            out = first.new_empty((x.numel() // x.shape[-1], first.shape[-1]))
            out[:len(first)].copy_(first)
            start = len(first)
            del first
            for piece in pieces[1:]:
                out[start:start + len(piece)].copy_(forward(piece))
                start += len(piece)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        # fp32 sums: one bf16 rounding at the end, as the unchunked matmul's fp32 accumulation has.
        sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in wanted]
        rows = x.detach().reshape(-1, x.shape[-1])
        x_grad = torch.empty_like(rows) if want_x else None
        start = 0
        for piece, piece_grad in zip(rows.split(ctx.chunk_rows),
                                     grad_out.reshape(-1, grad_out.shape[-1]).split(ctx.chunk_rows)):
            piece = piece.detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.forward(piece)
                found = torch.autograd.grad(out, ([piece] if want_x else []) + wanted, piece_grad,
                                            allow_unused=True)
            if want_x:
                x_grad[start:start + piece.shape[0]].copy_(found[0])
                found = found[1:]
            for total, grad in zip(sums, found):
                if grad is not None:
                    total.add_(grad)
            start += piece.shape[0]
        done = iter(total.to(p.dtype) for total, p in zip(sums, wanted))
        param_grads = [next(done) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, None if x_grad is None else x_grad.view_as(x), *param_grads)


class MlpChunks:
    """Installs chunked MLP forwards on the blocks' `mlp` modules (instance attributes; detach restores).

    chunk_tokens: a number (chunk every call longer than that), or None for "auto" (AUTO_MIN_BYTES /
    AUTO_CHUNK_BYTES from the call's own size)."""

    def __init__(self, blocks: dict[int, nn.Module], chunk_tokens: Optional[int]):
        self.blocks, self.chunk_tokens = blocks, chunk_tokens
        self.installed: list[nn.Module] = []
        self.chunked_calls = 0

    def attach(self) -> None:
        missing = [index for index, block in self.blocks.items() if not isinstance(getattr(block, "mlp", None), nn.Module)]
        if missing:
            logger.warning(f"mlp_chunk_tokens: blocks {missing} have no `mlp` submodule; their MLPs "
                           f"run unchunked")
        for index, block in self.blocks.items():
            mlp = getattr(block, "mlp", None)
            if index not in missing and forwards.install(mlp, FORWARD, self._forward(mlp_width(mlp))):
                self.installed.append(mlp)

    def detach(self) -> None:
        for mlp in self.installed:
            forwards.restore(mlp, FORWARD)
        self.installed.clear()

    def rows_per_chunk(self, x: torch.Tensor, width: int) -> Optional[int]:
        """Tokens per chunk for this call, or None to run it unchunked."""
        rows = x.numel() // max(1, x.shape[-1])
        if self.chunk_tokens is not None:
            return self.chunk_tokens if rows > self.chunk_tokens else None
        per_row = max(1, width * x.element_size())
        if rows * per_row <= AUTO_MIN_BYTES:
            return None
        return max(1, AUTO_CHUNK_BYTES // per_row)

    def _forward(self, width: int):
        chunks = self

        def chunked(mlp, x, *args, **kwargs):
            # The forward underneath is looked up on `mlp` at each call, never captured: a deep copy of the
            # model (rebinding the instance's bound methods to the copy) must compute with its own weights. A partial,
            # not a bound method made here: Dynamo traces partials (inside a compiled block) but not `method(...)`.
            forward = mlp.__dict__.get(FORWARD) or functools.partial(type(mlp).forward, mlp)
            rows = chunks.rows_per_chunk(x, width) if not (args or kwargs) and x.dim() >= 2 else None
            if rows is None or _has_active_dropout(mlp):
                return forward(x, *args, **kwargs)
            return chunks._apply(mlp, forward, rows, x)

        return chunked

    @torch.compiler.disable
    def _apply(self, mlp: nn.Module, forward, rows: int, x: torch.Tensor) -> torch.Tensor:
        # Eager under a compiled block (integrations/compile.py): the Function's backward calls autograd.grad,
        # which Dynamo cannot trace, and each chunk's forward is small beside the compiled rest of the block.
        self.chunked_calls += 1
        params = [p for p in mlp.parameters() if p.requires_grad]
        return ChunkedMLP.apply(forward, rows, x, *params)


def chunk_tokens_of(setting: Union[None, bool, int], offloading: bool) -> Union[None, int, str]:
    """The resolved setting (config.resolve) as MlpChunks takes it: None (auto), a number, or "off" (nothing
    installed). None ("auto") chunks only runs that offload activations (the long-sequence runs) and is off
    otherwise."""
    if setting is False:
        return "off"
    if setting is None:
        return None if offloading else "off"
    return int(setting)
