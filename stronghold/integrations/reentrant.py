"""Compiled blocks checkpointed reentrantly, so the checkpoint's first forward runs the compiled inference graph.

HF turns activation checkpointing on with torch's non-reentrant checkpoint (its default `use_reentrant=False`). There
the first forward runs the block's training graph with grad on: AOTAutograd's autograd Function around the compiled
graph, and one Python pack hook of the checkpoint for each tensor the graph saves, which the hook then drops. A
reentrant checkpoint runs that forward under no_grad: for a compiled block the inference graph, which saves nothing
and has no autograd wrapper; the recompute in backward runs the training graph as before. Where a step is bound by the
host launching the blocks' kernels (GPT-2 1.72 B under 32 GiB, docs/results.md) that forward is most of what is left
to gain. Both checkpoints recompute the same values from the same saved input, with the RNG state put back the same
way, so the gradients are the same. Dropout: the forward draws its masks in the inference graph and the recompute in
the training graph, from the same RNG state; Inductor's masks depend on the seed and the element only, not on how
the kernels are fused (GPT-2 1.72 B with dropout 0.1 gave the same losses to the last digit over 13 steps with either
checkpoint on an H200, docs/results.md), and eager ops draw them as eager does.

So while the blocks are compiled (compile.py), a block whose checkpoint function is HF's plain non-reentrant one
(`functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)`, optionally with `preserve_rng_state`) runs
it reentrantly, on the calls where that gives the same gradients: grad mode on and a tensor argument that requires grad
(with none, e.g. the first block over frozen embeddings without HF's input hook, a reentrant checkpoint computes no
parameter gradient), no keyword argument (which a reentrant checkpoint does not take), and a block class whose output is
a tensor or a tuple of tensors and Nones (the first call of each class runs the model's own checkpoint and shows it):
autograd carries the gradient through those only, so a block returning a dict or a ModelOutput would lose it. Every
other call, and every other checkpoint function (selective checkpointing's `context_fn`, HF's offloading wrapper, a
user's own), runs as the model set it up, and so does a checkpoint inside the compiled code: transformers 5.24
checkpoints the layer's `forward` rather than its `__call__`, so the compiled forward holds the checkpoint and Dynamo
compiles it (its own recompute in the compiled backward, no Python hooks). The function is replaced on the instance
(`_gradient_checkpointing_func`, which transformers' GradientCheckpointingLayer calls) at each training forward, since
HF may turn checkpointing on after stronghold is set up (Trainer does so in `train()`), and put back at detach. A
reentrant checkpoint does not support `torch.autograd.grad` over the model or `backward(inputs=...)`: training calls
`backward()` on the loss, as DeepSpeed's engine does.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

ATTRIBUTE = "_gradient_checkpointing_func"
PLAIN_KEYWORDS = {"use_reentrant", "preserve_rng_state"}


def _plain_non_reentrant(function: Any) -> bool:
    return (isinstance(function, functools.partial) and function.func is torch_checkpoint.checkpoint
            and not function.args and set(function.keywords) <= PLAIN_KEYWORDS
            and function.keywords.get("use_reentrant") is False)


def _tensors_only(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    return type(out) is tuple and all(item is None or isinstance(item, torch.Tensor) for item in out)


class ReentrantCheckpoints:
    """Installs the reentrant checkpoint on `blocks` where their own is HF's plain non-reentrant one."""

    def __init__(self, blocks: list[nn.Module]):
        self.blocks = blocks
        self._replaced: dict[int, tuple[Callable, Callable]] = {}
        """By id(block): its own checkpoint function and the one installed (to tell it from one HF put there since)."""
        self.reentrant_calls = 0
        self._tensor_outputs: dict[type, bool] = {}
        """Per block class, whether its output is one a reentrant checkpoint carries gradients through."""

    def ensure(self) -> None:
        """Before a training forward: replace the blocks' checkpoint functions that are HF's plain one (HF may have
        set them since the last call)."""
        for block in self.blocks:
            current = block.__dict__.get(ATTRIBUTE)
            replaced = self._replaced.get(id(block))
            if current is None or (replaced and current is replaced[1]) or not _plain_non_reentrant(current):
                continue
            installed = block.__dict__[ATTRIBUTE] = self._function(current, type(block))
            self._replaced[id(block)] = (current, installed)

    def detach(self) -> None:
        for block in self.blocks:
            own, installed = self._replaced.pop(id(block), (None, None))
            if installed is not None and block.__dict__.get(ATTRIBUTE) is installed:
                block.__dict__[ATTRIBUTE] = own

    def _function(self, own: functools.partial, kind: type) -> Callable:
        preserve = own.keywords.get("preserve_rng_state", True)

        def checkpoint(function, *args, **kwargs):
            eligible = (not torch.compiler.is_compiling() and not kwargs and torch.is_grad_enabled()
                        and any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args))
            if eligible and self._tensor_outputs.get(kind):
                self.reentrant_calls += 1
                return torch_checkpoint.checkpoint(function, *args, use_reentrant=True, preserve_rng_state=preserve)
            out = own(function, *args, **kwargs)
            if eligible and kind not in self._tensor_outputs:
                self._tensor_outputs[kind] = _tensors_only(out)
            return out

        return checkpoint
