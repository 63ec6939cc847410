"""fp16 loss scaling (stronghold/optim/loss_scale.py): DeepSpeed's update rule, checked against DeepSpeed's own
`DynamicLossScaler`, and the checks of the `"fp16"` section. The engine with fp16: test_fp16.py."""
import random
import re
from pathlib import Path

import pytest
import torch

import stronghold
from stronghold.deepspeed_keys import check_deepspeed_keys
from stronghold.optim.loss_scale import LossScaleConfig, LossScaler

from .helpers import ds_config, tiny_gpt2


def _config(fp16: dict) -> dict:
    return {**ds_config(), "fp16": fp16}


@pytest.fixture(scope="module")
def deepspeed_comm():
    """DeepSpeed's scaler logs through deepspeed.comm, which must be initialised (engines do it)."""
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())


@pytest.mark.parametrize("hysteresis,consecutive,window", [(1, False, 1), (2, False, 2), (3, True, 2), (2, True, 5),
                                                           (4, False, 3)])
def test_scaler_follows_deepspeeds_dynamic_loss_scaler(deepspeed_comm, hysteresis, consecutive, window):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    config = LossScaleConfig(initial_scale_power=10, loss_scale_window=window, hysteresis=hysteresis,
                             consecutive_hysteresis=consecutive, min_loss_scale=4)
    ours = LossScaler(config)
    theirs = DynamicLossScaler(init_scale=2 ** 10, scale_window=window, min_scale=4, delayed_shift=hysteresis,
                               consecutive_hysteresis=consecutive)
    rng = random.Random(hysteresis * 100 + window)
    for step in range(400):
        # Overflow bursts, long clean runs and everything between, down to the minimum scale.
        overflow = rng.random() < (0.6 if step % 100 < 30 else 0.05)
        try:
            theirs.update_scale(overflow)
        except Exception:  # noqa: BLE001 - DeepSpeed raises a bare Exception at the minimum scale
            with pytest.raises(FloatingPointError):
                ours.update(overflow)
            assert step > 0 and ours.cur_scale == 4
            return
        ours.update(overflow)
        assert ours.state_dict() == {"cur_scale": theirs.cur_scale, "cur_iter": theirs.cur_iter,
                                     "last_overflow_iter": theirs.last_overflow_iter,
                                     "cur_hysteresis": theirs.cur_hysteresis}, step
    assert ours.cur_scale != 2 ** 10 or hysteresis > 3, "the sequence moved the scale"


def test_static_scale_never_changes():
    scaler = LossScaler(LossScaleConfig(loss_scale=128.0))
    for overflow in (True, False, True, True):
        scaler.update(overflow)
    assert scaler.cur_scale == 128.0
    scaler.load_state_dict({"cur_scale": 4.0, "cur_iter": 9, "last_overflow_iter": 3, "cur_hysteresis": 1})
    assert scaler.cur_scale == 128.0, "a static scale is the config's, not the checkpoint's"


@pytest.mark.parametrize("section,needle", [
    ({"min_loss_scale": -1}, "fp16.min_loss_scale"),
    ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
    ({"min_loss_scale": 1e6}, "fp16.min_loss_scale: 1000000.0 is above the initial scale"),
    ({"loss_scale_window": 0}, "fp16.loss_scale_window"),
    ({"hysteresis": 0}, "fp16.hysteresis: must be at least 1"),
    ({"initial_scale_power": 200}, "fp16.initial_scale_power"),
    ({"initial_scale_power": "high"}, "fp16.initial_scale_power"),
    ({"loss_scale": -2}, "fp16.loss_scale"),
    ({"loss_scale": float("inf")}, "fp16.loss_scale"),
    ({"loss_scale": 1e-50}, "fp16.loss_scale: a static scale must be between"),
    ({"fp16_master_weights_and_grads": True}, "fp16.fp16_master_weights_and_grads"),
    ({"hysterisis": 2}, "fp16.hysterisis"),
])
def test_bad_fp16_section_names_the_key(section, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_deepspeed_keys(_config({"enabled": True, **section}))


@pytest.mark.parametrize("bf16_key", ["bf16", "bfloat16"])
def test_fp16_and_bf16_together_is_a_config_error(bf16_key):
    config = _config({"enabled": True})
    del config["bf16"]
    config[bf16_key] = {"enabled": True}
    with pytest.raises(ValueError, match=f"fp16.enabled and {bf16_key}.enabled are both true"):
        check_deepspeed_keys(config)


def test_bad_fp16_section_fails_before_touching_the_model():
    model = tiny_gpt2(2)
    with pytest.raises(ValueError, match="fp16.hysteresis"):
        stronghold.initialize(model=model, config=_config({"enabled": True, "hysteresis": 0}))
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


def test_shipped_fp16_config_has_deepspeeds_defaults():
    from stronghold.engine.launch import load_config
    config = load_config(str(Path(__file__).parents[2] / "ds_configs" / "stronghold_fp16.json"))
    check_deepspeed_keys(config)
    assert LossScaleConfig.from_deepspeed(config["fp16"]) == LossScaleConfig()
    assert LossScaler(LossScaleConfig()).cur_scale == 2.0 ** 16
