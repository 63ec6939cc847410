"""examples/bench/host_plans.py: the start-up plan of a real shape, computed on the meta device."""
from examples.bench import host_plans

TINY = dict(cls="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000)


def test_a_plan_that_fits_and_one_refused_name_their_commit_and_that_no_device_measured_them():
    spec = host_plans._spec(TINY)
    roomy = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=100.0)
    assert roomy["fits"] and roomy["host_GB"]["needed"] <= 100.0 and roomy["gpu_GB"]["needed"] <= 1.0
    assert roomy["commit"] and roomy["device"].startswith("none") and roomy["config"]["gpu_cap_GB"] == 1.0
    refused = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=1e-6)
    assert not refused["fits"] and "does not fit host memory" in refused["refusal"]


def test_two_ranks_plan_the_node_with_the_rest_on_the_host():
    """The Llama-3-8B shape on two 24 GiB ranks of a 240 GiB host: the parts outside the blocks cached (sharded over
    the ranks), as on one rank; the record names the ranks."""
    record = host_plans.plan_record("llama3-8b", host_plans._spec(host_plans.SHAPES["llama3-8b"]), cap_gb=24.0,
                                    host_gb=240.0, local_ranks=2)
    assert record["fits"] and record["config"]["local_ranks"] == 2
    assert record["rest_tiers"] == {"input": "cached", "output": "cached"} and record["gpu_GB"]["needed"] <= 24.0


def test_with_a_drive_the_plan_names_the_blocks_on_it():
    """Where host memory falls short, a drive given puts the fewest blocks' states on it; the record has the drive."""
    spec = host_plans._spec(dict(TINY, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                 num_attention_heads=8, num_key_value_heads=4))
    roomy = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=100.0, drive=(10.0, 2.0, 2.0))
    assert roomy["fits"] and roomy["nvme_blocks"] == 0 and roomy["config"]["drive"]["free_GB"] == 10.0
    host, record = None, roomy
    while record["fits"]:  # just under each plan's need, until none fits without the drive
        host = record["host_GB"]["needed"] - 1e-6
        record = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=host)
    short = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=host, drive=(10.0, 2.0, 2.0))
    assert short["fits"] and short["nvme_blocks"] > 0 and short["predicted_nvme_s"] > 0


def test_the_blockwise_plan_needs_no_accumulators_and_leaves_the_kept_inputs_room():
    """With `--blockwise` the record plans the blockwise backward: no fp32 accumulators for the streamed blocks, fp32
    gradient buffers instead, and the kept inputs' host slots off the host budget: planned as a host that much
    smaller."""
    shape = dict(TINY, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4)
    spec = host_plans._spec(shape)
    kept = host_plans.kept_input_bytes(shape)
    assert kept == 7 * 8 * 2048 * 1024 * 2
    roomy = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=100.0, kept_bytes=kept)
    assert roomy["fits"] and roomy["config"]["stronghold"] == {"blockwise_backward": True}
    assert roomy["config"]["kept_inputs_GB"] == kept / host_plans.GIB and roomy["resident_blocks"] < 8
    host_accumulation = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=100.0)
    assert host_accumulation["host_GB"]["accumulators"] > roomy["host_GB"]["accumulators"]
    differs = 0
    for host in (100.0, *(6.0 + 0.05 * step for step in range(9))):  # across where the slots decide what fits
        with_slots = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=host, kept_bytes=kept)
        less = host - kept / host_plans.GIB
        less_host = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=less, kept_bytes=0)
        assert with_slots["fits"] == less_host["fits"] and with_slots["config"]["host_budget_GB"] == host
        stores = [{k: v for k, v in record.get("host_GB", {}).items() if k not in ("needed", "margin")}
                  for record in (with_slots, less_host)]  # the margin is a share of the budget given
        assert stores[0] == stores[1] and with_slots.get("resident_blocks") == less_host.get("resident_blocks")
        without = host_plans.plan_record("tiny", spec, cap_gb=1.0, host_gb=host, kept_bytes=0)
        differs += (without["fits"], without.get("host_GB")) != (with_slots["fits"], with_slots.get("host_GB"))
    assert differs, "the case in question: hosts whose plan the slots change"
