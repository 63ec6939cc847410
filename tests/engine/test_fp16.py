"""fp16 with DeepSpeed's loss scaling, against plain PyTorch fp16 mixed precision on the CPU.

The reference (`_reference`) is the textbook recipe: an fp16 copy of the model computes; fp32 masters
are what torch.optim.AdamW updates, copied into the fp16 model (rounded to nearest even) before each
forward; the loss is divided by GAS and multiplied by the scale; the fp16 gradients are summed in fp32
over the micro-steps (as stronghold's accumulators do) and divided by the scale; a non-finite global
norm skips the step, else clip_grad_norm_ and AdamW. The scale comes from DeepSpeed's own
`DynamicLossScaler` (`CreateLossScaler`), so the engine's scale schedule is checked against DeepSpeed's
code, not against a copy of ours.

Model: GPT-2, 4 blocks, n_embd 64, with `c_attn.bias` frozen. The key third of that bias has a zero
true gradient (softmax ignores a shift shared by all keys), so in fp16 its gradient is pure rounding
noise, which Adam normalises into steps of size lr whatever the noise's size. Any one-ulp difference
anywhere in the model changes that noise completely, so after N steps the bias is only known to within
about N lr (measured: 1.3e-2 of the whole update, against 3.5e-4 with it frozen): it would measure nothing about the
engine. Frozen, it covers frozen parameters in fp16 mode too.

Tolerances (masters as ||ours - ref|| / ||ref - init||, i.e. relative to the update the run made):
- EXACT, 0: stronghold's eager AdamW kernel (cpu_adam_reference.TorchAdamW, which is torch.optim.AdamW's own
  single-tensor ops) without clipping. Every operation is then the same torch op on the same operands:
  fp16 forward and backward on bitwise-equal weights, the same fp32 accumulation, unscaling by a power
  of two (exact, so folding 1/S into the update's coefficient gives the bits dividing first gives), the
  same AdamW ops, the same round-to-nearest-even copy to fp16.
- ROUNDING, 2e-3: the native C kernel, or clipping. The native kernel rounds some AdamW operations
  differently from torch (no fused multiply-adds; lerp written out): up to about one fp32 ulp (2^-24
  relative) per step (test_cpu_adam.py); the clip coefficient is computed in fp64 from differently
  ordered sums: a few fp32 ulps. A master one fp32 ulp off rounds to another fp16 value when it lies
  within that ulp of an fp16 rounding midpoint, with probability about 2^-24 / 2^-11 = 2^-13 per weight
  and step: a few dozen of the ~200k weights flip by one fp16 ulp (2^-11 relative) each step. A
  flipped weight changes the fp16 forward and backward that read it by about that relative amount, so
  the gradients, and through Adam the updates, of what it touches move by O(2^-11) = 5e-4 of their
  size, and the whole model stays O(2^-11) off the reference's update. The AdamW moments (exp_avg,
  exp_avg_sq) follow the gradients: O(2^-11) of their size. Measured: masters 1.3e-4 to 5.4e-4 of the
  update, moments 4e-4 to 7.3e-4; the bound for both is 4 fp16 ulps. The global norm is compared at
  1e-3 (an fp16 flip moves the gradients by O(2^-11) of their size, and so their norm).
  What the checks catch (each tried by breaking the engine): gradients left scaled in one optimizer
  barely move the masters (Adam is nearly scale-invariant: 8e-4 to 1.4e-3 of the update, inside the
  bound), but the moments are then off by S and S^2 (relative error ~1e5) and the norms of later steps
  by ~1%; a clip coefficient from the scaled norm makes the norms 1e5 times too large; a redo or undo
  that inverts the wrong gradient, or fp16 copies rounded toward zero, move the norms beyond 1e-3, the
  undone masters beyond 1e-6 or the bit-exact runs off 0.
"""
from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import pytest
import torch

import stronghold
import stronghold.engine.runtime
from stronghold.optim.cpu_adam_reference import TorchAdamW

from .helpers import batches, caught_up, ds_config, run_steps, tiny_gpt2


