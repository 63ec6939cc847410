"""The blocks' forwards block by block over the accumulation window (block_major.py, `"block_major_forward"`).

Each block runs the same operations on the same inputs as in the window's forwards one by one, only in another order,
and the walk replays the same recorded calls: without clipping, training is bit-identical to the blockwise backward
without it (fp32 on the CPU, whose kernels do not depend on the order of the calls), and so within test_blockwise.py's
bar of plain PyTorch. With clipping, two runs of one configuration agree to rounding (RUN_TOL: test_batch_room.py says
why). Skipped blocks are checked by the window's loads: each streamed block is loaded once a window, not once a
forward.
"""
import pytest
import torch

from stronghold.config import parse_stronghold_section, resolve

from .helpers import (batches, engine_for, named_params, on_device, relative_error, tiny_gpt2, tiny_llama,
                      train_reference)

LR = 3e-3
REF_TOL = 1e-5
RUN_TOL = 1e-6
GAS = 4


def _same(a, b, clip: float) -> bool:
    """Two runs' parameters (named_params) bit for bit, or with clipping to rounding."""
    if clip:
        return relative_error(a, b) <= RUN_TOL
    return all(torch.equal(a[name], b[name]) for name in b)


def _train(model, data, *, offer: bool, clip: float = 0.0, change=None, **cfg):
    """Windows of GAS micro-batches, each offered to the engine first where `offer`; `change(i, batch)` may replace
    micro-batch i's batch after the offer. Returns the engine (host synchronized) and each window's loads of blocks by
    its forwards."""
    engine = engine_for(model, lr=LR, gas=GAS, clip=clip, blockwise_backward=True, block_major_forward=offer, **cfg)
    window = engine.stronghold_runtime.window
    loads = []
    for start in range(0, len(data), GAS):
        group = data[start:start + GAS]
        engine.window_batches(on_device(engine, group))
        before = window.stats.loads
        forwards = 0
        for i, batch in enumerate(group):
            if change is not None:
                batch = change(start + i, batch)
            loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
            forwards = window.stats.loads - before  # the window's forwards', without the boundary's walk
            engine.backward(loss)
            engine.step()
        loads.append(forwards)
    engine.synchronize_host()
    return engine, loads


@pytest.mark.parametrize("make,clip,rest", [(tiny_llama, 1.0, "gpu"), (tiny_gpt2, 0.05, "gpu"), (tiny_llama, 0.0, "gpu"),
                                            (tiny_llama, 0.0, "host")])
def test_trains_bit_identical_to_the_forwards_one_by_one(make, clip, rest):
    """GPT-2 passes its KV cache positionally and returns a tuple from its blocks; 0.05 clips every step. "host": the
    embeddings and head in the cached tier, the input table's gradient summed as the window's rows."""
    model, data = make(4), batches(3 * GAS)
    ahead, loads_ahead = _train(model, data, offer=True, clip=clip, rest_placement=rest)
    plain, loads_plain = _train(model, data, offer=False, clip=clip, rest_placement=rest)
    major = ahead.stronghold_runtime.blockwise.major
    assert major.runs == 3 and major.dropped == 0
    assert _same(named_params(ahead.module), named_params(plain.module), clip)
    reference, _ = train_reference(model, data, lr=LR, gas=GAS, clip=clip)
    assert relative_error(ahead.module, reference) <= REF_TOL
    # The window's forwards load each streamed block once, where one by one they load those the window cannot keep
    # from one forward to the next.
    streamed = len(ahead.stronghold_runtime.stores)
    assert loads_ahead == [streamed] * 3 and all(n > streamed for n in loads_plain), (loads_ahead, loads_plain)


