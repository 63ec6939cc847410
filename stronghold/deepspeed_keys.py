"""The DeepSpeed config's own keys, checked before anything is built: the settings stronghold does not implement are
rejected naming the fix, and a top-level key that looks like a misspelt `"stronghold"` is warned about (DeepSpeed
ignores unknown top-level keys, so that section's settings would be dropped unchecked).
"""
from __future__ import annotations

import difflib
import logging
from typing import Any, Mapping

from stronghold.config import SECTION
from stronghold.optim.loss_scale import LossScaleConfig

logger = logging.getLogger(__name__)

NEAR_SECTION = 0.8
"""difflib similarity (lower case) above which a top-level key is taken for a misspelt "stronghold"."""


def warn_near_section(ds_config: Mapping[str, Any]) -> None:
    """Warn about a top-level key that looks like a misspelt "stronghold" (DeepSpeed ignores unknown top-level
    keys, so the section's settings would be dropped unchecked)."""
    for key in ds_config:
        if key != SECTION and isinstance(key, str) and difflib.get_close_matches(key.lower(), [SECTION], 1,
                                                                                  NEAR_SECTION):
            logger.warning(f"the DeepSpeed config's top-level key {key!r} is read by neither DeepSpeed nor "
                           f"stronghold: did you mean {SECTION!r}? Its settings are ignored until it is renamed")


def _enabled(section: Mapping[str, Any]) -> bool:
    return section.get("enabled", False) in (True, "true")


def check_deepspeed_keys(ds_config: Mapping[str, Any]) -> None:
    """Reject DeepSpeed settings the engine does not implement, before anything is built."""
    fp16 = ds_config.get("fp16", {}) or {}
    if _enabled(fp16):
        bf16_key = "bf16" if "bf16" in ds_config else "bfloat16"  # DeepSpeed still reads the old name
        if _enabled(ds_config.get(bf16_key, {}) or {}):
            raise ValueError(f"fp16.enabled and {bf16_key}.enabled are both true; pick one precision (bf16 needs "
                             "no loss scaling, fp16 uses the fp16 section's loss scaling)")
        LossScaleConfig.from_deepspeed(fp16)
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (0, "auto"):
        raise ValueError(f"zero_optimization.stage: stronghold replaces ZeRO's partitioning and offload, so the "
                         f"stage must be 0 (got {stage!r}); keep the section as {{\"stage\": 0}} or remove it")
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key):
            raise ValueError(f"zero_optimization.{key}: stronghold does its own offload; remove this key")
    optimizer = ds_config.get("optimizer")
    if optimizer is not None:
        name = str(optimizer.get("type", "")).lower()
        if name not in ("adam", "adamw"):
            raise ValueError(f"optimizer.type: stronghold implements AdamW only (got {optimizer.get('type')!r}); "
                             "use \"AdamW\" (or \"Adam\", which DeepSpeed runs in AdamW mode)")
    if ds_config.get("torch_autocast", {}).get("enabled", False):
        raise ValueError("torch_autocast: not supported with stronghold; bf16 and fp16 run the model in that dtype "
                         "with fp32 master weights, so remove the torch_autocast section")
