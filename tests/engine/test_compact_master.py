"""Compact masters (streaming/compact.py): a bf16 streamed block's fp32 master as its low halves beside the working
copy. Splitting moves an exact rounding tie one ulp (about one element in 65536 an update) and is otherwise exact, so
training equals the full-master run up to those ulps: the bounds below are that arithmetic over the steps taken."""
import copy

import pytest
import torch

import stronghold
from stronghold.optim.adamw_kernel import AdamWCoeffs
from stronghold.optim.cpu_adam import load_kernel
from stronghold.optim.cpu_adam_reference import TorchAdamW
from stronghold.planning.plan_types import COMPACT_STAGING_SLOTS
from stronghold.planning.planner import Activations, BlockSpec, Budgets, ModelSpec, Rates, plan

from .helpers import batches, ds_config, run_steps, tiny_llama, train_caught_up

LR = 3e-3
CLIP = 0.5  # under this model's gradient norms (~1-3): every step clips


def _engine(model, **config):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(lr=LR, bf16=True, **config))
    return engine


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in fp32 units in the last place (same-signed values: the masters here never cross zero apart)."""
    return (a.float().contiguous().view(torch.int32).long() - b.float().contiguous().view(torch.int32).long()).abs()


def _compare(compact, full, steps: int) -> None:
    """Masters within `steps` ulps (one nudge at most an update) and all but a few equal; bf16 weights all but a few
    equal (a nudge keeps the rounding; a later update of a master one ulp off crosses a rounding edge rarely)."""
    masters, expected = compact.stronghold_runtime.master_params(), full.stronghold_runtime.master_params()
    total = differing = weights_differing = 0
    for p, q in zip(compact.module.parameters(), full.module.parameters()):
        d = _ulps(masters[id(p)], expected[id(q)])
        assert int(d.max()) <= steps, "a master moved further than its nudges"
        total += d.numel()
        differing += int((d > 0).sum())
        weights_differing += int((p.detach().cpu() != q.detach().cpu()).sum())
    assert differing <= total * 1e-3 and weights_differing <= total * 1e-3


def _compact_stores(engine) -> list:
    return [s for s in engine.stronghold_runtime.stores.values() if s.master_lo is not None]


@pytest.mark.parametrize("kernel", ["native", "eager"])
def test_split_and_merge_give_the_master_back(kernel):
    """hi is torch's bf16 rounding; merging gives every master back exactly but an exact tie, moved one ulp."""
    k = load_kernel(2) if kernel == "native" else TorchAdamW(2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_003, generator=gen) * torch.logspace(-30, 30, 200_003)
    bits = x.view(torch.int32)
    bits[::7] = (bits[::7] & ~0xFFFF) | 0x8000  # exact ties, odd and even high halves
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -3.4e38])
    hi, lo, back = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.int16), \
        torch.empty_like(x)
    k.split_master(x, hi, lo)
    assert torch.equal(hi.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    k.merge_master(hi, lo, back)
    ties = (x.view(torch.int32) & 0xFFFF) == 0x8000
    d = _ulps(back, x)
    assert int(d[~ties].max()) == 0 and int(d[ties].min()) == int(d[ties].max()) == 1
    assert torch.equal(back.to(torch.bfloat16).view(torch.int16), hi.view(torch.int16)), "the nudge keeps the rounding"
    if kernel == "eager":
        native_hi, native_lo = torch.empty_like(hi), torch.empty_like(lo)
        load_kernel(2).split_master(x, native_hi, native_lo)
        assert torch.equal(native_hi.view(torch.int16), hi.view(torch.int16)) and torch.equal(native_lo, lo)


COEFFS = AdamWCoeffs(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)


def _halves_case(kernel: str, grad_dtype: torch.dtype, seed: int):
    """The kernel and (hi, lo, m, v, g): a random compact master's halves, moments and gradient."""
    k = load_kernel(2) if kernel == "native" else TorchAdamW(2)
    gen = torch.Generator().manual_seed(seed)
    n = 100_003
    x, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype)
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    k.split_master(x, hi, lo)
    return k, (hi, lo, m, v, g)


