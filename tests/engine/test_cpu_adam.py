"""The native CPU AdamW against torch.optim.AdamW and its own eager reference."""
import pytest
import torch

from stronghold.cpu_adam import AdamWCoeffs, NativeAdamW, TorchAdamW, load_kernel

N = 40_001  # not a multiple of the chunk or vector width


@pytest.fixture(scope="module")
def native():
    kernel = load_kernel(threads=2)
    assert isinstance(kernel, NativeAdamW), "the C compiler is part of the test environment"
    return kernel


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g), torch.randn(N, generator=g) * 0.1, torch.rand(N, generator=g) * 0.01


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_adamw_over_steps(native, grad_dtype):
    p0, _, _ = _state(0)
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    out = torch.empty(N, dtype=torch.bfloat16)
    for step in range(1, 5):
        grad = torch.randn(N).to(grad_dtype)
        param.grad = grad.float()
        opt.step()
        sq = native.step(p, m, v, grad, out, AdamWCoeffs(1e-2, 0.9, 0.95, 1e-8, 0.1, step))
        assert sq == pytest.approx(float(grad.double().square().sum()), rel=1e-6)
        torch.testing.assert_close(p, param.data, rtol=1e-6, atol=1e-7)
        assert torch.equal(out, p.to(torch.bfloat16)), "bf16 copy rounds to nearest even like torch"


# A redo inverts the speculative step in fp32, which loses the low bits of a state the unclipped
# gradient dominated; heavy clipping (scale << 1) is why the engine defers after a clipped step.
@pytest.mark.parametrize("scale,lr2", [(0.5, 1e-2), (1.0, 5e-3), (0.8, 2e-2)])
def test_redo_equals_the_direct_step(native, scale, lr2):
    p, m, v = _state(1)
    g = torch.randn(N)
    spec, final = AdamWCoeffs(1e-2, 0.9, 0.95, 1e-8, 0.1, 7), AdamWCoeffs(lr2, 0.9, 0.95, 1e-8, 0.1, 7)
    direct = [t.clone() for t in (p, m, v)]
    native.step(*direct, g, None, final, scale)
    for kernel in (native, TorchAdamW(2)):
        redone = [t.clone() for t in (p, m, v)]
        kernel.step(*redone, g, None, spec)
        kernel.redo(*redone, g, None, spec, final, scale)
        for got, want in zip(redone, direct):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_torch_reference_matches_native(native):
    reference = TorchAdamW(2)
    a, b = _state(2), _state(2)
    g = torch.randn(N).to(torch.bfloat16)
    out_a, out_b = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
    c = AdamWCoeffs(3e-3, 0.9, 0.999, 1e-8, 0.0, 3)
    assert native.step(*a, g, out_a, c) == pytest.approx(reference.step(*b, g, out_b, c), rel=1e-6)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_squares(native, dtype):
    g = torch.randn(N).to(dtype)
    assert native.sum_squares(g) == pytest.approx(float(g.double().square().sum()), rel=1e-6)
    assert TorchAdamW(1).sum_squares(g) == pytest.approx(native.sum_squares(g), rel=1e-6)


def test_accumulate(native):
    acc = torch.full((N,), 7.0)
    g1, g2 = torch.randn(N).to(torch.bfloat16), torch.randn(N)
    native.accumulate(acc, g1, first=True)
    native.accumulate(acc, g2, first=False)
    assert torch.equal(acc, g1.float() + g2)


def test_rejects_wrong_buffers(native):
    p, m, v = _state(3)
    with pytest.raises(AssertionError, match="exp_avg"):
        native.step(p, m[:-1], v, torch.randn(N), None, AdamWCoeffs(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))
