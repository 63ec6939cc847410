"""A training micro-batch longer than any the placement planned for (planning/batch_room.py): the window gives up the
slots its activations need before its forward runs, between micro-steps too (`Relayout.shrink_window`), and training
stays what plain PyTorch computes.

The shrink only moves weights (each block the window held loads again from its host copy, which no update changes
before the step), so the equivalence bar is test_equivalence.py's 1e-5 whole-model relative, and against the same
engine without the shrink the result is the same to rounding (RUN_TOL): the arithmetic does not depend on which slot a
block ran from, but two runs of one clipped configuration need not be bit-identical.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from stronghold.planning import batch_room, initial_plan, placement, planner
from stronghold.planning.batch_room import BatchRoom, activation_bytes, slots_to_free

from .helpers import batches, engine_for, named_params, relative_error, run_steps, tiny_llama, train_reference
from .test_placement import _settings, _spec

LR = 3e-3
TOL = 1e-5
RUN_TOL = 1e-6
"""Two runs of one configuration with clipping: test_step_state.py's bar. A streamed block updated early and redone
when the step clips is exact to about one rounding (speculation.py), and whether it is updated early depends on the
sums of squares the CPU worker has added by then, so on its timing; one CI run (2 loaded cores) differed bitwise."""
GIB = planner.GIB


def test_slots_to_free_cover_what_the_room_does_not_and_leave_two():
    assert slots_to_free(extra=100, room=100, slot_bytes=40, window=6) == 0
    assert slots_to_free(extra=101, room=100, slot_bytes=40, window=6) == 1
    assert slots_to_free(extra=180, room=100, slot_bytes=40, window=6) == 2
    assert slots_to_free(extra=181, room=100, slot_bytes=40, window=6) == 3
    assert slots_to_free(extra=10 ** 6, room=0, slot_bytes=40, window=6) == 6 - batch_room.MIN_WINDOW
    assert slots_to_free(extra=10 ** 6, room=0, slot_bytes=40, window=2) == 0


def _shrink_after(micro_step: int, window: int):
    def shrink(engine, i):
        if i == micro_step:
            engine.stronghold_runtime.shrink_window(window)
    return shrink


@pytest.mark.parametrize("blockwise", [False, True])
@pytest.mark.parametrize("micro_step", [1, 4])
def test_shrinking_the_window_between_micro_steps_matches_pytorch_and_the_unshrunk_engine(blockwise, micro_step):
    """Shrunk after the second micro-batch of the first window (mid-accumulation, every slot holding a block), or
    between the first two optimizer steps; clipping 1.0 with accumulation 4."""
    model, data = tiny_llama(6), batches(8)
    reference, _ = train_reference(model, data, lr=LR, gas=4, clip=1.0)
    config = dict(lr=LR, gas=4, clip=1.0, window=4, resident=1, blockwise_backward=blockwise)
    plain = engine_for(model, **config)
    run_steps(plain, data)
    engine = engine_for(model, **config)
    runtime = engine.stronghold_runtime
    loads = []
    run_steps(engine, data, before_step=lambda e, i: (_shrink_after(micro_step, 2)(e, i),
                                                      loads.append(runtime.window.stats.loads)))
    assert runtime.window_size == 2 and len(runtime.transfers.slots) == 2 and len(runtime.window.slots) == 2
    assert relative_error(engine.module, reference) <= TOL
    assert relative_error(engine.module, plain.module) <= RUN_TOL
    assert loads == sorted(loads), "the window's counters carry over the shrink"


def test_the_window_shrinks_only_downwards_to_two_and_not_during_an_update():
    engine = engine_for(tiny_llama(6), lr=LR, gas=2, window=4, resident=1)
    runtime = engine.stronghold_runtime
    slots = runtime.transfers.slots
    runtime.shrink_window(4)
    runtime.shrink_window(5)
    assert runtime.transfers.slots is slots, "no rebuild where nothing shrinks"
    runtime.shrink_window(1)
    assert runtime.window_size == 2
    data = [{k: v for k, v in b.items()} for b in batches(2)]
    for i, batch in enumerate(data):
        engine.backward(engine(**batch).loss)
        if i == 1:
            with pytest.raises(RuntimeError, match="during a step's update"):
                runtime.shrink_window(2)
        engine.step()


class _Runtime(SimpleNamespace):
    """A stand-in runtime: its window's slots and a record of the shrinks asked for."""

    def shrink_window(self, window):
        self.asked.append(window)
        self.window_size = window


