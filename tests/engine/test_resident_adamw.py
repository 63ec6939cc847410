"""The resident part's AdamW through stronghold_ops.adamw against torch's AdamW path of the same class.

Both paths keep their states in torch's AdamW objects, so the checks are: the same masters, moments and
compute-dtype parameters within the kernel's rounding (tests/ops/test_ops_adamw.py derives 1e-6 norm-wise
for a few steps), the same step counts in `state["step"]`, accumulation windows, and states replaced from
outside (a checkpoint load, a promotion) read again rather than counted on from the host copy.
Runs on a GPU, or on the CPU through Triton's interpreter.
"""
import copy
import os

import pytest
import torch
from torch import nn

from stronghold.optim.gpu_optim import ResidentOptimizer

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the kernel path needs a GPU or TRITON_INTERPRET=1")

GROUPS = [{"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
          {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0}]
SHAPES = [(33, 17), (17,), (5, 3, 2), (2049,)]


def _optimizer(kernel: bool, accumulate: bool, device: str) -> tuple[ResidentOptimizer, list[nn.Parameter]]:
    """The kernel path, or torch's single-tensor AdamW (the arithmetic torch.optim.AdamW defines; its fused
    CUDA kernel rounds the betas to fp32 before taking 1 - beta, which moves exp_avg_sq by 1e-5 relative at
    beta2 = 0.999, so it is not the reference here)."""
    gen = torch.Generator().manual_seed(0)
    originals = [torch.randn(shape, generator=gen) for shape in SHAPES]
    params = [nn.Parameter(o.to(device, torch.bfloat16)) for o in originals]
    masters = {id(p): o.to(device) for p, o in zip(params, originals)}
    chunks = [[(params[0], 0), (params[1], 1)], [(params[2], 0), (params[3], 1)]]
    optimizer = ResidentOptimizer(chunks, [dict(g) for g in GROUPS], masters, fused=kernel, accumulate=accumulate)
    assert optimizer.kernel == kernel  # the interpreter, or a GPU, makes the kernel available
    return optimizer, params


def _train(optimizer, params, steps: int, micro: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for m in range(micro):
            for param in params:
                param.grad = torch.randn(param.shape, generator=gen).to(param.device, param.dtype)
            if m < micro - 1:
                optimizer.end_micro_step()
        optimizer.step(0.5 if step % 2 else 1.0)


def _masters(optimizer):
    return [m for chunk in optimizer.chunks for m in chunk.masters]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _states(optimizer):
    return [chunk.optimizer.state[m] for chunk in optimizer.chunks for m in chunk.masters]


@pytest.mark.parametrize("micro", [1, 3])
def test_kernel_path_equals_torch_path(micro):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel, kernel_params = _optimizer(True, micro > 1, device)
    torch_path, torch_params = _optimizer(False, micro > 1, device)
    _train(kernel, kernel_params, steps=4, micro=micro)
    _train(torch_path, torch_params, steps=4, micro=micro)
    for a, b in zip(_masters(kernel), _masters(torch_path)):
        assert _rel(a, b) < 1e-6
    for a, b in zip(_states(kernel), _states(torch_path)):
        assert int(a["step"]) == int(b["step"]) == 4
        assert a["step"].device == a["exp_avg"].device  # where torch's fused AdamW keeps it
        assert _rel(a["exp_avg"], b["exp_avg"]) < 1e-6 and _rel(a["exp_avg_sq"], b["exp_avg_sq"]) < 1e-6
    for chunk in kernel.chunks:
        for param, master in zip(chunk.params, chunk.masters):
            assert torch.equal(param.detach(), master.to(torch.bfloat16))
            assert param.grad is None and master.grad is None
    assert not kernel.accum


def _trained_pair(reference_kernel: bool, steps: int, reference_steps: int):
    """The kernel path and a reference (the kernel path too, or torch's), each trained without accumulation."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel, params = _optimizer(True, False, device)
    reference, reference_params = _optimizer(reference_kernel, False, device)
    _train(kernel, params, steps=steps, micro=1)
    _train(reference, reference_params, steps=reference_steps, micro=1)
    return kernel, params, reference, reference_params


def test_states_replaced_from_outside_are_read_again():
    kernel, params, reference, reference_params = _trained_pair(False, 2, 5)
    for mine, theirs in zip(kernel.chunks, reference.chunks):  # as a checkpoint load does (checkpoint/load.py)
        for master, source in zip(mine.masters, theirs.masters):
            master.copy_(source)
        mine.optimizer.load_state_dict(copy.deepcopy(theirs.optimizer.state_dict()))  # new state tensors
        for param, master in zip(mine.params, mine.masters):
            param.data.copy_(master)
    _train(kernel, params, steps=1, micro=1, seed=7)
    _train(reference, reference_params, steps=1, micro=1, seed=7)
    for a, b in zip(_states(kernel), _states(reference)):
        assert int(a["step"]) == int(b["step"]) == 6  # bias corrections of step 6, not of step 3
    for a, b in zip(_masters(kernel), _masters(reference)):
        assert _rel(a, b) < 1e-6


def test_a_parameter_without_gradient_is_left_alone():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel, params = _optimizer(True, False, device)
    before = [m.clone() for m in _masters(kernel)]
    for param in params[1:]:
        param.grad = torch.ones_like(param)
    kernel.step(1.0)
    assert torch.equal(_masters(kernel)[0], before[0])
    assert not kernel.chunks[0].optimizer.state[kernel.chunks[0].masters[0]]
    assert not torch.equal(_masters(kernel)[1], before[1])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU engine with the kernel path forced on")
def test_an_engine_on_the_kernel_path_trains_like_torch_adamw(monkeypatch):
    """The whole engine, its resident part on the kernel path (on a GPU it is the default; here forced on), against
    plain PyTorch AdamW in fp32 with parameter groups, clipping and accumulation: the bar of test_equivalence.py."""
    import stronghold
    from stronghold.optim import gpu_optim
    from .helpers import batches, ds_config, param_groups, relative_error, tiny_gpt2, train_reference

    launches, launch = [], gpu_optim.launch
    gathers, prepare = [], gpu_optim.prepare

    def counted(prepared, coef):
        launches.append(sum(len(p.items) for p in prepared))
        launch(prepared, coef)

    def counted_prepare(items):
        gathers.append(len(items))
        return prepare(items)

    prepared_at_step, step = [], gpu_optim.ResidentOptimizer.step

    def recorded_step(self, grad_coef):
        prepared_at_step.append(self._update is not None)
        step(self, grad_coef)

    monkeypatch.setattr(gpu_optim, "launch", counted)
    monkeypatch.setattr(gpu_optim, "prepare", counted_prepare)
    monkeypatch.setattr(gpu_optim.ResidentOptimizer, "step", recorded_step)
    model, data = tiny_gpt2(4), batches(6)
    reference, _ = train_reference(model, data, lr=3e-3, gas=2, clip=0.5, groups=True)
    model = copy.deepcopy(model)
    engine, _, _, _ = stronghold.initialize(model=model, model_parameters=param_groups(model, 0.1),
                                            config=ds_config(window=2, resident=2, gas=2, clip=0.5, lr=3e-3))
    engine.stronghold_runtime.resident.kernel = True
    for batch in data:
        engine.backward(engine(**batch).loss)
        engine.step()
    engine.synchronize_host()
    assert len(launches) == 3 and all(launches)  # one update of the resident part per optimizer step
    # One gather a step, each before the step's sync (the first one's states made there, zeros), used as is.
    assert prepared_at_step == [True, True, True] and len(gathers) == 3
    assert relative_error(engine.module, reference) <= 1e-5


@pytest.mark.parametrize("micro", [1, 3])
def test_an_update_gathered_before_the_coefficient_equals_one_gathered_at_the_step(micro):
    """prepare_update (what the engine calls before its sync on the global norm) and then step(): the same update as
    step() alone, at the hyperparameters of the step (a learning rate changed in between is the one used)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prepared, prepared_params = _optimizer(True, micro > 1, device)
    plain, plain_params = _optimizer(True, micro > 1, device)
    gen = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)]
    for step in range(4):
        for opt, params, g in ((prepared, prepared_params, gen[0]), (plain, plain_params, gen[1])):
            for m in range(micro):
                for param in params:
                    param.grad = torch.randn(param.shape, generator=g).to(param.device, param.dtype)
                if m < micro - 1:
                    opt.end_micro_step()
            opt.grad_sq_sum()  # folds the accumulators, as the engine's prepare_step does first
            if opt is prepared:
                opt.prepare_update()
                assert opt._update is not None
                # The first update's states are held by the gathered update: in the AdamW only once it launches.
                assert step > 0 or not any(chunk.optimizer.state for chunk in opt.chunks)
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            opt.step(0.5)
            assert opt._update is None
    for a, b in zip(_masters(prepared), _masters(plain)):
        assert torch.equal(a, b)
    for a, b in zip(_states(prepared), _states(plain)):
        assert int(a["step"]) == int(b["step"]) == 4 and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_gathered_update_made_stale_is_gathered_again():
    """A gradient or a state replaced after prepare_update: step() reads the new one, not the gathered one."""
    kernel, params, reference, reference_params = _trained_pair(True, 1, 1)
    for param in params:
        param.grad = torch.ones_like(param)
    kernel.prepare_update()
    gathered = kernel._update
    assert gathered is not None and kernel._current(gathered)
    params[2].grad = torch.full_like(params[2], 3.0)  # a new gradient after the gather
    assert not kernel._current(gathered)
    for param in reference_params:
        param.grad = torch.ones_like(param)
    reference_params[2].grad = torch.full_like(reference_params[2], 3.0)
    kernel.step(1.0)
    reference.step(1.0)
    for a, b in zip(_masters(kernel), _masters(reference)):
        assert torch.equal(a, b)
    for param in params:
        param.grad = torch.ones_like(param)
    kernel.prepare_update()
    kernel.zero_grad()  # a skipped step drops what was gathered
    assert kernel._update is None


def test_a_step_skipped_after_the_gather_leaves_no_state():
    """prepare_update before the first step, then the step skipped (a non-finite norm: the engine drops the
    gradients): no parameter has a state, as with torch's AdamW, and the next step is the first update."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    skipped, skipped_params = _optimizer(True, False, device)
    plain, plain_params = _optimizer(True, False, device)
    for param in skipped_params:
        param.grad = torch.full_like(param, float("nan"))
    skipped.prepare_update()
    assert skipped._update is not None and skipped._update.fresh
    skipped.zero_grad()  # the skip path (stepping.py)
    assert skipped._update is None and not any(chunk.optimizer.state for chunk in skipped.chunks)
    _train(skipped, skipped_params, steps=2, micro=1)
    _train(plain, plain_params, steps=2, micro=1)
    for a, b in zip(_states(skipped), _states(plain)):
        assert int(a["step"]) == int(b["step"]) == 2 and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    for a, b in zip(_masters(skipped), _masters(plain)):
        assert torch.equal(a, b)