@pytest.fixture(autouse=True)
def fp16_on_any_cpu(monkeypatch):
    """DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels (AVX512-FP16/AMX:
    recent Intel, not AMD EPYC), although torch computes fp16 on any x86 CPU, more slowly. These tests
    check the engine's loss scaling against a torch reference on the same CPU, not oneDNN's speed, so
    the accelerator is told fp16 works for the duration of each test (undone by monkeypatch)."""
    if not torch.cuda.is_available():
        from deepspeed.accelerator import get_accelerator
        monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)


LR = 1e-3
STEPS = 6
WINDOW = 2
"""fp16.loss_scale_window: the scale doubles after 3 clean steps, then every 2 (DeepSpeed's count)."""
ROUNDING = 2e-3
CLIP = 2.0
"""Clips the first 3 steps (global norms 3.1, 2.3, 2.2; then 1.7, 1.7, 1.6), while each block's norm is
1.2 to 1.5: in the first step blocks are updated early, then redone with the clip coefficient."""
NORM_TOL = 1e-3


def _model() -> torch.nn.Module:
    model = tiny_gpt2(4, n_embd=64)
    for name, param in model.named_parameters():
        if name.endswith("c_attn.bias"):
            param.requires_grad_(False)
    return model


def _fp16(**section) -> dict:
    return {"enabled": True, "loss_scale_window": WINDOW, **section}


def _config(fp16: dict, **cfg) -> dict:
    config = ds_config(lr=LR, **cfg)
    config["fp16"] = fp16
    return config


@contextmanager
def _eager_kernel(on: bool) -> Iterator[None]:
    """Build engines with the eager AdamW kernel (what stronghold uses where no C compiler is)."""
    if not on:
        yield
        return
    original = stronghold.engine.runtime.load_kernel
    stronghold.engine.runtime.load_kernel = lambda threads=None: TorchAdamW(1)
    try:
        yield
    finally:
        stronghold.engine.runtime.load_kernel = original


def _overflow(grad: torch.Tensor) -> torch.Tensor:
    """A loss spike: 2^20 times the gradient overflows fp16 at any usable scale."""
    return grad * 2.0 ** 20


@dataclass(frozen=True)
class Spike:
    """Change the gradient arriving at the output of `module` (a submodule's name) at the given forward
    calls of it (0-based; one per micro-step); in fp16 it then flows back through everything before."""

    module: str
    calls: frozenset
    change: Callable[[torch.Tensor], torch.Tensor] = _overflow

    def attach(self, model: torch.nn.Module) -> None:
        seen = {"calls": 0}

        def forward_hook(mod, args, output):
            tensor = output[0] if isinstance(output, tuple) else output
            if seen["calls"] in self.calls and tensor.requires_grad:
                tensor.register_hook(self.change)
            seen["calls"] += 1

        model.get_submodule(self.module).register_forward_hook(forward_hook)


