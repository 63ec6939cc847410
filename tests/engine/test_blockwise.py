"""The backward block by block at the accumulation boundary (blockwise.py, `"blockwise_backward"`).

Each micro-batch's gradients are those of a plain backward (the walk runs each block again from its kept input, as
checkpointing does), and each parameter's are summed in fp32 in micro-batch order, the first converted exactly, as host
accumulation sums them: so without clipping an untied model ends bit-identical to host accumulation. With clipping the
norm is reduced in another order (device_accum's tests: ~1e-7 relative); tied embeddings get the head's and the
embeddings' gradients summed apart in fp32 rather than together in one backward: rounding-level, 1e-6. Against plain
PyTorch: 1e-5, test_equivalence.py's bar.
"""

import pytest
import torch

from stronghold.planning.plan_types import KEPT_PENDING

from .helpers import (batches, check_against_host_and_reference, check_bit_identical_to_host, engine_for,
                      on_device, relative_error, run_steps, tiny_gpt2, tiny_llama, train_reference,
                      train_through_a_failed_walk)

LR = 3e-3
TOL = 1e-6
REF_TOL = 1e-5


def _engine(model, **cfg):
    return engine_for(model, lr=LR, **cfg)


@pytest.mark.parametrize("bf16", [False, True])
def test_bit_identical_to_host_accumulation_without_clipping(bf16):
    engine = check_bit_identical_to_host(tiny_llama(4), batches(8), lr=LR, gas=4, bf16=bf16, blockwise_backward=True)
    assert engine.stronghold_runtime.blockwise.walks == 2
    assert engine.stronghold_report()["blockwise_backward"] is True
    assert engine_for(tiny_llama(2), lr=LR, gas=2).stronghold_report()["blockwise_backward"] is False


@pytest.mark.parametrize("make,clip", [(tiny_llama, 1.0), (tiny_gpt2, 0.05), (tiny_gpt2, 0.0)])
def test_matches_pytorch_and_host_accumulation(make, clip):
    """GPT-2 ties its embeddings to the head and passes its KV cache positionally; 0.05 clips every step."""
    check_against_host_and_reference(make(4), batches(8), lr=LR, gas=4, clip=clip, tol=TOL, reference_tol=REF_TOL,
                                     blockwise_backward=True)


def test_gradients_go_down_once_per_step_as_fp32_sums_and_nothing_is_kept_after_it():
    model, data = tiny_llama(4), batches(4)
    engine = _engine(model, gas=4, blockwise_backward=True)
    runtime = engine.stronghold_runtime
    streamed = sum(s.trainable_numel for s in runtime.stores.values())
    kept, on_host = [], []

    def record(engine, i):
        kept.append(runtime.blockwise.kept_bytes)
        on_host.append(sum(call.args[0].host.nbytes for calls in runtime.blockwise.calls for call in calls.values()
                           if call.args[0].host is not None))

    run_steps(engine, data, before_step=record)
    assert all(s.accum is None and s.grad.dtype == torch.float32 for s in runtime.stores.values())
    assert runtime.transfers.d2h_bytes == 4 * streamed
    # Every block's input of every micro-batch until the boundary's walk (4 blocks of batch x seq x hidden, fp32).
    per_block = 2 * 16 * 32 * 4
    per_micro = 4 * per_block
    if runtime.blockwise.kept.to_host:
        # On a GPU the inputs of blocks 1-3 go to host slots as the forward makes them (kept_inputs.py), at most
        # KEPT_PENDING device copies waiting for their D2H; the first block's stays on the device with the embeddings'
        # graph.
        host_micro = per_micro - per_block
        assert on_host == [host_micro, 2 * host_micro, 3 * host_micro, 0]
        assert all(i * per_block <= k <= (i + KEPT_PENDING) * per_block for i, k in enumerate(kept[:3], 1))
        assert kept[-1] == 0
    else:
        assert kept == [per_micro, 2 * per_micro, 3 * per_micro, 0] and on_host == [0, 0, 0, 0]
    assert runtime.blockwise.pending == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="dropout: the reference draws its masks from the CPU's generator "
                    "(train_reference trains on the CPU), the engine on a GPU from CUDA's")
