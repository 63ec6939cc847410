"""examples/bench/floor_ratio.py: the host-DRAM floor term and the split of steps by clipping regime, on a synthetic
record whose arithmetic is checked by hand."""
import json

import pytest

from examples.bench.floor_ratio import floor_terms, main, summarize

FLOOR = {"streamed_trainable_params": 1_000_000_000, "cpu_adam_params_per_s": 4e9, "cpu_optim_s": 0.25,
         "gpu_compute_s": 0.2, "h2d_s": 0.1, "h2d_GBps": 40.0, "d2h_s": 0.05, "d2h_GBps": 40.0}


def _record(**extra):
    per_step = [{"deferred_blocks": 10}, {"deferred_blocks": 3}, {"deferred_blocks": 2}, {"deferred_blocks": 0}]
    return {"system": "stronghold", "commit": "abc1234", "layers": 12, "clipping": 1.0, "floor": FLOOR,
            "step_s_all": [0.6, 0.5, 0.4, 0.3], "per_step": per_step, **extra}


def test_host_dram_term_adds_the_copies_to_the_update_at_the_kernel_rate():
    # update 28 B x 1e9 = 28 GB; copies 0.1 s x 40 GB/s + 0.05 s x 40 GB/s = 6 GB; rate 28 x 4e9 = 112 GB/s
    assert floor_terms(FLOOR)["host_dram_s"] == pytest.approx(34e9 / 112e9, rel=1e-12)


def test_inactive_steps_skip_the_fully_deferred_ones_and_the_first_after_them():
    row = summarize(_record())
    assert row["largest_term"] == "host_dram_s"
    assert row["inactive_steps_s"] == [0.4, 0.3]  # 0.6 deferred all 10; 0.5 paid for it
    assert row["median_over_largest"] == pytest.approx(0.45 / (34 / 112), rel=1e-12)
    assert row["inactive_median_over_largest"] == pytest.approx(0.35 / (34 / 112), rel=1e-12)


def test_records_without_a_floor_or_of_other_systems_are_left_out(tmp_path):
    assert summarize(_record(system="zero_offload")) is None
    assert summarize(_record(floor=None)) is None
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_record(system="zero_offload")) + "\n")
    assert main([str(path)]) == 1, "nothing to summarize is a failure, not an empty success"
    path.write_text(json.dumps(_record()) + "\n")
    out = tmp_path / "s.json"
    assert main([str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["inactive_steps_s"] == [0.4, 0.3]
