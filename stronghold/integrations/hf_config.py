"""The DeepSpeed config the one-line Trainer integration (hf.py) builds, and the stronghold section it takes from
`stronghold.initialize(model, config=...)`.

Config (TrainingArguments are the source of truth):
- without `deepspeed=` in TrainingArguments the DeepSpeed config is derived: batch sizes, gradient
  accumulation, `max_grad_norm` and bf16 are set to "auto", which Trainer fills from its arguments;
  ZeRO stage 0. There is no "optimizer" or "scheduler" section, so the engine gets Trainer's own
  AdamW (`create_optimizer`: lr, betas, eps, weight decay and its decay groups) and Trainer steps its
  own scheduler (`create_scheduler`: every scheduler type, with warmup);
- with `deepspeed=ds.json` the same keys are added where the json lacks them; where it sets them, Trainer
  checks them against its arguments and a mismatch raises naming both values. Its "stronghold" section
  is used; keys also given to `prepare(config=...)` must agree. With an "optimizer" section the json's
  hyperparameters apply to Trainer's decay groups (no decay on biases and norm weights).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping, Optional

from stronghold.config import SECTION, StrongholdConfig, parse_stronghold_section, without_auto
from stronghold.deepspeed_keys import check_deepspeed_keys
from stronghold.engine.launch import load_config

# Filled by Trainer from TrainingArguments when "auto" (HfTrainerDeepSpeedConfig.trainer_config_process).
TRAINER_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                "gradient_clipping")


def section_of(config: Any) -> dict:
    """The stronghold keys from `config=`: a StrongholdConfig, a dict of section keys, or a ds.json
    (path or dict) that has nothing but a "stronghold" section."""
    if config is None:
        return {}
    if isinstance(config, StrongholdConfig):
        section = config.model_dump(exclude_unset=True)
    else:
        loaded = load_config(config) if isinstance(config, (str, Path)) else dict(config)
        if SECTION in loaded:
            others = sorted(set(loaded) - {SECTION})
            if others:
                raise ValueError(f"stronghold.initialize(model, config=...) takes the stronghold section only, but got "
                                 f"DeepSpeed keys {others}; pass those in TrainingArguments(deepspeed=...) (Trainer "
                                 "checks them against its own arguments)")
            loaded = loaded[SECTION]
        section = dict(loaded)
    parse_stronghold_section({SECTION: section})
    return without_auto(section)


def merge_sections(from_config: Any, from_prepare: Mapping) -> dict:
    parse_stronghold_section({SECTION: from_config})
    merged = without_auto(from_config or {})
    for key, value in from_prepare.items():
        if key in merged and merged[key] != value:
            raise ValueError(f"{SECTION}.{key}: the DeepSpeed config says {merged[key]!r} but stronghold.initialize("
                             f"config=...) says {value!r}; give it in one place")
        merged[key] = value
    return merged


def deepspeed_config(user: Optional[Mapping], section: Mapping) -> dict:
    """The DeepSpeed config a stronghold Trainer runs with: `user` (from TrainingArguments(deepspeed=), or
    None) completed with the keys Trainer fills from its arguments, ZeRO stage 0 and the merged section."""
    config = copy.deepcopy(dict(user or {}))
    for key in TRAINER_KEYS:
        config.setdefault(key, "auto")
    if isinstance(config.setdefault("bf16", {}), dict):
        config["bf16"].setdefault("enabled", "auto")
    config.setdefault("zero_optimization", {"stage": 0})
    config[SECTION] = merge_sections(config.get(SECTION), section)
    check_deepspeed_keys(config)
    return config