def test_a_batch_other_than_the_one_offered_runs_the_window_one_by_one():
    """The second micro-batch of the second window is not the one offered: what ran ahead is dropped there, that
    window's later forwards run one by one, and training is the run on the batches actually given, as without the
    offer."""
    model, data = tiny_llama(4), batches(2 * GAS)
    other = batches(1, seed=7)[0]

    def change(i, batch):
        return other if i == GAS + 1 else batch

    ahead, _ = _train(model, data, offer=True, change=change)
    plain, _ = _train(model, data, offer=False, change=change)
    major = ahead.stronghold_runtime.blockwise.major
    assert major.runs == 2 and major.dropped == 1 and not major.ahead and not major.installed
    assert ahead.stronghold_report()["block_major_forward"] == {"windows": 2, "dropped": 1}
    assert _same(named_params(ahead.module), named_params(plain.module), 0.0)


def test_without_the_setting_or_the_blockwise_backward_an_offer_changes_nothing():
    model, data = tiny_llama(2), batches(GAS)
    engine = engine_for(model, lr=LR, gas=GAS, blockwise_backward=True)
    engine.window_batches(data)
    assert engine.stronghold_runtime.blockwise.major.offered is None
    engine = engine_for(model, lr=LR, gas=GAS, block_major_forward=True)
    engine.window_batches(data)  # host accumulation: nothing to run ahead
    assert engine.stronghold_runtime.blockwise is None
    with pytest.raises(ValueError, match="window_batches takes a list"):
        engine.window_batches(data[0])
    with pytest.raises(ValueError, match="got 5 micro-batches, more than the 4 of an accumulation window"):
        engine.window_batches(batches(GAS + 1))
    with pytest.raises(ValueError, match="block_major_forward runs the forwards of the blockwise backward"):
        engine_for(model, lr=LR, gas=GAS, blockwise_backward=False, block_major_forward=True)


def test_auto_is_on_a_gpu_wherever_the_blockwise_backward_may_run_and_planned_on_once_batches_come_ahead():
    """"auto" (the default): on a GPU unless "blockwise_backward" is false, off on the CPU; the plans count on it
    (`runs_ahead`) only once a window's batches have been given, as a loop that never gives them never runs ahead."""
    def settings(device, **section):
        return resolve(parse_stronghold_section({"stronghold": section}), torch.device(device))

    assert settings("cuda").block_major_forward and settings("cuda", blockwise_backward=True).block_major_forward
    assert not settings("cuda", blockwise_backward=False).block_major_forward
    assert not settings("cpu").block_major_forward and not settings("cpu", blockwise_backward=True).block_major_forward
    assert settings("cpu", blockwise_backward=True, block_major_forward=True).block_major_forward
    engine = engine_for(tiny_llama(2), lr=LR, gas=GAS, blockwise_backward=True, block_major_forward=True)
    assert not engine.stronghold_runtime.runs_ahead
    engine.window_batches(batches(GAS))
    assert engine.stronghold_runtime.runs_ahead
    plain = engine_for(tiny_llama(2), lr=LR, gas=GAS, blockwise_backward=True)
    plain.window_batches(batches(GAS))
    assert not plain.stronghold_runtime.runs_ahead


def test_a_forward_asking_for_every_block_output_runs_its_blocks():
    """`output_hidden_states`: no block of that forward is skipped, and the hidden states it returns are those of
    the forwards one by one."""
    model, data = tiny_llama(4), batches(GAS)
    runs = {}
    for offer in (True, False):
        engine = engine_for(model, lr=LR, gas=GAS, blockwise_backward=True, block_major_forward=offer)
        engine.window_batches(data)
        out = engine(**data[0], output_hidden_states=True)
        runs[offer] = [h.detach().clone() for h in out.hidden_states]
        assert not engine.stronghold_runtime.blockwise.major.ahead
        engine.backward(out.loss)
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))