def _reference(model, data, fp16: dict, *, gas: int = 1, clip: float = 0.0, spike: Optional[Spike] = None):
    """Plain PyTorch fp16 training with fp32 masters (see the module docstring). Returns the masters (a
    model), the AdamW optimizer over them, and per optimizer step (scale used, global norm)."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    masters = copy.deepcopy(model)
    work = copy.deepcopy(model).half()
    if spike is not None:
        spike.attach(work)
    trained = [(m, w) for m, w in zip(masters.parameters(), work.parameters()) if m.requires_grad]
    opt = torch.optim.AdamW([m for m, _ in trained], lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    section = DeepSpeedFP16Config(**fp16)
    scaler = CreateLossScaler(torch.half, section.loss_scale, section.loss_scale == 0,
                              section.dynamic_loss_scale_args())
    accum: list[Optional[torch.Tensor]] = [None] * len(trained)
    history = []
    for i, batch in enumerate(data):
        with torch.no_grad():
            for master, weight in trained:
                weight.copy_(master)
        loss = work(**batch).loss
        (loss / gas * scaler.loss_scale).backward()
        for j, (_, weight) in enumerate(trained):
            accum[j] = weight.grad.float() if accum[j] is None else accum[j].add_(weight.grad)
            weight.grad = None
        if (i + 1) % gas:
            continue
        scale = scaler.loss_scale
        grads = [a / scale for a in accum]
        accum = [None] * len(trained)
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        overflow = not math.isfinite(norm)
        if not overflow:
            for (master, _), grad in zip(trained, grads):
                master.grad = grad
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([m for m, _ in trained], clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        history.append((scale, norm))
        scaler.update_scale(overflow)
    return masters, opt, history


def _engine(model, fp16: dict, eager: bool = False, **cfg):
    with _eager_kernel(eager):
        engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=_config(fp16, **cfg))
    return engine


def _train(engine, data) -> list[tuple[float, float]]:
    """run_steps; per optimizer step, (scale used, global norm)."""
    scales, norms = [], []

    def before_step(engine, i):
        caught_up(engine)
        if engine.is_gradient_accumulation_boundary():
            scales.append(engine.optimizer.cur_scale)
            norms.append(engine.get_global_grad_norm())  # the previous step's

    run_steps(engine, data, before_step=before_step)
    return list(zip(scales, norms[1:] + [engine.get_global_grad_norm()]))


def _check_history(ours: list, ref: list) -> None:
    """The same scale at every step, the same steps skipped, global norms within NORM_TOL."""
    assert [s for s, _ in ours] == [s for s, _ in ref]
    assert [math.isfinite(n) for _, n in ours] == [math.isfinite(n) for _, n in ref]
    for (_, a), (_, b) in zip(ours, ref):
        assert not math.isfinite(b) or abs(a - b) <= NORM_TOL * b, (a, b)


def _masters(engine) -> dict[str, torch.Tensor]:
    engine.synchronize_host()
    masters = engine.stronghold_runtime.master_params()
    return {name: masters[id(p)].detach().clone() for name, p in engine.module.named_parameters()}


def _error(ours: dict, ref: dict, init: Optional[dict] = None) -> float:
    """||ours - ref|| / ||ref - init|| over the named tensors (init None: relative to ||ref||)."""
    num = sum(float((ours[k].double() - ref[k].double()).square().sum()) for k in ref)
    den = sum(float((ref[k].double() - (0 if init is None else init[k].double())).square().sum()) for k in ref)
    return (num / den) ** 0.5


def _moments(state_dict: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """exp_avg / exp_avg_sq of torch.optim.AdamW's state dict format, keyed "<kind>/<name>"."""
    out = {}
    for index, entry in state_dict["state"].items():
        for kind in ("exp_avg", "exp_avg_sq"):
            out[f"{kind}/{names[index]}"] = entry[kind].detach().float().cpu()
    return out


def _compare(engine, model, masters_ref, opt_ref, tol: float) -> None:
    """Masters (relative to the update) and AdamW moments (relative to their size) against the reference."""
    ours = _masters(engine)
    init = {n: p.detach() for n, p in model.named_parameters()}
    ref = {n: p.detach() for n, p in masters_ref.named_parameters()}
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n in init if n not in trained]
    assert all(torch.equal(ours[n], init[n].to(ours[n].dtype)) for n in frozen)  # frozen: kept in fp16
    error = _error({n: ours[n] for n in trained}, {n: ref[n] for n in trained}, init)
    moments = _moments(engine.optimizer.state_dict(), trained)
    moments_ref = _moments(opt_ref.state_dict(), trained)
    assert moments.keys() == moments_ref.keys()
    moments_error = max(_error({k: moments[k] for k in moments if k.startswith(kind)},
                               {k: moments_ref[k] for k in moments_ref if k.startswith(kind)})
                        for kind in ("exp_avg/", "exp_avg_sq/"))
    if tol == 0:
        assert error == 0 and moments_error == 0, (error, moments_error)
    else:
        assert error <= tol and moments_error <= tol, (error, moments_error)


# (gas, clip, resident blocks, fp16 section): with GAS 2 the runs have STEPS optimizer steps as well.
CASES = {
    "gas1": (1, 0.0, 1, {}),
    "gas2": (2, 0.0, 1, {}),
    "gas2_clip_resident0": (2, CLIP, 0, {}),
    "gas2_clip_resident1": (2, CLIP, 1, {}),
    "gas2_clip_all_resident": (2, CLIP, 4, {}),
    "static_scale": (1, 0.0, 1, {"loss_scale": 1024}),
}
# The clipping cases with the native kernel are the long ones: `make test-slow`.
RUNS = [pytest.param(case, "native", marks=[pytest.mark.slow] if CASES[case][1] else []) for case in CASES] + \
    [(case, "eager") for case in CASES if CASES[case][1] == 0]