def _room(window: int, slot_bytes: int, resident: int = 0, plan_room: int = 0, blockwise=None):
    """A BatchRoom on a checkpointing tiny Llama (hidden 32, vocabulary 256), a runtime laid out as its plan, whose
    GPU budget leaves `plan_room` beyond its needs."""
    model = tiny_llama(6)
    model.gradient_checkpointing_enable()
    spec = dataclasses.replace(_spec(blocks=6, numel=2 ** 20), compute_bytes=4)
    slot = torch.empty(slot_bytes, dtype=torch.uint8)
    runtime = _Runtime(model=model, window=SimpleNamespace(slots=[SimpleNamespace(buffer=slot)]), window_size=window,
                       resident_count=resident, stores=dict.fromkeys(range(resident, 6)), activations=None,
                       blockwise=blockwise, asked=[], runs_ahead=False)
    built = initial_plan.initial_plan(spec, planner.Budgets(gpu_bytes=GIB, host_bytes=16 * GIB),
                                      _settings(window_size=window, resident_blocks=resident))
    gpu = dataclasses.replace(built.gpu, activations=0)  # no reserve: the plan's room is `plan_room`
    plan = dataclasses.replace(built, gpu=gpu, gpu_budget_bytes=gpu.needed + plan_room)
    return BatchRoom(spec), runtime, plan, model, spec


def _extra(model, spec, tokens, planned, cached=frozenset(), on_host=None):
    return (activation_bytes(model, spec, tokens, cached, on_host)
            - activation_bytes(model, spec, planned, cached, on_host))


ROOM = 10 ** 4


def test_a_longer_micro_batch_takes_the_slots_its_estimate_needs_and_the_leftover_serves_the_next():
    _, _, _, model, spec = _room(window=4, slot_bytes=1)
    extra = _extra(model, spec, 96, 64)
    room, runtime, plan, model, spec = _room(window=4, slot_bytes=extra, plan_room=ROOM)
    room.before_forward(runtime, 64, plan)
    assert (room.tokens, room.room, runtime.asked) == (64, ROOM, []), "the first micro-batch is what was planned"
    room.before_forward(runtime, 32, plan)
    assert runtime.asked == [] and room.tokens == 64, "a shorter one changes nothing"
    room.before_forward(runtime, 96, plan)
    assert runtime.asked == [3] and room.room == ROOM and room.tokens == 96, "one slot, the plan's room left over"
    small = _extra(model, spec, 97, 96)
    assert 0 < small <= ROOM, "the case in question"
    room.before_forward(runtime, 97, plan)
    assert runtime.asked == [3] and room.room == ROOM - small, "the room covers it"
    room.before_forward(runtime, 10 ** 4, plan)
    assert runtime.asked == [3, 2] and room.room < 0, "never below two slots: then the warning"
    assert [s["window"] for s in room.shrunk] == [3, 3, 2]


def test_a_new_plan_is_read_for_its_room_and_a_layout_other_than_the_plans_counts_none():
    _, _, _, model, spec = _room(window=4, slot_bytes=1)
    room, runtime, plan, model, spec = _room(window=4, slot_bytes=_extra(model, spec, 128, 96), plan_room=10 ** 9)
    room.before_forward(runtime, 64, plan)
    room.before_forward(runtime, 96, plan)
    assert runtime.asked == [] and room.room == 10 ** 9 - _extra(model, spec, 96, 64)
    other = dataclasses.replace(plan, window_size=5)
    room.before_forward(runtime, 96, other)
    assert room.room == 0 and room.tokens == 96
    room.before_forward(runtime, 128, other)
    assert runtime.asked == [3]


