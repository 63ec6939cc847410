"""fp16 loss scaling: DeepSpeed's `"fp16"` keys as a typed config, and the update rule of the scale.

fp16 has 5 exponent bits: gradients of a loss of order 1 fall below its smallest subnormal (6e-8) and
become zero. So the loss is multiplied by a scale S before backward, the gradients come out S times
larger and keep their bits, and the optimizer multiplies them by 1/S again, folded into the one
coefficient each update already applies (the clip coefficient): exact, since dynamic scales are powers
of two. Too large an S makes a gradient overflow to inf: that step is skipped (no parameter changes)
and the dynamic scale goes down; after a run of clean steps it goes up again, so S stays about as
large as the gradients allow. A static scale (`"loss_scale": S > 0`) never changes, but a step whose
gradients overflow is skipped all the same.

The rule is DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py, the
scaler of its ZeRO optimizers), transcribed step for step so that a run moved from DeepSpeed sees the
same scales: its hysteresis, its window count (the first doubling comes after window + 1 clean steps,
the next ones every window steps) and its error when an overflow finds the scale already at the minimum.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from pydantic import ValidationError

logger = logging.getLogger(__name__)

SCALE_FACTOR = 2.0
"""DeepSpeed's fixed factor: the scale halves and doubles, so it stays a power of two."""
FP32_EXPONENTS = range(-126, 128)
"""Powers of two that are normal fp32 numbers, with normal inverses (the kernels multiply by 1/S in fp32)."""


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """The loss-scaling keys of ds.json's `"fp16"` section, with DeepSpeed's defaults."""

    loss_scale: float = 0.0
    """0 means dynamic loss scaling; a positive value is a static scale, used for every step."""

    initial_scale_power: int = 16
    """Dynamic scaling starts at 2^initial_scale_power."""

    loss_scale_window: int = 1000
    """Clean (overflow-free) steps after which the dynamic scale doubles."""

    hysteresis: int = 2
    """Overflows the dynamic scale absorbs before it halves (DeepSpeed's `delayed_shift`): with 2, an
    overflow first only uses up the hysteresis, and the scale halves from the second one on, until a
    doubling (or, with `consecutive_hysteresis`, any clean step) refills it."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every clean step, not only when the scale doubles."""

    min_loss_scale: float = 1.0
    """The dynamic scale never goes below this. An overflow at this scale with no hysteresis left stops
    training with an error, as DeepSpeed does: the gradients are not finite at any usable scale."""

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        return float(2 ** self.initial_scale_power) if self.dynamic else float(self.loss_scale)

    @classmethod
    def from_deepspeed(cls, fp16: Union[Mapping[str, Any], Any]) -> "LossScaleConfig":
        """From ds.json's `"fp16"` section (a dict) or DeepSpeed's parsed `DeepSpeedFP16Config`. DeepSpeed's
        own checks run first (its messages name the key), then those for values it accepts that would
        not train: each a ValueError that names the key and what is allowed."""
        from deepspeed.runtime.precision_config import DeepSpeedFP16Config

        if isinstance(fp16, Mapping):
            try:
                fp16 = DeepSpeedFP16Config(**fp16)
            except ValidationError as err:
                problems = [f"fp16.{'.'.join(str(p) for p in item['loc'])}: {item['msg']} (got {item.get('input')!r})"
                            if item["loc"] else item["msg"] for item in err.errors()]
                raise ValueError("invalid fp16 configuration:\n  " + "\n  ".join(problems)) from None
        if fp16.fp16_master_weights_and_grads:
            raise ValueError("fp16.fp16_master_weights_and_grads: stronghold always keeps fp32 master weights "
                             "(on the host for streamed blocks); remove this key or set it to false")
        config = cls(loss_scale=float(fp16.loss_scale), initial_scale_power=int(fp16.initial_scale_power),
                     loss_scale_window=int(fp16.loss_scale_window), hysteresis=int(fp16.hysteresis),
                     consecutive_hysteresis=bool(fp16.consecutive_hysteresis),
                     min_loss_scale=float(fp16.min_loss_scale))
        config._check()
        return config

    def _check(self) -> None:
        if not self.dynamic:
            if not 2.0 ** FP32_EXPONENTS[0] <= self.loss_scale < 2.0 ** (FP32_EXPONENTS[-1] + 1):
                raise ValueError(f"fp16.loss_scale: a static scale must be between 2^{FP32_EXPONENTS[0]} and "
                                 f"2^{FP32_EXPONENTS[-1] + 1} (got {self.loss_scale}), or 0 for dynamic scaling")
            return
        if self.initial_scale_power not in FP32_EXPONENTS:
            raise ValueError(f"fp16.initial_scale_power: must be in [{FP32_EXPONENTS[0]}, {FP32_EXPONENTS[-1]}] so "
                             f"that the scale and its inverse are fp32 numbers (got {self.initial_scale_power}); "
                             "DeepSpeed's default is 16")
        if self.hysteresis < 1:
            raise ValueError(f"fp16.hysteresis: must be at least 1 (got {self.hysteresis}); below that the scale "
                             "would never go down after an overflow, and every later step would be skipped")
        if self.min_loss_scale > self.initial_scale:
            raise ValueError(f"fp16.min_loss_scale: {self.min_loss_scale} is above the initial scale "
                             f"2^{self.initial_scale_power} (fp16.initial_scale_power); lower it or raise the power")


@dataclass
class LossScaler:
    """The current loss scale and DeepSpeed's `DynamicLossScaler` counters (named as there)."""

    config: LossScaleConfig
    cur_scale: float = field(init=False)
    cur_iter: int = 0
    """Optimizer steps seen, skipped ones included."""
    last_overflow_iter: int = -1
    cur_hysteresis: int = field(init=False)
    """Overflows left before the scale halves."""

    def __post_init__(self):
        self.cur_scale = self.config.initial_scale
        self.cur_hysteresis = self.config.hysteresis

    def update(self, overflow: bool) -> None:
        """After an optimizer step; `overflow`: its gradients were not finite (it was skipped)."""
        cfg = self.config
        if not cfg.dynamic:
            if overflow:
                logger.info(f"fp16 overflow; the static loss scale stays {self.cur_scale}")
            return
        if overflow:
            if cfg.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == cfg.min_loss_scale:
                    raise FloatingPointError(
                        f"stronghold: the fp16 gradients overflowed with the loss scale already at its minimum "
                        f"(fp16.min_loss_scale = {cfg.min_loss_scale}); they are not finite at any usable scale. "
                        "Look for inf/NaN in the data or the loss, lower the learning rate, or use bf16")
                before = self.cur_scale
                self.cur_scale = max(self.cur_scale / SCALE_FACTOR, cfg.min_loss_scale)
                logger.info(f"fp16 overflow; loss scale {before} -> {self.cur_scale}")
            else:
                self.cur_hysteresis -= 1
                logger.info(f"fp16 overflow at loss scale {self.cur_scale}; hysteresis left "
                            f"{self.cur_hysteresis}")
            self.last_overflow_iter = self.cur_iter
        else:
            if cfg.consecutive_hysteresis:
                self.cur_hysteresis = cfg.hysteresis
            stable_interval = self.cur_iter - self.last_overflow_iter - 1
            if stable_interval > 0 and stable_interval % cfg.loss_scale_window == 0:
                if not cfg.consecutive_hysteresis:
                    self.cur_hysteresis = cfg.hysteresis
                self.cur_scale *= SCALE_FACTOR
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume a dynamic scale where it was; a static scale is the config's, whatever was saved."""
        if not self.config.dynamic:
            return
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
