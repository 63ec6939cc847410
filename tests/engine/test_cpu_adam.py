"""The native CPU AdamW against torch.optim.AdamW and its own eager reference."""
import time

import pytest
import torch

from stronghold.optim.adamw_kernel import AdamWCoeffs
from stronghold.optim.cpu_adam import NativeAdamW, load_kernel
from stronghold.optim.cpu_adam_reference import TorchAdamW

N = 40_001  # not a multiple of the chunk or vector width
CHUNK = 16_384  # csrc/adamw.c: elements summed in fp32 before the fp64 total
U32 = 2.0 ** -24  # fp32 unit roundoff: one rounding errs by at most U32 relative


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def sum_squares_bound(g: torch.Tensor) -> tuple[float, float]:
    """The exact sum of g^2 (fp64; exact enough: its own error is ~N * 2^-53) and the largest error the
    kernel's summation can make, whatever order the CPU's vector width gives it.

    The kernel squares and sums in fp32 within each CHUNK-element chunk (the vectorizer picks the
    order: per-lane sums, then a tree over the lanes) and adds the chunk sums in fp64. For n
    non-negative terms, any order of the n-1 additions plus the rounding of each square errs by at most
    gamma_n * sum(terms), gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical
    Algorithms, section 4.2: every partial sum is at most the total). The chunk sums are exact in fp64
    and their fp64 total adds gamma_nchunks(2^-53), included for form. About 1e-3 relative for a full
    chunk: loose, which is why test_sum_squares_is_exact_on_representable_sums checks the formula."""
    terms = g.double().square()
    chunks = terms.split(CHUNK)
    total = float(terms.sum())
    bound = sum(_gamma(len(c), U32) * float(c.sum()) for c in chunks) + _gamma(len(chunks), 2.0 ** -53) * total
    return total, bound


def representable(seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Gradients k / 16 with k in +-[1, 31]: every square is a multiple of 2^-8 and every partial sum of a
    chunk stays below 16384 * 31^2 * 2^-8 < 2^24 * 2^-8, so fp32 holds each partial sum exactly, in any
    order; bf16 and fp16 hold each k / 16 exactly. No element is zero, so dropping one changes the sum."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 32, (N,), generator=g) * (torch.randint(0, 2, (N,), generator=g) * 2 - 1)
    return (k.double() / 16).to(dtype)


def adamw_tolerance(steps: int, max_updates: list[float]) -> dict:
    """assert_close tolerances for our AdamW against torch.optim.AdamW after `steps` steps.

    Both evaluate the same fp32 formula one rounded operation at a time, but torch's vectorized CPU
    kernels may fuse a multiply-add (one rounding) where ours rounds twice (-ffp-contract=off), and its
    lerp for exp_avg is written differently; so each operation may differ by about one rounding of its
    operands. Per step: the decay product and the final add differ by <= 2u|p|; the update
    lr/bc1 * m / (sqrt(v)/bc2 + eps) is about ten operations deep, each off by a rounding of terms no
    larger than the update's own scale, so <= ~10u * max|update| (seen: 3.3u). The differences do not
    grow from step to step (decay < 1; exp_avg and exp_avg_sq mix old values by beta < 1), so they add
    up over steps. rtol = 4u and atol = 16u * max|update| per step leave 2x margin."""
    return {"rtol": steps * 4 * U32, "atol": 16 * U32 * sum(max_updates)}


@pytest.fixture(scope="module")
def native():
    kernel = load_kernel(threads=2)
    assert isinstance(kernel, NativeAdamW), "the C compiler is part of the test environment"
    return kernel


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g), torch.randn(N, generator=g) * 0.1, torch.rand(N, generator=g) * 0.01


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_adamw_over_steps(native, grad_dtype):
    p0, _, _ = _state(0)
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    # The working copy has the compute dtype: bf16 or fp16 (an fp32 gradient comes from an accumulator).
    out_dtype = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
    out = torch.empty(N, dtype=out_dtype)
    g = torch.Generator().manual_seed(10)
    updates = []
    for step in range(1, 5):
        grad = torch.randn(N, generator=g).to(grad_dtype)
        before = param.data.clone()
        param.grad = grad.float()
        opt.step()
        updates.append(float((before * (1 - 1e-2 * 0.1) - param.data).abs().max()))
        sq = native.step(p, m, v, grad, out, AdamWCoeffs(1e-2, 0.9, 0.95, 1e-8, 0.1, step))
        exact, bound = sum_squares_bound(grad)
        assert abs(sq - exact) <= bound, (sq, exact, bound)
        torch.testing.assert_close(p, param.data, **adamw_tolerance(step, updates))
        assert torch.equal(out, p.to(out_dtype)), "the copy rounds to nearest even like torch"


