"""The first optimizer step's host time by phase in the report (engine/first_step.py), on the CPU."""
from .helpers import batches, ds_config, tiny_llama, train_stronghold


def test_the_report_holds_the_first_optimizer_steps_phases_in_order_and_no_later_ones():
    engine, _ = train_stronghold(tiny_llama(), batches(6), ds_config(window=2, resident=1, gas=2))
    first = engine.stronghold_report()["first_step"]
    phases = first["phases_s"]
    assert first["complete"]
    assert [p["phase"] for p in phases] == ["forward", "backward", "step"] * 2, "two micro-steps, then nothing"
    assert phases[0]["start"] == 0
    rounding = 2e-4  # start and seconds are rounded to 0.1 ms each
    for before, after in zip(phases, phases[1:]):
        assert after["start"] >= before["start"] + before["seconds"] - rounding, "one phase after the other"
    assert all(p["seconds"] >= 0 for p in phases)
