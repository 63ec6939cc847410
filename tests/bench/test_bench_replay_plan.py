"""examples/bench/replay_plan.py: a measured run's placement replayed through the planner on the CPU."""
import pytest

from examples.bench import replay_plan

GIB = 2 ** 30
RECORD = dict(kind="config", arch="llama", hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=1000,
              seq=32, batch=2, accumulation=4, dtype="bf16", label="stronghold:1", commit="abc1234", step_s=1.0,
              same_call="a-call")
RATES = dict(h2d_bytes_per_s=5e10, d2h_bytes_per_s=5e10, cpu_adam_params_per_s=1e9, gpu_s_per_block=1e-3,
             gpu_s_fixed=0.0)


def _record(gpu_bytes: int, built: int = 2) -> dict:
    plan = dict(gpu_budget_bytes=gpu_bytes, host_budget_bytes=100 * GIB, host=dict(local_ranks=1),
                rest_tiers={"input": "resident", "output": "resident"}, gradient_spares=True, compact_master=False,
                pooled_grads=False, resident_blocks=built, window_size=2, predicted_step_s=1.0)
    measured = dict(activations_bytes=2 ** 20, rates=RATES)
    return dict(RECORD, stronghold=dict(placement=dict(plan=plan, measured=measured)))


def test_the_replay_is_the_planners_choice_from_the_records_own_measurements():
    from stronghold.planning import planner
    record = _record(gpu_bytes=GIB)
    spec = replay_plan.spec_of(record)
    assert len(spec.blocks) == 4 and spec.accumulation_steps == 4
    result = replay_plan.replay(record)
    auto, built, more = result["variants"]
    expected = planner.plan(spec, planner.Activations(fixed_peak_bytes=2 ** 20, per_block_bytes=0),
                            planner.Budgets(gpu_bytes=GIB, host_bytes=100 * GIB), planner.Rates(**RATES),
                            activation_blocks=0, lean_until=0, nvme_from=4, gpu_accumulation=None)
    assert auto["fits"] and (auto["resident_blocks"], auto["window_size"]) == (expected.resident_blocks,
                                                                               expected.window_size)
    assert auto["predicted_step_s"] == pytest.approx(expected.predicted_step_s)
    assert built["resident_blocks_asked"] == 2 and built["resident_blocks"] == 2 and more["resident_blocks"] == 3
    assert result["device"].startswith("none") and result["source"]["same_call"] == "a-call"


