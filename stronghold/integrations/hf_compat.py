"""What differs between the transformers releases stronghold supports (5.17 to 5.24, requirements*.txt), in one place.

- Activation checkpointing: transformers 5.24 added `activation_checkpointing_enable` and `is_activation_checkpointing`
  and deprecated `gradient_checkpointing_enable` and `is_gradient_checkpointing` (FutureWarnings; removal announced
  for v6). The per-module flag (`gradient_checkpointing`) and checkpoint function are unchanged.
- The attention's KV cache argument (`past_key_values`, `cache` from 5.24): stronghold_ops.hf_forwards handles it,
  since stronghold_ops does not depend on stronghold.
"""
from __future__ import annotations

from typing import Any

from torch import nn


def enable_checkpointing(model: nn.Module, **checkpoint_kwargs: Any) -> None:
    """Turn on HF activation checkpointing in `model`, through whichever method its transformers release names;
    `checkpoint_kwargs` go to torch.utils.checkpoint (e.g. use_reentrant=False)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs or None)


def is_checkpointing(model: nn.Module) -> bool:
    """Whether HF activation checkpointing is on in `model` (False for a model that has no such switch)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))
