"""Gradient accumulation of the streamed blocks on the device (device_accum.py, `"gpu_accumulation"`).

On the CPU the "device" is the CPU, so the same code path runs: fp32 accumulators beside the blocks, one
fp32 window sum sent to the host per optimizer step. The sums are the host path's operation for operation
(the window's first gradient exactly, then one fp32 addition per micro-step in order), so without clipping,
where the update uses the gradient alone, the result is bit-identical to host accumulation. With clipping
the sum of squares that sets the clip coefficient is reduced in another order on each path (the kernel's
vs torch's norm): a relative difference of ~1e-7 in the coefficient, so 1e-6 whole-model as the other
rounding-level comparisons (test_step_state.py). Against plain PyTorch: 1e-5 (test_equivalence.py's bar).
"""
import copy

import pytest
import torch

import stronghold

from .helpers import (batches, check_against_host_and_reference, check_bit_identical_to_host, ds_config, relative_error,
                      run_steps, tiny_gpt2, tiny_llama, train_reference)

LR = 3e-3
TOL = 1e-6
REF_TOL = 1e-5


def _engine(model, **cfg):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(lr=LR, **cfg))
    return engine


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("bf16", [False, True])
def test_bit_identical_to_host_accumulation_without_clipping(bf16):
    engine = check_bit_identical_to_host(tiny_llama(4), batches(8), lr=LR, gas=4, bf16=bf16, gpu_accumulation=True)
    assert engine.stronghold_runtime.device_accum is not None


@pytest.mark.parametrize("clip", [0.05, 1.0])
def test_matches_pytorch_and_host_accumulation_with_clipping(clip):
    """0.05 clips every step; 1.0 only sometimes (early updates redone)."""
    check_against_host_and_reference(tiny_gpt2(4), batches(8), lr=LR, gas=2, clip=clip, tol=TOL, reference_tol=REF_TOL,
                                     gpu_accumulation=True)


def test_gradients_go_down_once_per_step_as_fp32_sums_and_the_host_keeps_no_accumulator():
    model, data = tiny_llama(4), batches(4)
    host, engine = _engine(model, gas=4), _engine(model, gas=4, gpu_accumulation=True)
    for e in (host, engine):
        run_steps(e, data)
    runtime = engine.stronghold_runtime
    streamed = sum(s.trainable_numel for s in runtime.stores.values())
    assert all(s.accum is None and s.grad.dtype == torch.float32 for s in runtime.stores.values())
    assert runtime.device_accum.nbytes == 4 * streamed
    # One optimizer step of 4 micro-steps: fp32 sums once, against fp32 gradients every micro-step.
    assert runtime.transfers.d2h_bytes == 4 * streamed
    assert host.stronghold_runtime.transfers.d2h_bytes == 4 * 4 * streamed
    # The host way keeps an fp32 accumulator and a second (here fp32) gradient buffer, where every other micro-step's
    # gradients wait to be added with the next one's (cpu_optim._accumulate); the GPU way neither.
    assert all(s.grad_spare is None for s in runtime.stores.values())
    assert host.stronghold_runtime.host_bytes.peak - runtime.host_bytes.peak == (4 + 4) * streamed


def test_frozen_parameters_and_promotion_between_steps():
    model, data = tiny_llama(4), batches(8)
    named = dict(model.named_parameters())
    named["model.layers.2.mlp.up_proj.weight"].requires_grad_(False)
    reference, _ = train_reference(model, data, lr=LR, gas=2, clip=0.5)
    engine = _engine(model, gas=2, clip=0.5, resident=0, gpu_accumulation=True)
    runtime = engine.stronghold_runtime
    run_steps(engine, data[:4])
    runtime.promote(2, 2)
    assert sorted(runtime.device_accum.accum) == [2, 3]
    run_steps(engine, data[4:])
    assert relative_error(engine.module, reference) <= REF_TOL


@pytest.mark.parametrize("bf16", [False, True])
def test_switching_to_gpu_accumulation_between_steps_changes_nothing(bf16):
    """runtime.accumulate_on_gpu (device_accum.switch_to_gpu), as placement.py does after the first step: the host
    accumulator becomes the gradient buffer, the compute-dtype one is freed, and training goes on bit-identical."""
    model, data = tiny_llama(4), batches(12)
    host = _engine(model, gas=4, bf16=bf16)
    run_steps(host, data)
    engine = _engine(model, gas=4, bf16=bf16)
    run_steps(engine, data[:4])
    runtime = engine.stronghold_runtime
    before = runtime.host_bytes.live
    runtime.accumulate_on_gpu()
    streamed = sum(s.trainable_numel for s in runtime.stores.values())
    assert runtime.device_accum is not None and all(s.accum is None for s in runtime.stores.values())
    assert before - runtime.host_bytes.live == 2 * streamed * (2 if bf16 else 4)  # both old gradient buffers
    run_steps(engine, data[4:])
    assert all(torch.equal(p, q) for p, q in zip(_params(engine).values(), _params(host).values()))


@pytest.mark.parametrize("cfg,needle", [
    (dict(gas=1, gpu_accumulation=True), "gpu_accumulation needs gradient accumulation"),
    (dict(gas=2, gpu_accumulation="yes"), "stronghold.gpu_accumulation"),
])
def test_config_errors(cfg, needle):
    with pytest.raises(ValueError, match=needle):
        _engine(tiny_llama(4), **cfg)


@pytest.mark.parametrize("window", [4, 9])
def test_slots_keep_their_blocks_across_micro_steps(window):
    """window.py: between the micro-steps of one accumulation window no weight changes, so the blocks the last
    backward left in their slots are taken back without a copy. With S = 9 streamed blocks and W slots a step
    of 4 micro-steps loads 2S - W blocks in its first pass (after the update every copy is stale) and 2(S - W)
    in each later one (plan_floor.walk counts the same); training is unchanged, bit for bit."""
    model, data = tiny_llama(10), batches(8)
    engine = _engine(model, gas=4, window=window)
    run_steps(engine, data)
    stats = engine.stronghold_runtime.window.stats
    s = 9
    assert stats.loads == 2 * ((2 * s - window) + 3 * 2 * (s - window))
    assert stats.reused == 2 * 3 * window
    narrow = _engine(model, gas=4, window=2)
    run_steps(narrow, data)
    assert all(torch.equal(p, q) for p, q in zip(_params(engine).values(), _params(narrow).values()))
