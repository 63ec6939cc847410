"""The optimizer object DeepSpeed, LR schedulers and Trainer see, and the param groups behind it.

`StrongholdOptimizer` is a `torch.optim.Optimizer` whose param groups are the client's (or the
ds.json optimizer's) AdamW groups over the model's parameters, so schedulers and logging that read
or write `param_groups[i]["lr"]` work unchanged. The update itself is the runtime's: CPU AdamW for
streamed blocks (already running during backward), fused GPU AdamW for the rest.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

# FusedAdam's defaults, which DeepSpeed uses for an "Adam"/"AdamW" optimizer section.
DS_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
HPARAMS = ("lr", "betas", "eps", "weight_decay")


def _groups_from_parameters(model: nn.Module, model_parameters: Optional[Iterable]) -> list[dict]:
    if model_parameters is None:
        model_parameters = model.parameters()
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(group, params=list(group["params"])) for group in items]
    return [{"params": items}]


def _check_torch_adam(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"stronghold implements AdamW; got a {name}. Pass torch.optim.AdamW (or configure "
                         "\"optimizer\": {\"type\": \"AdamW\"} in ds.json)")
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError(f"{name}: amsgrad and maximize are not supported by stronghold's AdamW")
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
        if not decoupled and group.get("weight_decay", 0.0) != 0.0:
            raise ValueError("torch.optim.Adam with weight_decay adds L2 to the gradient, which stronghold does "
                             "not implement; use torch.optim.AdamW (decoupled weight decay) instead")


def resolve_param_groups(model: nn.Module, client_optimizer: Union[None, torch.optim.Optimizer, Callable],
                         model_parameters: Optional[Iterable], optimizer_name: Optional[str],
                         optimizer_params: Optional[dict]) -> list[dict]:
    """AdamW param groups (params + lr, betas, eps, weight_decay) from whichever source DeepSpeed would use."""
    if client_optimizer is not None:
        if not isinstance(client_optimizer, torch.optim.Optimizer):
            client_optimizer = client_optimizer(list(model.parameters()) if model_parameters is None
                                                else model_parameters)
        _check_torch_adam(client_optimizer)
        if any(client_optimizer.state.values()):
            raise ValueError("the client optimizer has already taken steps; its state cannot be carried over. "
                             "Pass a fresh optimizer (checkpoints restore state through load_checkpoint)")
        groups = [dict(group) for group in client_optimizer.param_groups]
    elif optimizer_name is not None:
        params = dict(optimizer_params or {})
        params.pop("torch_adam", None)
        adam_w_mode = params.pop("adam_w_mode", True)
        if not params.pop("bias_correction", True):
            raise ValueError("optimizer.params.bias_correction=false is not supported by stronghold's AdamW")
        if params.pop("amsgrad", False):
            raise ValueError("optimizer.params.amsgrad is not supported by stronghold's AdamW")
        if str(optimizer_name).lower() == "adam" and not adam_w_mode and params.get("weight_decay", 0.0):
            raise ValueError("optimizer: Adam with adam_w_mode=false applies L2 weight decay, which stronghold "
                             "does not implement; use AdamW or set weight_decay to 0")
        unknown = set(params) - set(HPARAMS)
        if unknown:
            raise ValueError(f"optimizer.params: unsupported keys {sorted(unknown)}; stronghold's AdamW takes "
                             f"{', '.join(HPARAMS)}")
        defaults = {**DS_ADAM_DEFAULTS, **params}
        groups = [{**defaults, **group} for group in _groups_from_parameters(model, model_parameters)]
    else:
        raise ValueError("stronghold needs an optimizer: add \"optimizer\": {\"type\": \"AdamW\", \"params\": "
                         "{...}} to ds.json, or pass optimizer=torch.optim.AdamW(...)")
    resolved = []
    for group in groups:
        params = [p for p in group["params"] if p.requires_grad]
        if params:
            group["betas"] = tuple(float(b) for b in group["betas"])
            resolved.append({**group, "params": params})
    if not resolved:
        raise ValueError("no parameter of the model requires grad; nothing to train")
    return resolved


class StrongholdOptimizer(torch.optim.Optimizer):
    """AdamW over the model's parameters, executed by the stronghold runtime."""

    def __init__(self, param_groups: list[dict]):
        defaults = {key: param_groups[0][key] for key in HPARAMS}
        super().__init__(param_groups, defaults)
        self.runtime: Any = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("stronghold's optimizer does not take a closure (the update runs during backward)")
        self.runtime.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runtime.zero_grad()

    def state_dict(self):
        raise NotImplementedError("use engine.save_checkpoint(); stronghold keeps optimizer state in its own "
                                  "host and GPU buffers")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("use engine.load_checkpoint(); stronghold keeps optimizer state in its own "
                                  "host and GPU buffers")