@pytest.mark.parametrize("case,kernel", RUNS)
def test_matches_pytorch_fp16_mixed_precision(case, kernel):
    gas, clip, resident, section = CASES[case]
    model, data, fp16 = _model(), batches(STEPS * gas), _fp16(**section)
    masters_ref, opt_ref, history_ref = _reference(model, data, fp16, gas=gas, clip=clip)
    engine = _engine(model, fp16, eager=kernel == "eager", window=2, resident=resident, gas=gas, clip=clip)
    assert engine.stronghold_runtime.compute_dtype == torch.float16
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    history = _train(engine, data)
    _check_history(history, history_ref)
    if clip:
        assert [norm > clip for _, norm in history] == [True] * 3 + [False] * 3
        if engine.stronghold_runtime.cpu is not None:
            assert engine.stronghold_runtime.cpu.stats.redo_blocks > 0, "early updates were redone with clipping"
    if not section:
        assert [s for s, _ in history] == [2.0 ** 16] * 3 + [2.0 ** 17] * 2 + [2.0 ** 18], \
            "DeepSpeed's window: the first doubling after WINDOW + 1 clean steps, then every WINDOW"
    assert engine.skipped_steps == 0
    _compare(engine, model, masters_ref, opt_ref, 0 if kernel == "eager" and not clip else ROUNDING)


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_overflow_skips_the_step_and_backs_off_the_scale(hysteresis):
    """A spike at the final norm's output in steps 2 and 3 overflows every gradient behind it, so no
    block is updated early and the skipped steps leave every weight (fp16 working copies, streamed and
    resident fp32 masters) as it was, bit for bit. The scale halves per overflow with hysteresis 1;
    with 2 the first overflow only uses it up. Then training goes on exactly as the reference's."""
    model, data, fp16 = _model(), batches(STEPS), _fp16(hysteresis=hysteresis)
    spike = Spike("transformer.ln_f", frozenset({2, 3}))
    masters_ref, opt_ref, history_ref = _reference(model, data, fp16, spike=spike)
    engine = _engine(model, fp16, eager=True, window=2, resident=1)
    spike.attach(engine.module)
    history = _train(engine, data[:2])
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    masters = _masters(engine)
    history += _train(engine, data[2:4])
    assert engine.skipped_steps == 2 and engine.stronghold_runtime.skipped_steps == 2
    assert engine.optimizer.overflow
    assert all(torch.equal(p, weights[n]) for n, p in engine.module.named_parameters())
    assert all(torch.equal(m, masters[n]) for n, m in _masters(engine).items())
    assert engine.optimizer.cur_scale == 2.0 ** 16 / (4 if hysteresis == 1 else 2)
    history += _train(engine, data[4:])
    assert [math.isfinite(n) for _, n in history] == [True, True, False, False, True, True]
    _check_history(history, history_ref)
    _compare(engine, model, masters_ref, opt_ref, 0)


@pytest.mark.parametrize("where", ["transformer.h.2", "transformer.wpe"])
def test_overflow_after_early_updates_undoes_them(where):
    """A spike at block 2's output (or at the position embedding's): the blocks backward reaches first
    stay finite and are updated early, during backward (no clipping); the overflow behind them then
    skips the step, so those updates are undone. Undoing inverts the AdamW step in fp32, about one
    rounding per element (test_step_state.py): masters come back within 1e-6 of where they were."""
    model, data, fp16 = _model(), batches(STEPS), _fp16(hysteresis=1)
    spike = Spike(where, frozenset({2}))
    masters_ref, opt_ref, history_ref = _reference(model, data, fp16, spike=spike)
    engine = _engine(model, fp16, window=2, resident=1)
    spike.attach(engine.module)
    history = _train(engine, data[:2])
    masters = _masters(engine)
    history += _train(engine, data[2:3])
    assert engine.skipped_steps == 1 and engine.optimizer.cur_scale == 2.0 ** 15
    assert _error(_masters(engine), masters) <= 1e-6
    history += _train(engine, data[3:])
    _check_history(history, history_ref)
    _compare(engine, model, masters_ref, opt_ref, ROUNDING)


