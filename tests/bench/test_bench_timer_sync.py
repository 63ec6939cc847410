"""timer_sync: DeepSpeed's throughput timer synchronized and not, alternated in one run (a tiny model on the CPU)."""
import json

from examples.bench.timer_sync import arms, main, pair_ratios


def test_the_arms_alternate_so_a_drift_weighs_on_both():
    assert arms(8) == [True, False, False, True, True, False, False, True]
    assert arms(2) == [True, False]


def test_each_pair_is_unsynchronized_over_synchronized_whichever_ran_first():
    # Steps 1.5 s shorter from the fifth on (a change of regime) leave each pair's ratio whole; an odd last step
    # has no pair.
    assert pair_ratios(arms(6), [4.0, 3.6, 3.8, 4.2, 2.5, 2.0]) == [3.6 / 4.0, 3.8 / 4.2, 2.0 / 2.5]
    assert pair_ratios(arms(5), [4.0, 3.6, 3.8, 4.2, 2.5]) == [3.6 / 4.0, 3.8 / 4.2]


def test_a_run_records_both_arms_and_every_loss(tmp_path):
    out = tmp_path / "timer_sync.jsonl"
    assert main(["--system", "stronghold", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32",
                 "--batch", "1", "--accumulation", "2", "--vocab", "256", "--gpu-cap-gb", "none",
                 "--warmup-steps", "1", "--timed-steps", "4", "--out", str(out), "--same-call", "test"]) == 0
    record = json.loads(out.read_text())
    assert record["order"] == ["S", "U", "U", "S"] and record["same_call"] == "test"
    assert [len(record["step_s"][arm]) for arm in ("synchronized", "unsynchronized")] == [2, 2]
    assert record["unsynchronized_over_synchronized"] == (record["median_s"]["unsynchronized"]
                                                          / record["median_s"]["synchronized"])
    assert record["pairwise_unsynchronized_over_synchronized"] == [
        record["step_s"]["unsynchronized"][0] / record["step_s"]["synchronized"][0],
        record["step_s"]["unsynchronized"][1] / record["step_s"]["synchronized"][1]]
    assert len(record["losses"]) == 5 and all(len(step) == 2 for step in record["losses"])
    assert len(record["grad_norms"]) == 5 and all(norm > 0 for norm in record["grad_norms"])
