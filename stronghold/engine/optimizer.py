"""The optimizer object DeepSpeed, LR schedulers and Trainer see, and the param groups behind it.

`StrongholdOptimizer` is a `torch.optim.Optimizer` whose param groups are the client's (or the
ds.json optimizer's) AdamW groups over the model's parameters, so schedulers and logging that read
or write `param_groups[i]["lr"]` work unchanged. The update itself is the runtime's: CPU AdamW for
streamed blocks (already running during backward), fused GPU AdamW for the rest. With fp16 it holds
the loss scaler, as DeepSpeed's fp16 optimizers do: the engine reads `cur_scale` (backward, monitoring)
and DeepSpeed reads `overflow` (skipped_steps, no LR scheduler step).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from stronghold.optim.loss_scale import LossScaler
from stronghold.optim.param_state import ParamState, units, write_moments

# FusedAdam's defaults, which DeepSpeed uses for an "Adam"/"AdamW" optimizer section.
DS_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
HPARAMS = ("lr", "betas", "eps", "weight_decay")


def _number(value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    return float(value)


def check_hparams(values: dict, where: str) -> None:
    """torch.optim.AdamW's checks (and its messages) for the hyperparameters present in `values`, with
    `where` naming their source: "optimizer.params." (ds.json) or "param group 1 " (a param group)."""
    if "lr" in values and not _number(values["lr"], f"{where}lr") >= 0.0:
        raise ValueError(f"{where}lr: Invalid learning rate: {values['lr']}")
    if "eps" in values and not _number(values["eps"], f"{where}eps") >= 0.0:
        raise ValueError(f"{where}eps: Invalid epsilon value: {values['eps']}")
    if "weight_decay" in values and not _number(values["weight_decay"], f"{where}weight_decay") >= 0.0:
        raise ValueError(f"{where}weight_decay: Invalid weight_decay value: {values['weight_decay']}")
    if "betas" in values:
        betas = values["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"{where}betas must be a pair [beta1, beta2], got {betas!r}")
        for index, beta in enumerate(betas):
            if not 0.0 <= _number(beta, f"{where}betas[{index}]") < 1.0:
                raise ValueError(f"{where}betas: Invalid beta parameter at index {index}: {beta}")


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
        source = "the client optimizer's param group {} "
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
        check_hparams(params, "optimizer.params.")
        defaults = {**DS_ADAM_DEFAULTS, **params}
        groups = [{**defaults, **group} for group in _groups_from_parameters(model, model_parameters)]
        source = "param group {} "  # values a model_parameters group sets over ds.json's
    else:
        raise ValueError("stronghold needs an optimizer: add \"optimizer\": {\"type\": \"AdamW\", \"params\": "
                         "{...}} to ds.json, or pass optimizer=torch.optim.AdamW(...)")
    resolved = []
    for index, group in enumerate(groups):
        check_hparams(group, source.format(index))
        params = [p for p in group["params"] if p.requires_grad]
        if params:
            group["betas"] = tuple(float(b) for b in group["betas"])
            resolved.append({**group, "params": params})
    if not resolved:
        raise ValueError("no parameter of the model requires grad; nothing to train")
    return resolved


class StrongholdOptimizer(torch.optim.Optimizer):
    """AdamW over the model's parameters, executed by the stronghold runtime."""

    def __init__(self, param_groups: list[dict], loss_scaler: Optional[LossScaler] = None):
        defaults = {key: param_groups[0][key] for key in HPARAMS}
        super().__init__(param_groups, defaults)
        self.runtime: Any = None
        """The stronghold runtime that executes the steps (`bind`): it is built from this optimizer's groups."""
        self.loss_scaler = loss_scaler
        """fp16 only: the scale the next backward multiplies the loss by, updated after each step."""
        self.overflow = False
        """The last step was skipped (non-finite gradients); DeepSpeed reads it to count skipped_steps."""

    def bind(self, runtime) -> None:
        """The runtime built from `param_groups` (it needs them, so it comes after this optimizer)."""
        self.runtime = runtime

    @property
    def cur_scale(self) -> float:
        """The loss scale (1.0 without fp16), under the name DeepSpeed's engine and fp16 optimizers use."""
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("stronghold's optimizer does not take a closure (the update runs during backward)")
        self.overflow = self.runtime.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.overflow)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runtime.zero_grad()

    def _param_states(self) -> dict[int, ParamState]:
        """id(parameter) -> its state, for every trainable parameter."""
        if any(store.sharded for store in self.runtime.host_stores()):
            raise ValueError("stronghold: the optimizer state of a data-parallel engine is sharded over the ranks; "
                             "use engine.save_checkpoint / load_checkpoint, which gather and re-shard it")
        by_name = {state.name: state for unit in units(self.runtime) for state in unit if state.trainable}
        return {id(p): by_name[name] for name, p in self.runtime.model.named_parameters() if name in by_name}

    def state_dict(self) -> dict:
        """torch.optim.AdamW's state dict: {"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups"},
        parameters numbered in param-group order, no entry for one that has not stepped. As torch's, the
        tensors are references to the live fp32 state (here views of the runtime's host buffers, or the
        resident optimizer's tensors), not copies: save or copy them before training on. The fp32 masters
        are not in it (torch's holds no parameters), nor is the fp16 loss scale: in bf16/fp16 mode use
        engine.save_checkpoint to keep them.
        Drains the CPU optimizer first, so every pending update has landed; between backward() and step() it raises
        (step_state.require_idle): the streamed blocks' update of the pending step has already begun."""
        self.runtime.require_idle("optimizer.state_dict()")
        self.runtime.synchronize()
        states = self._param_states()
        state, groups, index = {}, [], 0
        for group in self.param_groups:
            numbers = []
            for param in group["params"]:
                found = states[id(param)]
                if found.step > 0 and found.exp_avg is not None:
                    state[index] = {"step": torch.tensor(float(found.step)), "exp_avg": found.exp_avg,
                                    "exp_avg_sq": found.exp_avg_sq}
                numbers.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict` (ours or torch.optim.AdamW's over the same parameters, in the same group
        order) holds: AdamW moments and steps into the runtime's buffers, hyperparameters into param_groups.
        Everything is checked before anything changes (no gradients may be pending: step_state.require_idle)."""
        self.runtime.require_idle("optimizer.load_state_dict()")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved_groups] != sizes:
            raise ValueError(f"the state dict's param groups have {[len(g['params']) for g in saved_groups]} "
                             f"parameters, this optimizer's have {sizes}; build the optimizer with the same groups")
        for index, group in enumerate(saved_groups):
            check_hparams(group, f"state dict param group {index} ")
        moments = {}
        names = {id(p): n for n, p in self.runtime.model.named_parameters()}
        for group, saved in zip(self.param_groups, saved_groups):
            for param, number in zip(group["params"], saved["params"]):
                entry = saved_state.get(number)
                if entry is not None:
                    for key in ("exp_avg", "exp_avg_sq"):
                        if tuple(entry[key].shape) != tuple(param.shape):
                            raise ValueError(f"state dict entry {number} ({names[id(param)]}): {key} has shape "
                                             f"{tuple(entry[key].shape)}, the parameter {tuple(param.shape)}")
                    entry = (int(entry["step"]), entry["exp_avg"], entry["exp_avg_sq"])
                moments[names[id(param)]] = entry
        self.runtime.synchronize()
        write_moments(self.runtime, moments)
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            group["betas"] = tuple(float(b) for b in group["betas"])


def group_map(model: nn.Module, param_groups: list[dict]) -> dict[int, int]:
    """id(param) -> the index of its param group; every trainable parameter of `model` in exactly one."""
    group_of: dict[int, int] = {}
    for index, group in enumerate(param_groups):
        for param in group["params"]:
            group_of[id(param)] = index
    in_model = {id(p) for p in model.parameters()}
    if any(pid not in in_model for pid in group_of):
        raise ValueError("the optimizer's param groups hold a tensor that is not a parameter of the model; "
                         "build the groups from model.parameters()")
    loose = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if loose:
        raise ValueError(f"{len(loose)} parameters require grad but are in no optimizer param group (e.g. "
                         f"{loose[0]}); add them to a group or set requires_grad=False")
    return group_of