def test_checkpointed_model_and_dropout_match_pytorch():
    """transformers' checkpointing is turned off while blocks are recorded or walked, and back on after; dropout draws
    the same masks in the walk as in the forward (the RNG state is put back per block and micro-batch)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=4, n_positions=16, vocab_size=96, bos_token_id=0,
                                       eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    model.gradient_checkpointing_enable()
    data = batches(8)
    torch.manual_seed(5)
    reference, ref_losses = train_reference(model, data, lr=LR, gas=4)
    torch.manual_seed(5)
    engine = _engine(model, gas=4, blockwise_backward=True)
    losses = run_steps(engine, data)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert relative_error(engine.module, reference) <= REF_TOL
    assert all(block.gradient_checkpointing for block in engine.module.transformer.h)


def test_a_failed_boundary_backward_can_be_run_again():
    model, data = tiny_llama(4), batches(8)
    reference, _ = train_reference(model, data, lr=LR, gas=4, clip=1.0)
    engine = _engine(model, gas=4, clip=1.0, blockwise_backward=True)
    runtime = engine.stronghold_runtime

    def failed(i):
        assert i == 3 and runtime.blockwise.pending == 3  # the failed micro-batch is gone, the first three kept

    failures = train_through_a_failed_walk(engine, data, failed)
    engine.synchronize_host()
    assert failures and runtime.blockwise.walks == 2
    assert relative_error(engine.module, reference) <= REF_TOL


def test_input_and_head_in_the_cached_tier_match_pytorch():
    """The input part's gradients reach the host once a step as one fp32 sum, like a streamed block's; the head's as
    before, every micro-step into the host accumulator."""
    model, data = tiny_llama(4), batches(8)
    reference, _ = train_reference(model, data, lr=LR, gas=4, clip=1.0)
    engine = _engine(model, gas=4, clip=1.0, blockwise_backward=True, rest_placement="host")
    run_steps(engine, data)
    units = engine.stronghold_runtime.cached.units
    assert len(units) == 2 and units[-1].store.accum is None and units[-2].store.accum is not None
    assert relative_error(engine.module, reference) <= REF_TOL


def test_a_cached_input_tied_to_the_head_is_refused_at_the_first_backward():
    engine = _engine(tiny_gpt2(2), gas=2, blockwise_backward=True, rest_placement="host")
    loss = engine(**on_device(engine, batches(1))[0]).loss
    with pytest.raises(ValueError, match="tied to the head"):
        engine.backward(loss)


@pytest.mark.parametrize("extra,needs", [({"gas": 1}, "gradient accumulation"),
                                         ({"gas": 2, "gpu_accumulation": True}, "gpu_accumulation")])
def test_settings_it_does_not_combine_with_are_refused(extra, needs):
    with pytest.raises(ValueError, match=f"blockwise_backward needs .*{needs}"):
        _engine(tiny_llama(2), blockwise_backward=True, **extra)


def test_the_first_forwards_estimate_keeps_every_micro_batchs_block_inputs():
    from stronghold.engine.kept_inputs import PENDING
    from stronghold.planning import activation_estimate
    from stronghold.planning.plan_types import (FP32_BYTES, STREAMED_GRADS_IN_FLIGHT, Activations, BlockSpec,
                                                ModelSpec, PartSpec)
    spec = ModelSpec(blocks=(BlockSpec(numel=100, trainable_numel=90), BlockSpec(numel=120, trainable_numel=110)),
                     rest_numel=300, rest_trainable_numel=300,
                     compute_bytes=2, accumulation_steps=8,
                     rest_parts=(PartSpec(name="input", numel=200, trainable_numel=200),
                                 PartSpec(name="output", numel=100, trainable_numel=100)))
    checkpointed = Activations(fixed_peak_bytes=1000, per_block_bytes=64)
    walk = 110 * (FP32_BYTES - 2) * STREAMED_GRADS_IN_FLIGHT
    kept = activation_estimate.blockwise(checkpointed, spec, frozenset(), on_host=False)
    assert (kept.per_block_bytes, kept.fixed_peak_bytes) == (8 * 64, 1000 + walk)
    # With a cached input part the walk's larger phase is the embeddings': its fp32 sum and gradient, beside the last
    # block's sum still in flight.
    cached = activation_estimate.blockwise(checkpointed, spec, frozenset({"input", "output"}), on_host=False)
    assert cached.fixed_peak_bytes == 1000 + 200 * (FP32_BYTES + 2) + 110 * (FP32_BYTES - 2)
    # On the host: the first block's 8, two blocks' 8 in the walk, PENDING whose copy has not landed.
    host = activation_estimate.blockwise(checkpointed, spec, frozenset(), on_host=True)
    assert (host.per_block_bytes, host.fixed_peak_bytes) == (64, 1000 + walk + 64 * (3 * 8 + PENDING))


@pytest.mark.gpu
@pytest.mark.parametrize("rest", ["gpu", "host"])
def test_on_cuda_bit_identical_to_host_accumulation_with_the_inputs_kept_on_the_host(rest):
    """bf16, accumulation 4, no clipping, on a GPU: the inputs go to page-locked host memory as the forwards make them
    and come back for the walk (kept_inputs.py); the masters end bit-identical to host accumulation's, and the
    streamed gradients go down once a step in fp32."""
    model, data = tiny_llama(4), batches(8)
    runs, d2h = {}, {}
    for blockwise in (True, False):
        # Eager: compiled, the forwards would run Inductor's inference graph and host accumulation its training one.
        engine = _engine(model, window=2, resident=1, gas=4, bf16=True, blockwise_backward=blockwise,
                         rest_placement=rest, compile=False)
        kept = []
        run_steps(engine, data, before_step=lambda e, i: kept.append(e.stronghold_runtime.blockwise.kept_bytes)
                  if blockwise else None)
        masters = engine.stronghold_runtime.master_params()
        runs[blockwise] = {n: masters[id(p)].float().cpu() for n, p in engine.module.named_parameters()}
        d2h[blockwise] = engine.stronghold_report()["d2h_bytes_per_step"]
        if blockwise:
            # On the device: the first block's input of each micro-batch (with the embeddings' graph), the few whose
            # D2H has not landed yet at most; nothing once the walk is over.
            first = 2 * 16 * 32 * 2
            assert all(k <= first * (i + 1) + 4 * first for i, k in enumerate(kept[:3])) and kept[3] == 0
            # One page-locked allocation per forward of the first window; the second window took the same slots.
            slots = engine.stronghold_report()["kept_input_slots"]
            assert slots == {"allocations": 4, "bytes": 4 * 3 * first}
        engine.destroy()
    for name in runs[False]:
        assert torch.equal(runs[True][name], runs[False][name]), name
    assert d2h[True] < d2h[False]


def test_forwards_without_a_backward_between_them_take_the_blocks_back_from_their_slots():
    """A window over every streamed block: the micro-steps' forwards load each block once a step (its weights change
    only at the update), taking it back from its slot after that."""
    engine = _engine(tiny_llama(4), window=3, gas=4, blockwise_backward=True)
    stats = engine.stronghold_runtime.window.stats
    run_steps(engine, batches(4))
    assert (stats.loads, stats.reused) == (3, 9)


@pytest.mark.parametrize("window", [3, 4, 6])
def test_a_steps_loads_are_what_the_floor_counts(window):
    """Eight streamed blocks, accumulation 4: the forward after an update loads all, each later one
    `later_forward_blocks`, the walk the blocks the boundary's forward left out (plan_blockwise.py's H2D count)."""
    from stronghold.streaming.schedule import later_forward_blocks
    engine = _engine(tiny_llama(8), gas=4, window=window, resident=0, blockwise_backward=True, bf16=True)
    runtime, loads = engine.stronghold_runtime, []
    for i, batch in enumerate(on_device(engine, batches(12))):
        if i % 4 == 0:
            runtime.window.stats.loads = 0
        engine.backward(engine(**batch).loss)
        engine.step()
        if i % 4 == 3:
            loads.append(runtime.window.stats.loads)
    assert loads == [8 + 3 * later_forward_blocks(8, window) + (8 - window)] * 3
