"""Applying stronghold_ops' Triton kernels to a model, as the "kernels" key asks (at start-up, and again at the
first training forward when a long sequence turns them on: memory/long_context.py)."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from stronghold.config import Settings

logger = logging.getLogger(__name__)


FUSED_HEAD = "fused_linear_cross_entropy"


def kernels_to_apply(model, settings: Settings, long_context: bool = False,
                     large_logits: bool = False) -> Optional[list[str]]:
    """The stronghold_ops kinds the "kernels" key asks for on this model (None: every one that applies).
    "auto" (settings.kernels None) is the family's defaults, or all of the family's kernels for long sequences
    (activations offloaded by the config, or `long_context` decided at the first forward: long_context.py), where
    their memory savings count (stronghold_ops.default_kernels); with `large_logits` (decided there too) the
    family's fused linear + cross-entropy head besides, which never materialises the logits."""
    import stronghold_ops

    if settings.kernels is True:
        return None
    if settings.kernels is None:
        long_context = long_context or bool(settings.offload_activations)
        kinds = list(stronghold_ops.default_kernels(model, long_context=long_context))
        if large_logits and FUSED_HEAD not in kinds and FUSED_HEAD in stronghold_ops.default_kernels(model, True):
            kinds.append(FUSED_HEAD)
        return kinds
    return list(settings.kernels or [])


def apply_kernels(model, settings: Settings, long_context: bool = False, large_logits: bool = False) -> list[str]:
    """stronghold_ops' Triton kernels, on this model's instances only (parameters are unchanged); the kinds
    that patched something (a module already patched is left as it is)."""
    import stronghold_ops

    kinds = kernels_to_apply(model, settings, long_context, large_logits)
    rank0 = int(os.environ.get("RANK", "0")) == 0  # every rank applies the same kernels: one report
    if kinds == []:
        if rank0:
            logger.info("kernels: none for this model (\"kernels\": \"auto\" keeps those that won end to end)")
        return []
    report = stronghold_ops.apply(model, kernels=kinds)
    if rank0:
        logger.info(f"kernels:\n{report}")
    return sorted(report.patched)