def test_what_runs_ahead_holds_on_the_device_is_what_the_plan_counts():
    """activation_estimate.blockwise(ahead=True) adds two block inputs a micro-batch: each micro-batch's last block
    output and collected first block input, held from the window's first forward until the micro-batch's own."""
    from stronghold.engine.block_major import hidden_of
    from stronghold.planning import activation_estimate
    from stronghold.planning.planner import Activations, BlockSpec, ModelSpec

    from .helpers import BATCH, SEQ

    model, data = tiny_llama(4), batches(GAS)
    engine = engine_for(model, lr=LR, gas=GAS, blockwise_backward=True, block_major_forward=True)
    engine.window_batches(data)
    engine(**data[0])
    ahead = engine.stronghold_runtime.blockwise.major.ahead
    held = sum(hidden_of(e.output).nbytes + e.args[0].nbytes for e in ahead)
    block_input = BATCH * SEQ * model.config.hidden_size * 4
    spec = ModelSpec(blocks=(BlockSpec(numel=1, trainable_numel=1),) * 4, rest_numel=0, rest_trainable_numel=0,
                     compute_bytes=4, accumulation_steps=GAS)
    estimate = Activations(fixed_peak_bytes=0, per_block_bytes=block_input)
    counted = [activation_estimate.blockwise(estimate, spec, frozenset(), on_host, ahead=True).fixed_peak_bytes
               - activation_estimate.blockwise(estimate, spec, frozenset(), on_host).fixed_peak_bytes
               for on_host in (False, True)]
    assert len(ahead) == GAS - 1 and held <= counted[0] == counted[1] == 2 * GAS * block_input
    engine.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("rest", ["gpu", "host"])
def test_on_cuda_bf16_bit_identical_to_the_forwards_one_by_one(rest):
    """bf16 on a GPU, the blocks' inputs kept in page-locked host memory: the masters end bit-identical to the
    forwards one by one, and the forwards load each streamed block once a window."""
    model, data = tiny_llama(4), batches(3 * GAS)
    runs, loads = {}, {}
    for offer in (True, False):
        engine, loads[offer] = _train(model, data, offer=offer, window=2, resident=1, bf16=True, rest_placement=rest,
                                      compile=False)
        masters = engine.stronghold_runtime.master_params()
        runs[offer] = {n: masters[id(p)].float().cpu() for n, p in engine.module.named_parameters()}
        assert engine.stronghold_runtime.blockwise.major.runs == (3 if offer else 0)
        engine.destroy()
    assert _same(runs[True], runs[False], 0.0)
    assert loads[True] == [3] * 3 and all(n > 3 for n in loads[False]), loads


def test_a_failed_walk_an_evaluation_and_a_short_offer_train_as_the_forwards_one_by_one():
    """A boundary whose walk fails once and runs its micro-batch again, an evaluation forward inside a window, and a
    window given only half its batches (the rest run one by one): each ends bit for bit as without the offers."""
    from .helpers import train_through_a_failed_walk

    model, data = tiny_llama(4), batches(3 * GAS)

    def run(offer: bool, failing: bool):
        engine = engine_for(model, lr=LR, gas=GAS, blockwise_backward=True, block_major_forward=offer)
        if failing:
            engine.window_batches(data[:GAS])

            def after(i):
                if i % GAS == GAS - 1:
                    engine.window_batches(data[i + 1:i + 1 + GAS])

            assert train_through_a_failed_walk(engine, data, after_step=after) == [True]
        else:
            for start in range(0, len(data), GAS):
                group = data[start:start + GAS]
                engine.window_batches(group[:GAS // 2] if start else group)
                for i, batch in enumerate(group):
                    if i == 1:
                        with torch.no_grad():
                            engine.eval()
                            engine(**data[0])
                            engine.train()
                    engine.backward(engine(**batch).loss)
                    engine.step()
        engine.synchronize_host()
        report = engine.stronghold_report()["block_major_forward"]
        params = named_params(engine.module)
        engine.destroy()
        return params, report

    for failing in (True, False):
        got, report = run(True, failing)
        want, _ = run(False, failing)
        assert report == {"windows": 3, "dropped": 0}
        assert _same(got, want, 0.0)