@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float16, torch.float16)])
@pytest.mark.parametrize("fresh", [False, True])
def test_preview_writes_the_steps_weights_and_leaves_the_state(native, grad_dtype, out_dtype, fresh):
    """preview (weights first) must write bit for bit what the step writes later, for any state, gradient dtype and
    scale (clip coefficient times unscale): the next forward runs on the preview's copy, the optimizer goes on
    from the step's state. Equality, not a tolerance: both evaluate one fp32 expression (adamw_math)."""
    p, m, v = _state(3)
    if fresh:
        m.zero_()
        v.zero_()
    g = (torch.randn(N, generator=torch.Generator().manual_seed(4)) * 3).to(grad_dtype)
    c = AdamWCoeffs(2e-3, 0.9, 0.95, 1e-8, 0.1, 1 if fresh else 9)
    for kernel in (native, TorchAdamW(2)):
        state = [t.clone() for t in (p, m, v)]
        early = torch.full((N,), float("nan"), dtype=out_dtype)  # poisoned: every element must be written
        kernel.preview(*state, g, early, c, 0.37)
        for got, before in zip(state, (p, m, v)):
            assert torch.equal(got, before), "preview must not write the fp32 state"
        late = torch.empty(N, dtype=out_dtype)
        kernel.step(*state, g, late, c, 0.37)
        assert torch.equal(early, late), type(kernel).__name__


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