def test_a_record_without_its_mlp_width_takes_llamas_rule_and_qwen2_keeps_its_biases():
    from examples.llama import default_intermediate
    llama = dict(RECORD, hidden=96)
    del llama["intermediate"]
    width = default_intermediate(96)
    spec = replay_plan.spec_of(llama)
    # q, o: h x h; k, v: h x (kv heads x head dim); gate, up, down: h x I; two norms: h.
    kv = 2 * (96 // 4)
    block = 2 * 96 * 96 + 2 * 96 * kv + 3 * 96 * width + 2 * 96
    assert spec.blocks[0].numel == block
    qwen2 = replay_plan.spec_of(dict(llama, arch="qwen2"))
    assert qwen2.blocks[0].numel == block + 96 + 2 * kv, "the q, k and v biases"


def test_a_residency_over_the_budget_is_reported_as_refused():
    result = replay_plan.replay(_record(gpu_bytes=GIB // 1000, built=3))
    assert not any(v["fits"] for v in result["variants"])
    assert all("does not fit the GPU" in v["refusal"] for v in result["variants"])


def test_the_floors_set_the_built_placements_host_sums_beside_gpu_sums():
    from stronghold.planning import plan_floor, planner
    record = _record(gpu_bytes=GIB)
    slow_link = dict(RATES, d2h_bytes_per_s=1e6, deferred_share=1.0)  # the gradients' copies bound the step
    record["stronghold"]["placement"]["measured"]["rates"] = slow_link
    floors = replay_plan.replay(record)["floors"]
    spec = replay_plan.spec_of(record)
    rates = planner.Rates(**slow_link)
    host, _, host_d2h = plan_floor.floor_terms(spec, rates, 2, 2, gpu_accumulation=False)
    gpu, _, gpu_d2h = plan_floor.floor_terms(spec, rates, 2, 2, gpu_accumulation=True)
    assert floors["host_sums"]["step_floor_s"] == pytest.approx(host.step_s)
    assert floors["gpu_sums"]["step_floor_s"] == pytest.approx(gpu.step_s)
    streamed = sum(b.trainable_numel for b in spec.blocks[2:])
    assert host_d2h == 2 * 4 * streamed and gpu_d2h == 4 * streamed  # bf16 each micro-step against fp32 once
    assert floors["gpu_sums"]["terms_s"]["d2h_s"] == pytest.approx(gpu_d2h / slow_link["d2h_bytes_per_s"])
    early = floors["gpu_sums_early"]
    assert early["deferred_share"] == 0.0 and floors["gpu_sums"]["deferred_share"] == 1.0
    assert early["step_floor_s"] <= floors["gpu_sums"]["step_floor_s"] < floors["host_sums"]["step_floor_s"]


def test_the_schedules_weigh_host_accumulation_against_the_blockwise_backward_at_the_built_placement():
    from stronghold.planning import plan_blockwise, plan_floor, planner
    record = _record(gpu_bytes=GIB)
    ways = replay_plan.replay(record)["schedules"]
    spec, rates = replay_plan.spec_of(record), planner.Rates(**RATES)
    kept = 3 * 2 * 32 * 64 * 2 * 4  # blocks after the first x batch x seq x hidden x bf16 x micro-batches
    assert replay_plan.kept_bytes(spec, record) == kept
    assert ways["host_accumulation_s"] == pytest.approx(plan_floor.floor_terms(spec, rates, 2, 2)[0].step_s)
    blockwise = plan_blockwise.floor_terms(spec, rates, 2, 2, frozenset(), kept)[0]
    assert ways["blockwise_s"] == pytest.approx(blockwise.step_s)
    assert ways["measured_blockwise"] is False
    record["stronghold"]["blockwise_backward"] = True
    assert replay_plan.replay(record)["schedules"]["measured_blockwise"] is True
    # The report says what ran: a run configured `false` by a script whose command line names the setting did not.
    record["stronghold"]["blockwise_backward"] = False
    record["script"] = "run_one --stronghold '{\"blockwise_backward\": false}'"
    assert replay_plan.replay(record)["schedules"]["measured_blockwise"] is False



def test_the_choice_after_the_first_step_is_weighed_again_where_the_run_weighed_it():
    """A run that weighed the blockwise backward (its report's `schedules`) has that choice made again from its first
    step's measurements and start-up plan, beside what it recorded; a run that did not has none."""
    import dataclasses
    from stronghold.planning import plan_inputs, planner, schedule_choice
    record = _record(gpu_bytes=GIB)
    assert replay_plan.replay(record)["choice"] is None
    placement = record["stronghold"]["placement"]
    placement["initial_plan"] = dict(placement["plan"], resident_blocks=1)
    placement["measured"]["schedules"] = {"blockwise": False, "blockwise_s": 1.0, "blockwise_window": 2,
                                          "host_accumulation_s": 1.0}
    placement["measured"]["first_forward"] = {"resident_blocks": 2}
    got = replay_plan.replay(record)["choice"]
    assert got["recorded"] == placement["measured"]["schedules"] and got["margin"] == schedule_choice.MARGIN
    spec = replay_plan.spec_of(record)
    budget = planner.Budgets(gpu_bytes=GIB, host_bytes=100 * GIB)
    activations = planner.Activations(fixed_peak_bytes=2 ** 20, per_block_bytes=0)
    fixed = dict(window_size=None, activation_blocks=0, lean_until=0, nvme_from=4, nvme_shrink=True,
                 gpu_accumulation=None, gradient_spares=True, compact_master=False, pooled_grads=False,
                 blockwise=False, rest_tiers=plan_inputs.built_tiers(spec, frozenset()))
    host = planner.plan(spec, activations, budget, planner.Rates(**RATES), **fixed)
    assert host.resident_blocks >= 2, "the case in question: the planner's own residency, not fewer than built"
    weighed = schedule_choice.weigh(spec, budget, planner.Rates(**RATES), host, activations, 2 * 32 * 64 * 2, True,
                                    fixed, None, 2)[2]
    assert got["now"] == dataclasses.asdict(weighed) and got["now"]["blockwise_s"] is not None


def test_the_blockwise_plans_cover_each_residency_up_to_one_more_than_built():
    from stronghold.planning import plan_blockwise, planner
    record = _record(gpu_bytes=GIB, built=1)
    spec, rates = replay_plan.spec_of(record), planner.Rates(**RATES)
    rows = replay_plan.replay(record)["blockwise_residencies"]
    assert [row["resident_blocks"] for row in rows] == [0, 1, 2] and all(row["fits"] for row in rows)
    for row in rows:
        # With accumulation the window is every streamed block that fits: here all of them.
        assert row["window_size"] == 4 - row["resident_blocks"]
        expected = plan_blockwise.floor_terms(spec, rates, row["resident_blocks"], row["window_size"], frozenset(),
                                              replay_plan.kept_bytes(spec, record),
                                              replay_plan.block_input_bytes(record))[0]
        assert row["blockwise_s"] == pytest.approx(expected.step_s)
    # A budget that holds no block and no window: each residency reports its refusal.
    tight = replay_plan.replay(_record(gpu_bytes=2 ** 20, built=1))["blockwise_residencies"]
    assert [row["fits"] for row in tight] == [False, False, False] and "does not fit" in tight[0]["refusal"]
