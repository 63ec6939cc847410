"""The first optimizer steps' host time by phase in the report (engine/first_step.py), on the CPU."""
from stronghold.engine.first_step import STEPS_CLOCKED

from .helpers import batches, ds_config, tiny_llama, train_stronghold


def test_the_report_holds_the_first_optimizer_steps_phases_in_order_and_no_later_ones():
    steps = STEPS_CLOCKED + 1
    engine, _ = train_stronghold(tiny_llama(), batches(2 * steps), ds_config(window=2, resident=1, gas=2))
    first = engine.stronghold_report()["first_step"]
    phases = first["phases_s"]
    assert first["complete"]
    micro_step = ["forward.placement", "forward", "backward", "step.update", "step.placement"]
    boundary = ["forward.placement", "forward", "backward", "step.wait", "step.update", "step.placement"]
    expected = [(step, name) for step in range(1, STEPS_CLOCKED + 1) for name in micro_step + boundary]
    assert [(p["step"], p["phase"]) for p in phases] == expected, "two micro-steps a step, then nothing"
    assert phases[0]["start"] == 0
    rounding = 2e-4  # start and seconds are rounded to 0.1 ms each
    for before, after in zip(phases, phases[1:]):
        assert after["start"] >= before["start"] + before["seconds"] - rounding, "one phase after the other"
    assert all(p["seconds"] >= 0 for p in phases)


def test_the_report_holds_the_engines_set_up_by_part_within_its_whole():
    engine, _ = train_stronghold(tiny_llama(), batches(2), ds_config(window=2, resident=1, gas=1))
    set_up = engine.stronghold_report()["set_up"]
    parts = set_up["parts_s"]
    assert list(parts) == ["plan_s", "layout_s", "resident_to_device_s", "host_buffers_s", "cached_parts_s",
                           "resident_optimizer_s", "cpu_optimizer_and_window_s", "placement_rates_s",
                           "compile_set_up_s"], "each part once, in construction order"
    assert all(seconds >= 0 for seconds in parts.values())
    assert sum(parts.values()) <= set_up["engine_s"], "the parts lie within the engine's construction"
    set_up["parts_s"].clear()
    assert engine.stronghold_report()["set_up"]["parts_s"], "the report hands out a copy"