def test_clipping_redoes_early_updates_with_the_scale_folded_in():
    """Steps 2-3 stay well under the limit, so the blocks are updated early during backward; in step 4 a
    gradient added at the position embedding (resident) pushes the global norm over it, so step() redoes
    every early update: it inverts the step made with gradient g / S and applies g / S times the clip
    coefficient, with m and v no longer zero (a first step restores them exactly, whatever the scale)."""
    model, data, fp16, clip = _model(), batches(STEPS), _fp16(), 5.0
    # + 2^15 in scaled units is 2^15 / 2^17 = 0.25 per element at step 4's scale: a norm of 8 over the
    # 16 x 64 position embeddings (one row per position, shared by the batch), and still finite in fp16.
    spike = Spike("transformer.wpe", frozenset({3}), lambda grad: grad + 2.0 ** 15)
    masters_ref, opt_ref, history_ref = _reference(model, data, fp16, clip=clip, spike=spike)
    assert [norm > clip for _, norm in history_ref] == [False] * 3 + [True] + [False] * 2
    assert history_ref[2][1] < 0.8 * clip, "the step before the spike speculates (speculation.SPECULATE_FRACTION)"
    engine = _engine(model, fp16, window=2, resident=1, clip=clip)
    spike.attach(engine.module)
    history = _train(engine, data)
    assert engine.stronghold_runtime.cpu.stats.redo_blocks == 3
    _check_history(history, history_ref)
    _compare(engine, model, masters_ref, opt_ref, ROUNDING)


def test_checkpoint_resumes_bit_exact_with_the_scaler_state(tmp_path):
    """Saved after 4 of 8 steps, with an overflow at step 2 in between (hysteresis used up, the growth
    count restarted), loaded into a fresh engine: the rest of the run is bit for bit the uninterrupted
    run's. A fresh scaler would double at its third step instead of the first after the load, and a
    different scale changes which fp16 gradients underflow: not bit-exact."""
    model, data, fp16 = _model(), batches(8), _fp16()
    spike = Spike("transformer.ln_f", frozenset({1}))
    full = _engine(model, fp16, window=2, resident=1, clip=CLIP)
    spike.attach(full.module)
    history = _train(full, data)
    first = _engine(model, fp16, window=2, resident=1, clip=CLIP)
    spike.attach(first.module)
    history_first = _train(first, data[:4])
    first.save_checkpoint(tmp_path)
    saved = first.optimizer.loss_scaler.state_dict()
    assert saved == {"cur_scale": 2.0 ** 16, "cur_iter": 4, "last_overflow_iter": 1, "cur_hysteresis": 1}
    resumed = _engine(model, fp16, window=2, resident=1, clip=CLIP)
    resumed.load_checkpoint(tmp_path)
    assert resumed.optimizer.loss_scaler.state_dict() == saved and resumed.skipped_steps == 1
    history_resumed = history_first + _train(resumed, data[4:])
    assert repr(history_resumed) == repr(history)  # repr: exact floats, and nan equals nan
    assert [s for s, _ in history] == [2.0 ** 16] * 5 + [2.0 ** 17] * 2 + [2.0 ** 18]
    assert resumed.optimizer.loss_scaler.state_dict() == full.optimizer.loss_scaler.state_dict()
    ours, theirs = _masters(resumed), _masters(full)
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    weights = dict(full.module.named_parameters())
    assert all(torch.equal(p, weights[n]) for n, p in resumed.module.named_parameters())


def test_overflow_at_the_minimum_scale_stops_training():
    """DeepSpeed's DynamicLossScaler raises when an overflow finds the scale at min_loss_scale with no
    hysteresis left; the step itself is skipped first, so the engine is left consistent."""
    model, data = _model(), batches(1)
    engine = _engine(model, _fp16(initial_scale_power=4, min_loss_scale=16, hysteresis=1), window=2, resident=1)
    Spike("transformer.ln_f", frozenset({0})).attach(engine.module)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with pytest.raises(FloatingPointError, match="fp16.min_loss_scale"):
        _train(engine, data)
    assert engine.stronghold_runtime.skipped_steps == 1
    engine.synchronize_host()
    assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