@pytest.mark.parametrize("kernel", ["native", "eager"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_the_step_on_the_halves_is_merge_step_split(kernel, grad_dtype):
    """`step_compact` (the CPU AdamW's update of a compact master, in one pass) gives bit for bit what merging, the
    full-master step with the working copy as its output, and splitting give, and the same sum of squares."""
    k, (hi, lo, m, v, g) = _halves_case(kernel, grad_dtype, seed=1)
    n = hi.numel()
    hi2, lo2, m2, v2, master = hi.clone(), lo.clone(), m.clone(), v.clone(), torch.empty(n)
    k.merge_master(hi2, lo2, master)
    expected = k.step(master, m2, v2, g, hi2, COEFFS, 0.5)
    k.split_master(master, hi2, lo2)
    assert k.step_compact(hi, lo, m, v, g, COEFFS, 0.5) == pytest.approx(expected, rel=1e-6)
    assert torch.equal(hi.view(torch.int16), hi2.view(torch.int16)) and torch.equal(lo, lo2)
    assert torch.equal(m, m2) and torch.equal(v, v2)


@pytest.mark.parametrize("kernel", ["native", "eager"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_the_halves_first_then_the_moments_are_the_one_pass_step(kernel, grad_dtype):
    """Weights first on a compact master: `step_compact_master` writes the halves `step_compact` writes and leaves the
    moments alone; `moments` then writes its moments and returns its sum of squares, bit for bit."""
    k, (hi, lo, m, v, g) = _halves_case(kernel, grad_dtype, seed=2)
    hi2, lo2, m2, v2 = hi.clone(), lo.clone(), m.clone(), v.clone()
    expected = k.step_compact(hi2, lo2, m2, v2, g, COEFFS, 0.5)
    before = (m.clone(), v.clone())
    k.step_compact_master(hi, lo, m, v, g, COEFFS, 0.5)
    assert torch.equal(hi.view(torch.int16), hi2.view(torch.int16)) and torch.equal(lo, lo2)
    assert torch.equal(m, before[0]) and torch.equal(v, before[1]), "the moments wait for the second pass"
    assert k.moments(m, v, g, COEFFS, 0.5) == pytest.approx(expected, rel=1e-6)
    assert torch.equal(m, m2) and torch.equal(v, v2)


@pytest.mark.parametrize("case", ["accumulation", "redo", "skip", "weights_first"])
def test_compact_masters_train_as_full_ones(case):
    """Clipped steps with accumulation; an early update redone under clipping; a non-finite step skipped (early
    updates undone); weights first asked for (the halves in a first pass, the moments in a second)."""
    model, data = tiny_llama(6), batches(8)
    config = dict(window=2, resident=1, gas=2, clip=CLIP)
    if case == "redo":
        config.update(gas=1, clip=10.0)
    if case == "weights_first":
        config["weights_first"] = True

    def loss(engine, batch, i):
        out = engine(**batch).loss
        if case == "redo" and i == 4:
            return out + 1e4 * engine.module.model.embed_tokens.weight.square().sum()
        if case == "skip" and i == 3:
            return out + float("nan") * engine.module.model.embed_tokens.weight.sum()
        return out

    def train(**extra):
        return train_caught_up(_engine(model, **config, **extra), data, loss)

    compact, full = train(compact_master=True), train()
    assert len(_compact_stores(compact)) == 5 and all(s.master is None for s in _compact_stores(compact))
    assert not _compact_stores(full)
    stats = compact.stronghold_runtime.cpu.stats
    if case == "redo":
        assert stats.redo_blocks > 0, "the spike must make step() redo early updates"
    if case == "skip":
        assert compact.skipped_steps == full.skipped_steps == 1
    if case == "weights_first":
        assert stats.weights_first_blocks > 0 and full.stronghold_runtime.cpu.stats.weights_first_blocks > 0
    _compare(compact, full, steps=len(data))


def test_checkpoint_of_compact_masters_resumes_in_either_layout(tmp_path):
    """The checkpoint holds full fp32 masters: a run with compact masters and one without both resume from it."""
    model, data = tiny_llama(5), batches(10)
    config = dict(window=2, resident=1, gas=2, clip=CLIP)
    whole = _engine(model, compact_master=True, **config)
    run_steps(whole, data)
    first = _engine(model, compact_master=True, **config)
    run_steps(first, data[:6])
    first.save_checkpoint(tmp_path / "ckpt")
    saved = first.stronghold_runtime.master_params()
    saved = {name: saved[id(p)].clone() for name, p in first.module.named_parameters()}
    first.destroy()
    for extra in (dict(compact_master=True), {}):
        resumed = _engine(model, **config, **extra)
        resumed.load_checkpoint(tmp_path / "ckpt")
        loaded = resumed.stronghold_runtime.master_params()
        for name, p in resumed.module.named_parameters():
            assert torch.equal(loaded[id(p)], saved[name]), "the masters come back bit for bit"
        run_steps(resumed, data[6:])
        _compare(resumed, whole, steps=2)


def promoted_midway(make, model, data, **extra):
    """`make(model, **config)`'s engine trained four steps, blocks 1-2 promoted to the GPU (resident 1 -> 3), then
    the rest of `data`."""
    engine = make(model, window=2, resident=1, gas=2, clip=CLIP, **extra)
    run_steps(engine, data[:4])
    engine.stronghold_runtime.promote(3, 2)
    run_steps(engine, data[4:])
    return engine


def test_promoted_compact_blocks_train_on():
    """A promoted block's master is merged back to full fp32 and goes to the GPU optimizer with its moments."""
    model, data = tiny_llama(4), batches(8)
    compact = promoted_midway(_engine, model, data, compact_master=True)
    assert [s.index for s in _compact_stores(compact)] == [3]
    _compare(compact, promoted_midway(_engine, model, data), steps=len(data))


@pytest.mark.parametrize("config, needle", [
    (dict(bf16=False), "needs bf16"),
    (dict(bf16=True, lean_blocks=2), "lean_blocks"),
])
def test_compact_master_where_it_cannot_be_is_a_value_error(config, needle):
    with pytest.raises(ValueError, match=needle):
        stronghold.initialize(model=tiny_llama(3), config=ds_config(compact_master=True, **config))


def _spec(bf16=True, accumulation_steps=2):
    block = BlockSpec(numel=1_000_000, trainable_numel=1_000_000)
    return ModelSpec(blocks=(block,) * 8, rest_numel=100_000, rest_trainable_numel=100_000, compute_bytes=2,
                     bf16=bf16, accumulation_steps=accumulation_steps)


RATES = Rates(h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9, cpu_adam_params_per_s=1e8, gpu_s_per_block=0.002,
              gpu_s_fixed=0.003)
ACTS = Activations(fixed_peak_bytes=1_000_000, per_block_bytes=10_000)


def _plan(host_bytes, spec=None, local_ranks=1, **kwargs):
    budgets = Budgets(gpu_bytes=10 ** 9, host_bytes=host_bytes, gpu_margin_bytes=0, host_margin_bytes=0,
                      local_ranks=local_ranks)
    return plan(spec or _spec(), ACTS, budgets, RATES, resident_blocks=2, window_size=2, **kwargs)


def test_the_planner_compacts_masters_only_where_nothing_else_fits():
    """Auto: full masters with spares; then full masters without spares; only then compact ones; never for fp16."""
    roomy = _plan(10 ** 12, gradient_spares=None, compact_master=None)
    without_spares = _plan(roomy.host.needed - 1, gradient_spares=None, compact_master=None)
    assert (roomy.gradient_spares, roomy.compact_master) == (True, False)
    assert (without_spares.gradient_spares, without_spares.compact_master) == (False, False)
    tight = _plan(without_spares.host.needed - 1, gradient_spares=None, compact_master=None)
    assert tight.compact_master and tight.host.needed < without_spares.host.needed
    # 6 streamed blocks x 1M parameters x 2 bytes saved, the staging buffers of one block's fp32 master added.
    full = _plan(10 ** 12, gradient_spares=tight.gradient_spares)
    assert full.host.total - tight.host.total == 6 * 1_000_000 * 2 - COMPACT_STAGING_SLOTS * 1_000_000 * 4
    with pytest.raises(MemoryError):
        _plan(without_spares.host.needed - 1, spec=_spec(bf16=False), gradient_spares=None, compact_master=None)
    with pytest.raises(ValueError, match="compact_master"):
        _plan(10 ** 12, spec=_spec(bf16=False), compact_master=True)
    # Data-parallel ranks keep their shards' low halves (and always their spares: sharding.py).
    full_ranks = _plan(10 ** 12, local_ranks=2, gradient_spares=None, compact_master=None)
    ranks = _plan(full_ranks.host.needed - 1, local_ranks=2, gradient_spares=None, compact_master=None)
    assert (full_ranks.compact_master, full_ranks.gradient_spares) == (False, True)
    assert (ranks.compact_master, ranks.gradient_spares) == (True, True)