def test_a_reserve_the_plan_held_for_activations_beyond_the_planned_micro_batch_counts_as_room():
    """The start-up plan holds a reserve back for a batch it has not seen: what the longest micro-batch planned for
    leaves of it is room too."""
    room, runtime, plan, model, spec = _room(window=4, slot_bytes=16, plan_room=100)
    planned = activation_bytes(model, spec, 64, frozenset(), None)
    reserved = dataclasses.replace(plan, gpu=dataclasses.replace(plan.gpu, activations=planned + 50000),
                                   gpu_budget_bytes=plan.gpu_budget_bytes + planned + 50000)
    room.before_forward(runtime, 64, reserved)
    assert room.room == 100 + 50000
    assert _extra(model, spec, 65, 64) <= 50100, "the case in question"
    room.before_forward(runtime, 65, reserved)
    assert runtime.asked == []


def test_once_the_plan_is_made_from_a_measured_step_the_measured_activations_scale_with_the_tokens():
    """After the first step the plan's activations are the measured peak at the longest micro-batch so far: a longer
    one needs that peak's bytes a token for each token more (not the estimate's difference, an upper bound); also
    without checkpointing, where no estimate exists."""
    room, runtime, plan, model, spec = _room(window=6, slot_bytes=1000)
    model.gradient_checkpointing_disable()
    room.before_forward(runtime, 64, plan)
    room.before_forward(runtime, 96, plan)
    assert runtime.asked == [] and room.tokens == 96, "no estimate before the measurement: nothing changes"
    measured = dataclasses.replace(plan)  # the plan after the first step: a new one
    room.before_forward(runtime, 64, measured, measured=9600)
    room.before_forward(runtime, 126, measured, measured=9600)
    assert room.shrunk[-1]["extra_bytes"] == 100 * 30 and runtime.asked == [3]
    assert room.room == 3 * 1000 - 3000


def test_the_allocator_gap_in_the_measured_activations_is_not_scaled_with_the_tokens():
    """The first step's measured activations hold what the allocator reserved beyond its allocated peak; that gap was
    there at the shorter micro-batches already and does not grow with the tokens as the tensors do."""
    room, runtime, plan, model, spec = _room(window=6, slot_bytes=1000)
    placed = placement.Placement(runtime=runtime, spec=spec, budget=planner.Budgets(gpu_bytes=GIB, host_bytes=GIB),
                                 settings=_settings(), plan=plan)
    placed.measured.update(activations_bytes=9600 + 5000, allocator_gap_bytes=5000)
    for tokens in (64, 126):
        placed.make_room((), {"input_ids": torch.zeros(1, tokens, dtype=torch.long)}, training=True)
    assert placed.room.shrunk[-1]["extra_bytes"] == 9600 // 64 * 62


def test_the_blockwise_backward_s_estimate_is_the_one_weighed():
    on_host = SimpleNamespace(kept=SimpleNamespace(to_host=True))
    room, runtime, plan, model, spec = _room(window=6, slot_bytes=256, blockwise=on_host)
    room.before_forward(runtime, 64, plan)
    room.before_forward(runtime, 128, plan)
    extra = _extra(model, spec, 128, 64, plan.cached_parts, True)
    assert extra != _extra(model, spec, 128, 64)
    assert room.shrunk[0]["extra_bytes"] == extra


def test_no_estimate_no_shrink_and_offloaded_activations_are_left_alone():
    room, runtime, plan, model, spec = _room(window=4, slot_bytes=16)
    model.gradient_checkpointing_disable()
    room.before_forward(runtime, 64, plan)
    room.before_forward(runtime, 128, plan)
    assert runtime.asked == [] and room.tokens == 128, "it ran as placed"
    room, runtime, plan, model, spec = _room(window=4, slot_bytes=16)
    runtime.activations = object()
    room.before_forward(runtime, 64, plan)
    room.before_forward(runtime, 128, plan)
    assert runtime.asked == []


