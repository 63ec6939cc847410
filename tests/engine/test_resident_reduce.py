"""The resident part's all-reduce (distributed/resident_reduce.py) is launched during the boundary backward, in one
fixed order (the model's parameters reversed) whatever order the gradients come in, and only where a failed
backward can drop it. The collectives are recorded by a stand-in for DataParallel; that they pair up across ranks
and give one process's result is tests/engine/test_data_parallel.py's (two ranks, with and without accumulation)."""
from __future__ import annotations

import torch
from torch import nn

from stronghold.distributed.resident_reduce import ResidentReductions
from stronghold.optim.gpu_optim import ResidentOptimizer

GROUP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


class Recorder:
    """DataParallel's two all-reduce calls, recording which parameter's gradient (or accumulator) was launched."""

    def __init__(self, model: nn.Module, resident: ResidentOptimizer):
        self.model, self.resident = model, resident
        self.launched: list[str] = []
        self.finished: list[str] = []

    def _name(self, tensor) -> str:
        return next(n for n, p in self.model.named_parameters()
                    if tensor is p.grad or tensor is self.resident.accum.get(id(p)))

    def start_all_reduce(self, tensor):
        self.launched.append(self._name(tensor))
        return object(), tensor

    def finish_all_reduce(self, work, buffer, tensor):
        self.finished.append(self._name(tensor))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, use_all=True):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        if not use_all:
            return self.head(x).square().mean()
        return self.head(self.unused(x) + x).square().mean()


def _setup(accumulate: bool = False):
    model = Net()
    resident = ResidentOptimizer([[(p, 0) for p in model.parameters()]], [GROUP], {}, fused=False,
                                 accumulate=accumulate)
    recorder = Recorder(model, resident)
    return model, resident, ResidentReductions(recorder, resident, model), recorder


def _backward(model, reductions, boundary: bool, use_all: bool = True) -> list[str]:
    """One micro-step's backward; returns what was launched by the time backward returned."""
    reductions.begin(boundary)
    model(torch.ones(3, 4), use_all).backward()
    return list(reductions.data_parallel.launched)


def _order(model) -> list[str]:
    return [n for n, _ in reversed(list(model.named_parameters()))]


def test_launched_during_backward_in_reverse_model_order():
    model, resident, reductions, recorder = _setup()
    assert _backward(model, reductions, True) == _order(model)  # every one before backward returned, in order
    reductions.end_backward()
    assert recorder.launched == _order(model)  # nothing left for the end
    reductions.finish()
    assert recorder.finished == _order(model)
    assert reductions._pending == []


def test_a_parameter_without_gradient_holds_the_later_ones_until_the_end_of_backward():
    model, resident, reductions, recorder = _setup()
    order = _order(model)
    assert _backward(model, reductions, True, use_all=False) == ["head.bias", "head.weight"]  # then `unused`
    reductions.end_backward()
    assert recorder.launched == [n for n in order if not n.startswith("unused")]


def test_with_accumulated_gradients_nothing_is_launched_before_backward_ends():
    model, resident, reductions, recorder = _setup(accumulate=True)
    assert _backward(model, reductions, False) == []
    resident.end_micro_step()  # the first micro-step's gradients go into the fp32 accumulators
    assert _backward(model, reductions, True) == []
    reductions.end_backward()
    assert recorder.launched == _order(model)  # the accumulators, window sums included
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_backward_drops_what_it_launched():
    model, resident, reductions, recorder = _setup()
    assert _backward(model, reductions, True)
    reductions.drop()
    resident.drop_micro_step()
    reductions.finish()
    assert recorder.finished == []
    assert _backward(model, reductions, True)  # a new backward may begin


def test_hooks_follow_a_promotion():
    model, resident, reductions, _ = _setup()
    extra = nn.Linear(8, 8)
    model.extra = extra
    reductions.begin(True)
    first = len(reductions.order)
    resident.add_chunk([(p, 0) for p in extra.parameters()], {})
    reductions.begin(True)
    assert len(reductions.order) == first + 2
    reductions.detach()
    assert reductions._handles == []
