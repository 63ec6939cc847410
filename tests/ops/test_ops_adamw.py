"""stronghold_ops.adamw: the one-launch AdamW against torch's AdamW arithmetic.

`adamw_reference` is torch.optim.AdamW's single-tensor update written out, and equals it bitwise (first test).
The kernel computes the same expressions in fp32 in another order (p - (lr*wd)*p instead of p*(1 - lr*wd), a
multiply-add instead of lerp), which moves each result by a few units in the last place of fp32 per step, so
after STEPS steps the norm-wise relative error stays under STEPS * 8 * 2**-24 < 1e-6 (seen: about 1e-7).
The compute-dtype copy is the master rounded once, so it may differ from the reference's by one unit of that
dtype where the masters straddle a rounding boundary: compared at one ulp of bf16 / fp16.
"""
import pytest
import torch

from stronghold_ops.adamw import AdamWHparams, AdamWTensor, adamw_reference, adamw_step

STEPS = 5
SIZES = (1, 7, 2048, 2049, 5000)  # a single element, a partial tile, one exact tile, one past it, several
HPARAMS = (AdamWHparams(1e-3, 0.9, 0.999, 1e-8, 0.1), AdamWHparams(3e-2, 0.8, 0.95, 1e-6, 0.0))


def _items(device, grad_dtype, out_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    items = []
    for i, size in enumerate(SIZES):
        master = torch.randn(size, generator=gen).to(device)
        out = None if out_dtype is None else master.to(out_dtype)
        items.append(AdamWTensor(master, torch.zeros(size, device=device), torch.zeros(size, device=device),
                                 torch.zeros(size, device=device, dtype=grad_dtype), out, HPARAMS[i % 2], 0))
    return items


def _copy(items):
    return [AdamWTensor(i.master.clone(), i.exp_avg.clone(), i.exp_avg_sq.clone(), i.grad.clone(),
                        None if i.out is None else i.out.clone(), i.hparams, i.step) for i in items]


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_reference_is_torch_adamw():
    items = _items("cpu", torch.float32, None)
    params = [torch.nn.Parameter(i.master.clone()) for i in items]
    optimizers = [torch.optim.AdamW([p], lr=i.hparams.lr, betas=(i.hparams.beta1, i.hparams.beta2),
                                    eps=i.hparams.eps, weight_decay=i.hparams.weight_decay, foreach=False)
                  for p, i in zip(params, items)]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        for item, param in zip(items, params):
            item.grad = torch.randn(item.master.shape, generator=gen)
            param.grad = item.grad.clone()
            item.step = step
        adamw_reference(items, 1.0)
        for optimizer in optimizers:
            optimizer.step()
    for item, param, optimizer in zip(items, params, optimizers):
        state = optimizer.state[param]
        assert torch.equal(item.master, param.detach())
        assert torch.equal(item.exp_avg, state["exp_avg"]) and torch.equal(item.exp_avg_sq, state["exp_avg_sq"])


@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                  (torch.float16, torch.float16), (torch.float32, None)])
def test_kernel_matches_reference(device, grad_dtype, out_dtype):
    kernel = _items(device, grad_dtype, out_dtype)
    reference = _copy(kernel)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, STEPS + 1):
        for a, b in zip(kernel, reference):
            grad = torch.randn(a.master.shape, generator=gen).to(device, grad_dtype)
            a.grad, b.grad, a.step, b.step = grad, grad.clone(), step, step
        coef = 0.5 if step % 2 else 1.0  # the clip coefficient, and none
        adamw_step(kernel, coef)
        adamw_reference(reference, coef)
    for a, b in zip(kernel, reference):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert _rel(getattr(a, name), getattr(b, name)) < 1e-6, (name, a.master.numel())
        if out_dtype is not None:
            ulp = torch.finfo(out_dtype).eps * b.out.float().abs().clamp_min(torch.finfo(out_dtype).tiny)
            assert ((a.out.float() - b.out.float()).abs() <= ulp).all()
            assert torch.equal(a.out, a.master.to(out_dtype))  # the copy is this master, rounded once


def test_a_gradient_is_read_not_written(device):
    items = _items(device, torch.bfloat16, torch.bfloat16)
    for item in items:
        item.grad = torch.ones_like(item.grad)
        item.step = 1
    adamw_step(items, 0.25)
    assert all(torch.equal(item.grad, torch.ones_like(item.grad)) for item in items)


def test_bad_layouts_are_named(device):
    item = _items(device, torch.bfloat16, torch.bfloat16)[-1]
    square = AdamWTensor(torch.zeros(4, 4, device=device).t(), torch.zeros(4, 4, device=device),
                         torch.zeros(4, 4, device=device), torch.zeros(16, device=device), None, item.hparams, 1)
    with pytest.raises(ValueError, match="master must be a contiguous float32"):
        adamw_step([square], 1.0)
    item.grad = torch.zeros(3, device=device)
    with pytest.raises(ValueError, match="gradient of"):
        adamw_step([item], 1.0)