def test_the_placement_asks_only_for_training_forwards_with_the_window_its_own():
    room, runtime, plan, model, spec = _room(window=4, slot_bytes=16)
    for window_size, training, asked in [("auto", True, [2]), ("auto", False, []), (4, True, [])]:
        runtime.window_size, runtime.asked = 4, []
        placed = placement.Placement(runtime=runtime, spec=spec, budget=planner.Budgets(gpu_bytes=GIB, host_bytes=GIB),
                                     settings=_settings(window_size=window_size), plan=plan)
        for tokens in (64, 4096):
            ids = torch.zeros(1, tokens, dtype=torch.long)
            placed.make_room((), {"input_ids": ids}, training=training)
        assert runtime.asked == asked, (window_size, training)
    assert placed.report()["longer_batches"] == []


def test_the_blockwise_choice_weighs_the_kept_inputs_of_the_longest_training_micro_batch():
    """The plan after the first step weighs the blockwise backward's kept inputs in page-locked host memory: one block's
    input a micro-batch, of the longest the first step had, not of its first (a short first one understated them)."""
    room, runtime, plan, model, spec = _room(window=4, slot_bytes=16)
    runtime.activations = object()  # every forward returns after the kept inputs' bytes (nothing is promoted here)
    placed = placement.Placement(runtime=runtime, spec=spec, budget=planner.Budgets(gpu_bytes=GIB, host_bytes=GIB),
                                 settings=_settings(), plan=plan)
    placed._first_forward_seen = True
    for tokens, training in [(64, True), (256, False), (128, True), (96, True)]:
        placed.first_forward((), {"input_ids": torch.zeros(1, tokens, dtype=torch.long)}, training=training)
    assert placed._block_input_bytes == 128 * model.config.hidden_size * spec.compute_bytes


@pytest.mark.gpu
def test_on_cuda_longer_micro_batches_shrink_the_auto_window_mid_accumulation_and_train_the_same(monkeypatch):
    """Under a 2.5 GiB cap with 2 blocks resident and the window left to stronghold, accumulation 4: the first
    micro-batch has 8 tokens a sequence, the rest 16. With the plan's room counted as none, each longer micro-batch
    gives up a slot before its forward (the first of them mid-accumulation, the slots holding blocks and prefetches in
    flight), and training equals the same run placed from the start as it ends up (fp32: rounding only, test_gpu.py's
    bar)."""
    from .test_gpu import _capped_engine, _distance

    monkeypatch.setattr(BatchRoom, "_plan_room", staticmethod(lambda *args: 0))
    full = batches(8)
    data = [{k: v[:, :8] for k, v in full[0].items()}, *full[1:]]
    try:
        engine = _capped_engine(2.5, {"resident_blocks": 2}, gas=4, checkpointing=True)
        runtime = engine.stronghold_runtime
        run_steps(engine, data[:1])
        window = runtime.window_size
        assert window > batch_room.MIN_WINDOW, "the case in question: a window to shrink"
        run_steps(engine, data[1:2])
        assert runtime.window_size == window - 1 and len(runtime.transfers.slots) == window - 1
        run_steps(engine, data[2:])
        shrunk = engine.stronghold_report()["placement"]["longer_batches"]
        assert shrunk[0]["tokens_before"] == 16 and shrunk[0]["tokens"] == 32 and shrunk[0]["extra_bytes"] > 0
        final = (runtime.resident_count, max(runtime.window_size, 2))
        trained = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
        engine.destroy()
        del engine, runtime
        fixed = _capped_engine(2.5, {"resident_blocks": final[0], "window_size": final[1]}, gas=4, checkpointing=True)
        run_steps(fixed, data)
        placed = named_params(fixed.module)
        fixed.destroy()
        assert _distance(trained, placed) <= 1e-5
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