def one_step_bounds(p0, m0, v0, g, c: AdamWCoeffs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The fp64 result of one AdamW step from fp32 state, and per element how far an fp32 evaluation of
    the same formula (any of torch's forms: lerp or not, fused multiply-add or not) can land from it.

    Each fp32 operation rounds its result by at most u relative (u = 2^-24), and so does each
    coefficient (w1, beta2, decay, ... are fp32 in both kernels, exact in the fp64 step); first order in u:
    - m = m0 + w1 (g - m0): w1, the subtraction, the product, the sum: <= 3u w1|g - m0| + u|m|;
    - v = beta2 v0 + (1 - beta2) g g: non-negative terms, two coefficients, two products, a sum: <= 4u v;
    - p = p0 decay - ss m / (sqrt(v) / bc2 + eps): decay and its product, the final sum:
      2u|p0 decay| + u|p|; the update ss m / d is off by its inputs' errors (|dm| / |m|, and half of v's
      relative error through the sqrt) plus seven roundings (ss, bc2, sqrt, / bc2, + eps, m / d, * ss):
      ss (dm + (2u + 7u)|m|) / d.
    The bounds are doubled for the second-order terms (measured: errors reach half the doubled bound)."""
    gold = [t.double().clone() for t in (p0, m0, v0)]
    g64 = g.double()
    TorchAdamW._adamw(*gold, g64, c)
    p, m, v = gold
    u, w1 = U32, 1 - c.beta1
    ss = c.lr / (1 - c.beta1 ** c.step)
    denom = v.sqrt() / (1 - c.beta2 ** c.step) ** 0.5 + c.eps
    dm = 3 * u * w1 * (g64 - m0.double()).abs() + u * m.abs()
    dv = 4 * u * v
    dp = 2 * u * (p0.double() * (1 - c.lr * c.weight_decay)).abs() + u * p.abs() + ss * (dm + 9 * u * m.abs()) / denom
    return gold, [2 * dp, 2 * dm, 2 * dv]


def test_torch_reference_matches_native(native):
    """Both kernels against the fp64 step, each within what fp32 rounding allows, and within each other."""
    reference = TorchAdamW(2)
    start = _state(2)
    a, b = [t.clone() for t in start], [t.clone() for t in start]
    g = torch.randn(N, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    out_a, out_b = torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
    c = AdamWCoeffs(3e-3, 0.9, 0.999, 1e-8, 0.1, 3)
    exact, bound = sum_squares_bound(g)
    assert reference.step(*b, g, out_b, c) == exact, "the reference sums in fp64"
    assert abs(native.step(*a, g, out_a, c) - exact) <= bound
    gold, bounds = one_step_bounds(*start, g, c)
    for name, x, y, want, tol in zip(("param", "exp_avg", "exp_avg_sq"), a, b, gold, bounds):
        for kernel, got in (("native", x), ("reference", y)):
            excess = ((got.double() - want).abs() - tol).max()
            assert excess <= 0, f"{kernel} {name}: off the fp64 step by more than rounding allows"
        assert ((x.double() - y.double()).abs() <= 2 * tol).all(), name
    assert torch.equal(out_a, a[0].to(torch.bfloat16)) and torch.equal(out_b, b[0].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_squares(native, dtype):
    g = (torch.randn(N, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    exact, bound = sum_squares_bound(g)
    assert abs(native.sum_squares(g) - exact) <= bound
    assert TorchAdamW(1).sum_squares(g) == exact, "the reference sums in fp64"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_squares_is_exact_on_representable_sums(native, dtype):
    """Where no partial sum rounds, every summation order gives the exact sum, so this catches a wrong
    formula (a dropped element, a wrong scale) that the rounding bound above is too loose to see."""
    g = representable(5, dtype)
    exact = float(g.double().square().sum())
    assert native.sum_squares(g) == exact
    p, m, v = _state(6)
    assert native.step(p, m, v, g, None, AdamWCoeffs(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)) == exact
    assert native.sum_squares(g[:-1]) != exact, "the test data makes a dropped element visible"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accumulate(native, dtype):
    acc = torch.full((N,), 7.0)
    g1, g2 = torch.randn(N).to(dtype), torch.randn(N)
    native.accumulate(acc, g1, first=True)
    native.accumulate(acc, g2, first=False)
    assert torch.equal(acc, g1.float() + g2)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_accumulate2_is_two_accumulates_in_one_pass(native, dtype, first):
    """acc + g + g2 in one pass rounds as two passes do: fp32 additions in the same order, bit for bit, on every
    kernel (the reference's default is the two calls)."""
    start = torch.randn(N)
    g1, g2 = torch.randn(N).to(dtype), torch.randn(N).to(dtype)
    for kernel in (native, TorchAdamW(2)):
        one, two = start.clone(), start.clone()
        kernel.accumulate2(one, g1, g2, first)
        kernel.accumulate(two, g1, first)
        kernel.accumulate(two, g2, False)
        assert torch.equal(one, two)
        assert torch.equal(one, (g1.float() if first else start + g1.float()) + g2.float())


def test_kernel_seconds_count_the_calls_and_no_more(native):
    """The kernel's own clock (csrc/adamw.c run()): it grows by at most each call's wall time, and by something."""
    acc, g = torch.zeros(4 * N), torch.randn(4 * N)
    before = native.kernel_seconds()
    start = time.perf_counter()
    native.accumulate(acc, g, first=False)
    wall = time.perf_counter() - start
    grown = native.kernel_seconds() - before
    assert 0.0 < grown <= wall
    assert TorchAdamW(1).kernel_seconds() is None


def test_rejects_wrong_buffers(native):
    p, m, v = _state(3)
    with pytest.raises(AssertionError, match="exp_avg"):
        native.step(p, m[:-1], v, torch.randn(N), None, AdamWCoeffs(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))


def _fp16_copy(native, x: torch.Tensor) -> torch.Tensor:
    """The kernel's fp16 working copy of fp32 values x (a step that leaves p as it is: lr 0, zero g)."""
    x = x.float().contiguous()
    p, m, v = x.clone(), torch.zeros_like(x), torch.zeros_like(x)
    out = torch.empty(x.numel(), dtype=torch.float16)
    native.step(p, m, v, torch.zeros_like(x), out, AdamWCoeffs(0.0, 0.9, 0.999, 1e-8, 0.0, 1))
    return out


def _same_fp16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN matches any NaN (payloads are not specified)."""
    nan = want.isnan()
    return torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)) and bool(got[nan].isnan().all())


def test_fp16_conversions_match_torch(native):
    """Reading: every one of the 65536 fp16 values converts exactly (subnormals, +-0, +-inf; NaN stays
    NaN). Writing: round to nearest even exactly as torch on every fp16 value, every midpoint between
    neighbours (the ties), the fp32 values on either side of each midpoint, the overflow edge (65504 stays,
    65520 is the tie that rounds to inf), the subnormal range down to 2^-25 (the tie that rounds to 0),
    inf, NaN, and two million random fp32 bit patterns."""
    halves = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    read = torch.full((halves.numel(),), -0.0)
    native.accumulate(read, halves, first=False)  # -0 + g is g exactly, -0 and +0 included
    want = halves.float()
    nan = want.isnan()
    assert torch.equal(read[~nan].view(torch.int32), want[~nan].view(torch.int32)) and read[nan].isnan().all()

    finite = want[want.isfinite()].unique()  # sorted
    midpoints = ((finite[:-1].double() + finite[1:].double()) / 2).float()
    assert torch.equal(midpoints.double(), (finite[:-1].double() + finite[1:].double()) / 2), "exact in fp32"
    above = torch.nextafter(midpoints, torch.tensor(float("inf")))
    below = torch.nextafter(midpoints, torch.tensor(float("-inf")))
    edges = torch.tensor([65504.0, 65519.996, 65520.0, 65536.0, 1e10, 3e38, -65520.0, 2.0 ** -14, 2.0 ** -24,
                          2.0 ** -25, 2.0 ** -25 * 1.0000001, 3 * 2.0 ** -26, 2.0 ** -26, 1e-45, 0.0, -0.0,
                          float("inf"), float("-inf"), float("nan"), -float("nan")])
    bits = torch.randint(-2 ** 31, 2 ** 31, (2_000_000,), generator=torch.Generator().manual_seed(8),
                         dtype=torch.int64).to(torch.int32).view(torch.float32)
    for name, x in (("fp16 values", want), ("midpoints", midpoints), ("above", above), ("below", below),
                    ("edges", edges), ("random", bits)):
        assert _same_fp16(_fp16_copy(native, x), x.to(torch.float16)), name


@pytest.mark.parametrize("fresh", [False, True])
def test_redo_and_undo_of_a_step_made_with_scaled_fp16_gradients(native, fresh):
    """fp16 loss scaling: the gradient arrives times S = 2^16 and the speculative step used g / S. The redo
    inverts that step (spec_scale = 1/S) and applies g / S times the clip coefficient, as the direct step
    does; undo restores the state before it. Both within the inversion's rounding (test_redo_equals_the_direct_step)."""
    p, m, v = _state(9)
    if fresh:
        m.zero_()
        v.zero_()
    g = (torch.randn(N, generator=torch.Generator().manual_seed(10)) * 0.01 * 2 ** 16).to(torch.float16)
    step = 1 if fresh else 7
    spec, final = AdamWCoeffs(1e-2, 0.9, 0.95, 1e-8, 0.1, step), AdamWCoeffs(5e-3, 0.9, 0.95, 1e-8, 0.1, step)
    unscale, coef = 2.0 ** -16, 0.3
    direct = [t.clone() for t in (p, m, v)]
    direct_out = torch.empty(N, dtype=torch.float16)
    native.step(*direct, g, direct_out, final, coef * unscale)
    for kernel in (native, TorchAdamW(2)):
        redone, undone = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, m, v)]
        out = torch.empty(N, dtype=torch.float16)
        for state in (redone, undone):
            kernel.step(*state, g, out, spec, unscale)
        kernel.undo(*undone, g, out, spec, spec_scale=unscale)
        for got, want in zip(undone, (p, m, v)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(out, undone[0].to(torch.float16))
        kernel.redo(*redone, g, out, spec, final, coef * unscale, spec_scale=unscale)
        for got, want in zip(redone, direct):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(out, redone[0].to(torch.float16))
