"""The pure placement planner: tiers, window rule, byte accounting, budgets at the edge, floor terms."""
import dataclasses
import json

import pytest

from stronghold.planning import plan_text
from stronghold.planning.plan_search import largest_fitting_window
from stronghold.planning.planner import (
    GIB, Activations, BlockSpec, Budgets, ModelSpec, Rates, Tier, plan,
)

N = 1_000_000      # elements per synthetic block
SQ = 4             # host bytes of a store's gradient sum of squares (store.py `grad_sq`, one fp32)
REST = 500_000     # embeddings + head of the synthetic model
MIB = 2 ** 20


def model(n_blocks=4, numel=N, trainable=None, rest=REST, rest_trainable=None, compute_bytes=2, accumulation_steps=1):
    block = BlockSpec(numel=numel, trainable_numel=numel if trainable is None else trainable)
    return ModelSpec(blocks=(block,) * n_blocks, rest_numel=rest,
                     rest_trainable_numel=rest if rest_trainable is None else rest_trainable,
                     compute_bytes=compute_bytes, accumulation_steps=accumulation_steps)


ACTS = Activations(fixed_peak_bytes=3_000_000, per_block_bytes=100_000)
# One bf16 block (2 MB) loads in 2 ms and computes in 2 ms: one block of lookahead hides it.
FAST = Rates(h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9, cpu_adam_params_per_s=1e8, gpu_s_per_block=0.002,
             gpu_s_fixed=0.003)


def rates(h2d_bytes_per_s):
    return Rates(h2d_bytes_per_s=h2d_bytes_per_s, d2h_bytes_per_s=2e9, cpu_adam_params_per_s=1e8,
                 gpu_s_per_block=0.002, gpu_s_fixed=0.003)


def budgets(gpu, host=10 ** 12):
    """Zero margins so that 'exactly enough' is the plan's own byte count."""
    return Budgets(gpu_bytes=gpu, host_bytes=host, gpu_margin_bytes=0, host_margin_bytes=0)


def needed(m, resident, window, r=FAST, acts=ACTS):
    """GPU and host bytes of a given placement, read off a plan with room to spare."""
    p = plan(m, acts, budgets(10 ** 15), r, resident_blocks=resident, window_size=window or None)
    return p.gpu.needed, p.host.needed


# Tiers -------------------------------------------------------------------------------------------
def test_huge_gpu_keeps_everything_resident_and_streams_nothing():
    p = plan(model(), ACTS, budgets(10 ** 12, host=0), FAST)
    assert p.resident_blocks == 4 and p.window_size == 0 and p.window_wanted == 0
    assert p.tiers == (Tier.RESIDENT,) * 4
    assert p.host.total == 0 and p.gpu.window == 0
    assert p.h2d_bytes_per_step == p.d2h_bytes_per_step == 0
    # No streaming: the step is plain GPU compute.
    assert p.predicted_step_s == pytest.approx(0.003 + 4 * 0.002)


def test_tiny_gpu_streams_every_block_with_two_slots():
    m = model()
    slow = rates(2.5e8)  # 8 ms per block load: the rule wants 5 slots, capped at the 4 streamed
    gpu, _ = needed(m, resident=0, window=2, r=slow)
    p = plan(m, ACTS, budgets(gpu), slow)
    assert (p.resident_blocks, p.window_size, p.window_wanted) == (0, 2, 4)
    assert p.tiers == (Tier.STREAMED,) * 4
    assert "rule wanted 4; GPU memory" in plan_text.table(p)


def test_gpu_too_small_for_the_smallest_plan_fails_with_numbers():
    m = model()
    gpu, _ = needed(m, resident=0, window=2)
    with pytest.raises(MemoryError) as err:
        plan(m, ACTS, budgets(gpu - 1), FAST)
    message = str(err.value)
    assert "resident_blocks=0" in message and "does not fit the GPU" in message
    assert f"{gpu / GIB:.2f} GiB" in message and f"{(gpu - 1) / GIB:.2f} GiB" in message
    for part in ("resident blocks", "window", "activations", "margin"):
        assert part in message
    assert "micro-batch" in message and "gradient checkpointing" in message and "gpu_memory_limit_gb" in message


def test_the_largest_resident_count_that_fits_wins():
    m = model(n_blocks=8)
    gpu, _ = needed(m, resident=5, window=2)
    p = plan(m, ACTS, budgets(gpu), FAST)
    assert p.resident_blocks == 5 and p.window_size == 2
    assert p.tiers == (Tier.RESIDENT,) * 5 + (Tier.STREAMED,) * 3


def test_host_too_small_to_stream_everything_is_fine_when_the_gpu_holds_enough():
    m = model(n_blocks=8)
    gpu, host_for_3 = needed(m, resident=5, window=2)
    p = plan(m, ACTS, budgets(gpu, host=host_for_3), FAST)
    assert p.resident_blocks == 5
    # The same host with fewer resident blocks (more streamed) does not fit: residency is forced.
    with pytest.raises(MemoryError, match="does not fit host memory"):
        plan(m, ACTS, budgets(gpu, host=host_for_3), FAST, resident_blocks=4)


def test_both_too_small_fails_with_host_numbers_and_knobs():
    m = model(n_blocks=8)
    gpu, host_for_3 = needed(m, resident=5, window=2)
    with pytest.raises(MemoryError) as err:
        plan(m, ACTS, budgets(gpu, host=host_for_3 - 1), FAST)
    message = str(err.value)
    assert "3 streamed blocks with resident_blocks=5" in message
    assert f"need {host_for_3 / GIB:.2f} GiB" in message
    for part in ("master + Adam moments", "working copies", "gradient buffers", "accumulators", "margin"):
        assert part in message
    assert "host RAM" in message and "resident" in message and "GPU cap" in message


# Budgets at the edge -------------------------------------------------------------------------------
@pytest.mark.parametrize("resident,window", [(0, 2), (2, 2), (1, 3), (4, 0)])
def test_gpu_budget_exactly_enough_passes_and_one_byte_less_fails(resident, window):
    m = model()
    gpu, _ = needed(m, resident, window)
    p = plan(m, ACTS, budgets(gpu), FAST, resident_blocks=resident, window_size=window or None)
    assert p.gpu.needed == gpu and (p.resident_blocks, p.window_size) == (resident, window)
    with pytest.raises(MemoryError, match="does not fit the GPU"):
        plan(m, ACTS, budgets(gpu - 1), FAST, resident_blocks=resident, window_size=window or None)


def test_one_gpu_byte_less_without_overrides_picks_the_next_smaller_plan():
    m = model()
    gpu, _ = needed(m, resident=4, window=0)
    assert plan(m, ACTS, budgets(gpu), FAST).resident_blocks == 4
    assert plan(m, ACTS, budgets(gpu - 1), FAST).resident_blocks == 3


def test_host_budget_exactly_enough_passes_and_one_byte_less_fails():
    m = model()
    _, host = needed(m, resident=1, window=2)
    p = plan(m, ACTS, budgets(10 ** 12, host=host), FAST, resident_blocks=1)
    assert p.host.needed == host
    with pytest.raises(MemoryError, match="does not fit host memory"):
        plan(m, ACTS, budgets(10 ** 12, host=host - 1), FAST, resident_blocks=1)


def test_data_parallel_ranks_of_a_node_share_its_host_budget():
    """Two ranks on a node: one shared working copy, the fp32 states and gradient buffers split in two, so the
    node needs what one rank alone needs (and the same budget passes or fails), each rank half the private part."""
    m = model(accumulation_steps=2)
    _, host = needed(m, resident=1, window=2)
    one = plan(m, ACTS, budgets(10 ** 12, host=host), FAST, resident_blocks=1)
    two = plan(m, ACTS, Budgets(gpu_bytes=10 ** 12, host_bytes=host, gpu_margin_bytes=0, host_margin_bytes=0,
                                local_ranks=2), FAST, resident_blocks=1)
    assert two.host.needed == one.host.needed == host
    # master + moments + two bf16 gradient buffers (one micro-step's wait while the next lands) + fp32 accumulator
    streamed, private = 3 * N, 3 * N * (4 + 8 + 2 * 2 + 4) + 3 * SQ
    assert one.host.working == two.host.working == streamed * 2
    assert one.host.per_rank_private == private and two.host.per_rank_private == private // 2
    # Each rank's predicted RSS: its half of the private part and the shared working copy it maps.
    assert one.host_rss_bytes == one.host.total and two.host_rss_bytes == private // 2 + streamed * 2
    with pytest.raises(MemoryError, match="does not fit host memory"):
        plan(m, ACTS, Budgets(gpu_bytes=10 ** 12, host_bytes=host - 1, gpu_margin_bytes=0, host_margin_bytes=0,
                              local_ranks=2), FAST, resident_blocks=1)
    with pytest.raises(ValueError, match="local_ranks"):
        Budgets(gpu_bytes=1, host_bytes=1, local_ranks=0)


def test_default_margins():
    assert Budgets(gpu_bytes=32 * GIB, host_bytes=100 * GIB).gpu_margin_bytes == int(0.05 * 32 * GIB)
    assert Budgets(gpu_bytes=4 * GIB, host_bytes=100 * GIB).gpu_margin_bytes == 512 * MIB
    assert Budgets(gpu_bytes=4 * GIB, host_bytes=100 * GIB).host_margin_bytes == 5 * GIB
    assert Budgets(gpu_bytes=4 * GIB, host_bytes=16 * GIB).host_margin_bytes == 4 * GIB  # the minimum
    p = plan(model(), ACTS, Budgets(gpu_bytes=GIB, host_bytes=100 * GIB), FAST)
    assert p.gpu.margin == 512 * MIB and p.host.margin == 5 * GIB


# Overrides ------------------------------------------------------------------------------------------
def test_overrides_are_honoured_even_when_more_would_fit():
    p = plan(model(n_blocks=8), ACTS, budgets(10 ** 12), FAST, resident_blocks=2, window_size=5)
    assert (p.resident_blocks, p.window_size) == (2, 5)
    p = plan(model(n_blocks=8), ACTS, budgets(10 ** 12), rates(2.5e8), resident_blocks=2)
    assert (p.resident_blocks, p.window_size) == (2, 5)  # window from the rule: 1 + ceil(8 ms / 2 ms)


def test_overrides_are_clamped_like_the_runtime():
    p = plan(model(), ACTS, budgets(10 ** 12), FAST, resident_blocks=100, window_size=4)
    assert (p.resident_blocks, p.window_size) == (4, 0)
    p = plan(model(), ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=8)
    assert p.window_size == 3


def test_overrides_that_do_not_fit_raise_and_name_the_knob():
    m = model()
    gpu, _ = needed(m, resident=1, window=2)
    with pytest.raises(MemoryError) as err:
        plan(m, ACTS, budgets(gpu), FAST, resident_blocks=3)
    assert 'lower "resident_blocks"' in str(err.value) and "resident_blocks=3" in str(err.value)
    with pytest.raises(MemoryError, match='"window_size"'):
        plan(m, ACTS, budgets(gpu), FAST, resident_blocks=1, window_size=3)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(resident_blocks=-1), "resident_blocks must be >= 0"),
    (dict(window_size=1), "window_size must be >= 2"),
])
def test_bad_overrides_are_value_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        plan(model(), ACTS, budgets(10 ** 12), FAST, **kwargs)


@pytest.mark.parametrize("build,needle", [
    (lambda: BlockSpec(numel=10, trainable_numel=11), "trainable_numel <= numel"),
    (lambda: model(compute_bytes=3), "compute_bytes must be 2"),
    (lambda: model(accumulation_steps=0), "accumulation_steps"),
    (lambda: model(rest=5, rest_trainable=6), "rest_trainable_numel <= rest_numel"),
    (lambda: ModelSpec(blocks=(), rest_numel=0, rest_trainable_numel=0, compute_bytes=2), "at least one"),
    (lambda: rates(0.0), "h2d_bytes_per_s must be a positive"),
    (lambda: Activations(fixed_peak_bytes=-1, per_block_bytes=0), "activation bytes"),
    (lambda: Budgets(gpu_bytes=0, host_bytes=1), "budgets"),
    (lambda: Budgets(gpu_bytes=1, host_bytes=1, gpu_margin_bytes=-1), "margins"),
])
def test_bad_specs_are_value_errors(build, needle):
    with pytest.raises(ValueError, match=needle):
        build()


# Window rule ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("h2d,n_blocks,expected", [
    (1e10, 8, 2),     # 0.2 ms per load: the minimum of two slots
    (1e9, 8, 2),      # 2 ms load / 2 ms compute: exactly one block ahead
    (4e8, 8, 4),      # 5 ms: three blocks ahead
    (1e8, 16, 8),     # 20 ms: ten ahead wanted, capped at 8 slots
    (1e8, 4, 4),      # capped at the 4 streamed blocks
])
def test_window_rule(h2d, n_blocks, expected):
    p = plan(model(n_blocks=n_blocks), ACTS, budgets(10 ** 12), rates(h2d), resident_blocks=0)
    assert p.window_size == p.window_wanted == expected


def test_one_streamed_block_gets_one_slot():
    p = plan(model(), ACTS, budgets(10 ** 12), FAST, resident_blocks=3)
    assert p.window_size == 1


def test_tight_memory_takes_slots_before_resident_blocks():
    m = model(n_blocks=8)
    slow = rates(4e8)  # the rule wants 4 slots
    gpu, _ = needed(m, resident=5, window=2, r=slow)
    p = plan(m, ACTS, budgets(gpu), slow)
    # Four resident blocks with 4 slots would fit too, but a resident block removes transfers and
    # CPU work while two slots only hide less latency.
    assert needed(m, resident=4, window=4, r=slow)[0] <= gpu
    assert (p.resident_blocks, p.window_size, p.window_wanted) == (5, 2, 3)


# Byte accounting ------------------------------------------------------------------------------------
def test_bf16_bytes_by_part():
    # Blocks with 200k frozen elements each; the rest has 100k frozen elements.
    m = model(trainable=800_000, rest_trainable=400_000)
    p = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2)
    assert p.gpu.resident == 1_000_000 * 2 + 800_000 * (2 + 4 + 8)
    assert p.gpu.rest == 500_000 * 2 + 400_000 * (2 + 4 + 8)
    assert p.gpu.window == 2 * 1_000_000 * 2
    # One resident chunk's fp32 gradient (the block's 800k) + two streamed blocks' bf16 gradients.
    assert p.gpu.transients == 800_000 * 4 + 2 * 800_000 * 2
    assert p.gpu.activations == 3_000_000 + 4 * 100_000
    assert p.host.master_and_moments == 3 * 800_000 * 12
    assert p.host.working == 3 * 1_000_000 * 2
    assert p.host.grads == 3 * 800_000 * 2 + 3 * SQ
    assert p.host.accumulators == 0
    assert p.host.total == 3 * (800_000 * 16 + 200_000 * 2 + SQ)


def test_fp32_bytes_by_part():
    m = model(trainable=800_000, rest_trainable=400_000, compute_bytes=4)
    p = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2)
    # fp32: the weight is the master, no separate copy and no upcast gradient.
    assert p.gpu.resident == 1_000_000 * 4 + 800_000 * (4 + 8)
    assert p.gpu.rest == 500_000 * 4 + 400_000 * (4 + 8)
    assert p.gpu.window == 2 * 1_000_000 * 4
    assert p.gpu.transients == 2 * 800_000 * 4
    assert p.host.master_and_moments == 3 * 800_000 * 8
    assert p.host.working == 3 * 1_000_000 * 4
    assert p.host.grads == 3 * 800_000 * 4 + 3 * SQ
    # Both modes: 16 bytes per trainable parameter wherever it lives.
    assert p.host.total == 3 * (800_000 * 16 + 200_000 * 4 + SQ)


def test_accumulation_adds_a_host_fp32_accumulator_and_cpu_passes():
    one, four = model(), model(accumulation_steps=4)
    # The window fixed at 2: with accumulation an "auto" window takes every streamed block that fits.
    p1 = plan(one, ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2)
    p4 = plan(four, ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2)
    assert p4.host.accumulators == 3 * N * 4 and p1.host.accumulators == 0
    # Resident gradients accumulate in an fp32 accumulator on the GPU (gpu_optim.py): +4 B each.
    assert p4.gpu.resident - p1.gpu.resident == 4 * one.blocks[0].trainable_numel
    assert p4.gpu.rest - p1.gpu.rest == 4 * one.rest_trainable_numel
    # Every pass moves the gradients again and the CPU adds 4 accumulation passes to AdamW. The weights
    # too, but for the W=2 blocks the last backward left in their slots (window.py takes them back): the
    # first pass loads 2S - W = 4 blocks, each later one 2(S - W) = 2.
    assert p4.h2d_bytes_per_step == p1.h2d_bytes_per_step + 3 * 2 * (3 - 2) * 2 * N
    assert p4.floor.gpu_s == pytest.approx(4 * p1.floor.gpu_s)
    assert p4.floor.cpu_adam_s == pytest.approx(p1.floor.cpu_adam_s * (1 + 4 * 10 / 28))


# Floor terms ----------------------------------------------------------------------------------------
def test_floor_terms_and_predicted_step_by_hand():
    p = plan(model(), ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2)
    # Streamed blocks 1, 2, 3; the last two stay for backward (one load), block 1 loads twice.
    assert p.h2d_bytes_per_step == 2 * (2 * 3 * N - 2 * N)
    assert p.d2h_bytes_per_step == 2 * 3 * N
    f = p.floor
    assert f.gpu_s == pytest.approx(0.003 + 4 * 0.002)
    assert f.h2d_s == pytest.approx(8e6 / 1e9)
    assert f.d2h_s == pytest.approx(6e6 / 2e9)
    assert f.cpu_adam_s == pytest.approx(3e6 / 1e8)
    # Block 1's D2H (1 ms) + update (10 ms) + H2D (2 ms), less one resident block's 2 ms of cover.
    assert f.cpu_tail_s == pytest.approx(0.001 + 0.010 + 0.002 - 0.002)
    assert p.predicted_step_s == pytest.approx(0.030 + 0.011)


def test_the_resident_adamw_on_the_gpu_adds_its_time_once_a_step():
    """Rates.gpu_adam_params_per_s: the resident blocks' and the rest's trainable parameters, once a step (not per
    pass of accumulation), on the GPU term and on the walk; the streamed blocks' updates are the CPU's."""
    import dataclasses
    adam = dataclasses.replace(FAST, gpu_adam_params_per_s=1e9)
    m = model(accumulation_steps=2)
    for resident, window in ((4, None), (1, 2)):
        without = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=resident, window_size=window).floor
        timed = plan(m, ACTS, budgets(10 ** 12), adam, resident_blocks=resident, window_size=window).floor
        on_gpu_s = (REST + resident * N) / 1e9
        assert timed.gpu_s == pytest.approx(without.gpu_s + on_gpu_s)
        assert timed.walk_s == pytest.approx(without.walk_s + on_gpu_s)
        assert timed.cpu_adam_s == without.cpu_adam_s
    with pytest.raises(ValueError, match="gpu_adam_params_per_s"):
        dataclasses.replace(FAST, gpu_adam_params_per_s=0.0)


def test_enough_resident_blocks_hide_the_cpu_tail():
    assert plan(model(n_blocks=12), ACTS, budgets(10 ** 12), FAST, resident_blocks=7).floor.cpu_tail_s == 0
    assert plan(model(n_blocks=12), ACTS, budgets(10 ** 12), FAST, resident_blocks=0).floor.cpu_tail_s > 0


# Reports --------------------------------------------------------------------------------------------
def test_table_and_as_dict():
    p = plan(model(n_blocks=8), ACTS, budgets(10 ** 12), FAST, resident_blocks=5, window_size=2)
    table = plan_text.table(p)
    assert "0-4       resident" in table and "5-7       streamed" in table
    assert "resident_blocks 5, window_size 2" in table
    for word in ("GPU", "host", "master+moments", "activations", "h2d", "d2h", "cpu adam", "predicted"):
        assert word in table
    d = json.loads(json.dumps(p.as_dict()))
    assert d["resident_blocks"] == 5 and d["window_size"] == 2
    assert d["tiers"] == ["resident"] * 5 + ["streamed"] * 3
    assert d["gpu"]["peak"] == p.gpu.peak and d["gpu"]["needed"] == p.gpu.needed
    assert d["host"]["total"] == p.host.total and d["host"]["accumulators"] == 0
    assert d["floor"]["cpu_adam_s"] == p.floor.cpu_adam_s
    assert d["predicted_step_s"] == p.predicted_step_s
    # The predicted peak RSS adds what the process held at planning; the budget check does not (the
    # available RAM it is checked against already excludes it), so the placement is the same.
    held = Budgets(gpu_bytes=10 ** 12, host_bytes=10 ** 12, host_process_bytes=3 * GIB)
    q = plan(model(n_blocks=8), ACTS, held, FAST, resident_blocks=5, window_size=2)
    assert q.as_dict()["host"]["rss"] == q.host_rss_bytes == p.host.total + 3 * GIB == q.host.total + 3 * GIB
    assert p.host_rss_bytes == p.host.total and "process peak RSS" in plan_text.table(q)
    with pytest.raises(ValueError, match="host_process_bytes"):
        Budgets(gpu_bytes=1, host_bytes=1, host_process_bytes=-1)


# A realistic case -----------------------------------------------------------------------------------
def gpt2_h2048(fixed_activation_bytes):
    """GPT-2 with hidden 2048 and 32 layers (1.72 B params), bf16, seq 1024, micro-batch 4:
    the checkpointed input of a block is 4 * 1024 * 2048 bf16 = 16 MiB."""
    h = 2048
    block = BlockSpec(numel=12 * h * h + 13 * h, trainable_numel=12 * h * h + 13 * h)
    rest = 50257 * h + 1024 * h + 2 * h  # tied wte/lm_head, wpe, final norm
    m = ModelSpec(blocks=(block,) * 32, rest_numel=rest, rest_trainable_numel=rest, compute_bytes=2)
    acts = Activations(fixed_peak_bytes=fixed_activation_bytes, per_block_bytes=16 * MIB)
    # H200-like rates (ARCHITECTURE.md): ~50 GB/s pinned copies, 5.66 G params/s CPU AdamW.
    r = Rates(h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, cpu_adam_params_per_s=5.66e9,
              gpu_s_per_block=0.0045, gpu_s_fixed=0.02)
    return m, acts, r


def test_gpt2_1_7b_under_a_32_gib_cap():
    m, acts, r = gpt2_h2048(fixed_activation_bytes=4 * GIB)
    p = plan(m, acts, Budgets(gpu_bytes=32 * GIB, host_bytes=120 * GIB), r)
    # 16 B per parameter makes a resident block 0.75 GiB. Of 32 GiB, the 5% margin (1.6), the rest of
    # the model (1.57), activations (4 + 0.5) and transients (0.58) leave room for 31 blocks and one
    # slot; 32 would need 0.46 GiB more. The hand-tuned sweep stopped at 28 (23.3 GiB measured peak,
    # with activations far below 4 GiB), so this is above the best measured, as it should be.
    assert p.resident_blocks == 31 and p.window_size == 1
    assert p.gpu.needed <= 32 * GIB
    assert p.floor.cpu_tail_s == 0 and p.predicted_step_s == pytest.approx(p.floor.gpu_s)
    # Each GiB of activations costs about 1.3 resident blocks: 6 GiB gives the hand-tuned 28.
    m, acts6, r = gpt2_h2048(fixed_activation_bytes=6 * GIB)
    assert plan(m, acts6, Budgets(gpu_bytes=32 * GIB, host_bytes=120 * GIB), r).resident_blocks == 28
    # With activations as small as measured (fused cross-entropy), nothing needs streaming at all.
    m, small, r = gpt2_h2048(fixed_activation_bytes=GIB // 2)
    assert plan(m, small, Budgets(gpu_bytes=32 * GIB, host_bytes=120 * GIB), r).window_size == 0
    # The defaults (1 resident, 4 slots) fit, but predict a CPU-bound step (measured: 0.40x of plain).
    slow = plan(m, acts, Budgets(gpu_bytes=32 * GIB, host_bytes=120 * GIB), r, resident_blocks=1, window_size=4)
    assert slow.floor.cpu_adam_s > slow.floor.gpu_s and slow.predicted_step_s > 1.5 * p.predicted_step_s


def test_host_memory_traffic_is_a_floor_term_when_its_bandwidth_is_known():
    """Everything the step moves through host DRAM, over its bandwidth: the H2D sources, the D2H
    destinations, 28 bytes per streamed parameter for AdamW and 10 per accumulation pass."""
    import dataclasses
    m = model(n_blocks=4, accumulation_steps=3)
    unknown = plan(m, ACTS, budgets(10 ** 15), FAST, resident_blocks=1, window_size=2)
    assert unknown.floor.host_memory_s == 0
    bandwidth = 1e8
    known = plan(m, ACTS, budgets(10 ** 15), dataclasses.replace(FAST, host_memory_bytes_per_s=bandwidth),
                 resident_blocks=1, window_size=2)
    streamed_trainable = 3 * N
    moved = known.h2d_bytes_per_step + known.d2h_bytes_per_step + streamed_trainable * (28 + 3 * 10)
    assert known.floor.host_memory_s == pytest.approx(moved / bandwidth)
    assert known.predicted_step_s == pytest.approx(known.floor.host_memory_s + known.floor.cpu_tail_s)
    assert known.predicted_step_s > unknown.predicted_step_s


# Activation offload (activations.py) ---------------------------------------------------------------
BIG_ACTS = Activations(fixed_peak_bytes=3_000_000, per_block_bytes=4_000_000)


def test_offloaded_activations_leave_the_gpu_and_cross_the_link_both_ways():
    m = model(n_blocks=6)
    kept = plan(m, BIG_ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2)
    moved = plan(m, BIG_ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2, activation_blocks=4)
    assert kept.activation_blocks == 0 and kept.activation_bytes_per_step == 0
    assert kept.floor.activation_h2d_s == kept.floor.activation_d2h_s == 0
    # 4 blocks' inputs leave the GPU; 2 of them (the block in backward and the next) are back at once.
    assert kept.gpu.activations - moved.gpu.activations == (4 - 2) * 4_000_000
    assert moved.activation_blocks == 4 and moved.activation_bytes_per_step == 4 * 4_000_000
    assert moved.floor.activation_h2d_s == pytest.approx(16e6 / 1e9)
    assert moved.floor.activation_d2h_s == pytest.approx(16e6 / 2e9)
    # The weights' terms are unchanged; the activations add to the link they share.
    assert moved.floor.h2d_s == kept.floor.h2d_s
    assert moved.floor.step_s >= moved.floor.h2d_s + moved.floor.activation_h2d_s
    assert "activations of 4 blocks offloaded" in plan_text.table(moved)


def test_accumulation_copies_the_activations_every_pass():
    m = model(n_blocks=6, accumulation_steps=3)
    p = plan(m, BIG_ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2, activation_blocks=2)
    assert p.activation_bytes_per_step == 3 * 2 * 4_000_000


def test_auto_offloads_nothing_when_the_plan_fits_and_the_fewest_blocks_when_it_does_not():
    m = model(n_blocks=6)
    roomy = plan(m, BIG_ACTS, budgets(10 ** 12), FAST, activation_blocks=None)
    assert roomy.activation_blocks == 0 and roomy == plan(m, BIG_ACTS, budgets(10 ** 12), FAST)
    smallest = plan(m, BIG_ACTS, budgets(10 ** 15), FAST, resident_blocks=0, window_size=2).gpu.needed
    # One byte short of the smallest placement without offload; 3 offloaded blocks save 1 block's bytes.
    tight = plan(m, BIG_ACTS, budgets(smallest - 1), FAST, activation_blocks=None)
    assert tight.activation_blocks == 3 and tight.resident_blocks == 0
    with pytest.raises(MemoryError, match="offload_activations"):
        plan(m, BIG_ACTS, budgets(smallest - 1), FAST)
    with pytest.raises(ValueError, match="activation_blocks"):
        plan(m, BIG_ACTS, budgets(10 ** 12), FAST, activation_blocks=-1)


# The lean tier ---------------------------------------------------------------------------------------
def test_lean_tier_takes_the_fewest_blocks_that_fit_the_host_at_the_edge():
    """Each lean block saves its bf16 gradient buffer (2 bytes per trainable parameter): a host budget
    exactly enough for k lean blocks gets k, one byte less gets k + 1, and none fits below all-lean."""
    m = model(n_blocks=6)
    full = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=1)
    assert full.lean_blocks == 0 and Tier.LEAN not in full.tiers
    for k in range(0, 6):
        host = full.host.needed - k * 2 * N
        p = plan(m, ACTS, budgets(10 ** 12, host=host), FAST, resident_blocks=1, lean_blocks=None)
        assert p.lean_blocks == k and p.host.needed == host and p.host.grads == (5 - k) * 2 * N + 5 * SQ
        assert p.tiers == (Tier.RESIDENT,) + (Tier.LEAN,) * k + (Tier.STREAMED,) * (5 - k)
        if k < 5:
            assert plan(m, ACTS, budgets(10 ** 12, host=host - 1), FAST, resident_blocks=1,
                        lean_blocks=None).lean_blocks == k + 1
    with pytest.raises(MemoryError, match="5 streamed blocks, 5 of them lean"):
        plan(m, ACTS, budgets(10 ** 12, host=full.host.needed - 5 * 2 * N - 1), FAST, resident_blocks=1,
             lean_blocks=None)


def test_lean_tier_is_only_planned_when_asked_and_possible():
    m = model(n_blocks=6)
    host = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=1).host.needed - 1
    with pytest.raises(MemoryError, match="does not fit host memory"):
        plan(m, ACTS, budgets(10 ** 12, host=host), FAST, resident_blocks=1)  # lean_blocks=0: the default
    for other in (model(n_blocks=6, compute_bytes=4), model(n_blocks=6, accumulation_steps=2)):
        tight = plan(other, ACTS, budgets(10 ** 12), FAST, resident_blocks=1).host.needed - 1
        with pytest.raises(MemoryError, match="lean tier, 2 bytes less per parameter, needs bf16/fp16"):
            plan(other, ACTS, budgets(10 ** 12, host=tight), FAST, resident_blocks=1, lean_blocks=None)
        with pytest.raises(ValueError, match="lean_blocks 2 needs a bf16/fp16 run"):
            plan(other, ACTS, budgets(10 ** 12), FAST, resident_blocks=1, lean_blocks=2)


def test_lean_until_keeps_a_built_layout_across_promotion():
    m = model(n_blocks=6)
    p = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=2, lean_until=4)
    assert p.lean_blocks == 2 and p.tiers[:4] == (Tier.RESIDENT,) * 2 + (Tier.LEAN,) * 2
    assert plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=5, lean_until=4).lean_blocks == 0


def test_a_built_layout_with_compact_masters_has_no_plan_below_its_lean_bound():
    """Compact masters are never lean, so below `lean_until` no tier combination is left: a MemoryError (which a
    re-plan reads as "keep the built placement"), not an unbound name."""
    m = dataclasses.replace(model(n_blocks=6), bf16=True)
    three_fit = budgets(needed(m, 3, 2)[0])
    with pytest.raises(MemoryError, match="no placement keeps the built layout at 3 resident blocks: the 1 streamed"):
        plan(m, ACTS, three_fit, FAST, window_size=2, lean_until=4, compact_master=True)
    p = plan(m, ACTS, budgets(needed(m, 4, 2)[0]), FAST, window_size=2, lean_until=4, compact_master=True)
    assert (p.resident_blocks, p.lean_blocks, p.compact_master) == (4, 0, True)


def test_lean_updates_after_backward_add_a_tail_by_hand():
    """Lean updates overlap the next forward (FORWARD_SHARE of the GPU time) instead of backward:
    step ~ max(backward, cpu other) + max(forward, cpu lean)."""
    from stronghold.planning.planner import FORWARD_SHARE
    m = model(n_blocks=5)
    slow_cpu = Rates(h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12, cpu_adam_params_per_s=2.5e8, gpu_s_per_block=0.002,
                     gpu_s_fixed=0.0)
    base = plan(m, ACTS, budgets(10 ** 12), slow_cpu, resident_blocks=1)
    lean = plan(m, ACTS, budgets(10 ** 12), slow_cpu, resident_blocks=1, lean_blocks=3)
    # 5 blocks x 2 ms of GPU; 4 ms of CPU AdamW a block: 3 lean blocks 12 ms, the other streamed one 4 ms.
    gpu, cpu_lean, cpu_other = 0.010, 0.012, 0.004
    forward = FORWARD_SHARE * gpu
    expected = max(gpu - forward, cpu_other) + max(forward, cpu_lean) - max(gpu, cpu_other + cpu_lean)
    assert expected == pytest.approx(0.0035)
    # Block 1's D2H + update + H2D, less one resident block's cover.
    assert base.floor.cpu_tail_s == pytest.approx(2 * N / 1e12 + 0.004 + 2 * N / 1e12 - 0.002)
    assert lean.floor.cpu_tail_s == pytest.approx(expected)
    assert lean.floor.cpu_adam_s == base.floor.cpu_adam_s


# Gradient accumulation on the GPU (device_accum.py) ----------------------------------------------------
def test_gpu_accumulation_bytes_and_floor_by_hand():
    m = model(accumulation_steps=4)
    host = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=1)
    gpu = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=1, gpu_accumulation=True)
    assert not host.gpu_accumulation and gpu.gpu_accumulation
    # Per streamed trainable parameter: the fp32 accumulator and the bf16 gradient held until backward ends.
    assert gpu.gpu.accumulators == 3 * N * (4 + 2) and host.gpu.accumulators == 0
    # What waits for its D2H is an fp32 window sum instead of a bf16 gradient (two blocks in flight).
    assert gpu.gpu.transients - host.gpu.transients == 2 * N * (4 - 2)
    # The host's gradient buffer is fp32 (the sum lands there) and there is no host accumulator.
    assert (gpu.host.grads, gpu.host.accumulators) == (3 * N * 4 + 3 * SQ, 0)
    assert (host.host.grads, host.host.accumulators) == (3 * N * 2 * 2 + 3 * SQ, 3 * N * 4)  # two bf16 buffers (store.py)
    # Down once per step in fp32 against every pass in bf16; the weights still come up every pass.
    assert gpu.d2h_bytes_per_step == 4 * 3 * N and host.d2h_bytes_per_step == 4 * 2 * 3 * N
    assert gpu.h2d_bytes_per_step == host.h2d_bytes_per_step
    # The CPU runs AdamW alone: no accumulation pass.
    assert gpu.floor.cpu_adam_s == pytest.approx(3 * N / 1e8)
    assert host.floor.cpu_adam_s == pytest.approx(3 * N * (1 + 4 * 10 / 28) / 1e8)
    assert "accumulated on the GPU" in plan_text.table(gpu) and "accumulated on the GPU" not in plan_text.table(host)


def test_auto_takes_gpu_accumulation_where_it_fits_and_is_faster():
    m = model(n_blocks=6, accumulation_steps=8)
    # The window fixed: an "auto" one would give up slots to keep the accumulators.
    roomy = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=2, window_size=2, gpu_accumulation=None)
    assert roomy.gpu_accumulation
    # A GPU budget one byte short of the accumulators at this residency leaves the host way.
    edge = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=2, window_size=2, gpu_accumulation=True).gpu.needed
    tight = plan(m, ACTS, budgets(edge - 1), FAST, resident_blocks=2, window_size=2, gpu_accumulation=None)
    assert not tight.gpu_accumulation and tight.resident_blocks == 2
    # Without accumulation (or with several ranks) there is nothing to choose.
    assert not plan(model(n_blocks=6), ACTS, budgets(10 ** 12), FAST, resident_blocks=2,
                    gpu_accumulation=None).gpu_accumulation
    # Forced on where the accumulators do not fit: the error names them and the way out.
    with pytest.raises(MemoryError, match=r"does not fit the GPU.*set \"gpu_accumulation\" to false or \"auto\" "
                                          r"\(the streamed accumulators, \d+\.\d\d GiB"):
        plan(m, ACTS, budgets(edge - 1), FAST, resident_blocks=2, gpu_accumulation=True)
    with pytest.raises(MemoryError) as host_way:
        plan(m, ACTS, budgets(100), FAST, resident_blocks=2, gpu_accumulation=False)
    assert "gpu_accumulation" not in str(host_way.value)
    for other, ranks in ((model(n_blocks=6), 1), (m, 2)):
        with pytest.raises(ValueError, match="gpu_accumulation needs gradient accumulation on one rank"):
            plan(other, ACTS, Budgets(gpu_bytes=10 ** 12, host_bytes=10 ** 12, local_ranks=ranks), FAST,
                 resident_blocks=2, gpu_accumulation=True)


def test_auto_prefers_more_resident_blocks_when_accumulators_would_cost_too_many():
    """Free residency choice: the accumulators push blocks off the GPU; the faster predicted step wins,
    and the choice follows the rates (a fast CPU makes host accumulation cheap)."""
    m = model(n_blocks=6, accumulation_steps=8)
    # Room for 4 resident blocks the host way.
    budget = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=4).gpu.needed
    slow_link = Rates(h2d_bytes_per_s=1e8, d2h_bytes_per_s=1e12, cpu_adam_params_per_s=1e12,
                      gpu_s_per_block=0.002, gpu_s_fixed=0.003)
    chosen = plan(m, ACTS, budgets(budget), slow_link, gpu_accumulation=None)
    forced = plan(m, ACTS, budgets(budget), slow_link, gpu_accumulation=True)
    assert forced.resident_blocks < 4 and not chosen.gpu_accumulation and chosen.resident_blocks == 4
    assert chosen.predicted_step_s < forced.predicted_step_s
    slow_cpu = Rates(h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12, cpu_adam_params_per_s=1e7,
                     gpu_s_per_block=0.002, gpu_s_fixed=0.003)
    assert plan(m, ACTS, budgets(budget), slow_cpu, gpu_accumulation=None).gpu_accumulation


def test_accumulation_trades_a_resident_block_for_slots_that_cache_the_streamed_ones():
    """With accumulation each slot saves two copies a pass after the first (window.py keeps blocks across
    micro-steps): on a copy-bound link the search gives up a resident block (16 + 2 bytes per parameter
    here, bf16) for 8 slots' worth of cache and predicts a faster step; without accumulation the rule
    keeps the most resident blocks."""
    slow = rates(2.5e8)  # 8 ms per block load against 0.5 ms of forward compute
    m8, m1 = model(n_blocks=8, accumulation_steps=8), model(n_blocks=8)
    budget = plan(m8, ACTS, budgets(10 ** 12), slow, resident_blocks=4, window_size=2).gpu.needed
    fixed = plan(m8, ACTS, budgets(budget), slow, resident_blocks=4, window_size=2)
    searched = plan(m8, ACTS, budgets(budget), slow)
    assert searched.resident_blocks < 4 and searched.window_size == 8 - searched.resident_blocks
    assert searched.predicted_step_s < fixed.predicted_step_s
    assert searched.h2d_bytes_per_step == (8 - searched.resident_blocks) * 2 * N  # one load a step each
    one = plan(m1, ACTS, budgets(plan(m1, ACTS, budgets(10 ** 12), slow, resident_blocks=4, window_size=2).gpu.needed),
               slow)
    assert (one.resident_blocks, one.window_size) == (4, 2)


def test_the_window_at_a_given_residency_takes_every_slot_that_fits_with_accumulation():
    """With accumulation the slots cache the streamed blocks across the micro-steps, so with the residency given
    (a re-plan keeps what the first forward built) an "auto" window is the largest that fits the budget, not the
    window rule's; one byte short of a window gives the one below it. Without accumulation the rule stands."""
    m = model(n_blocks=12, accumulation_steps=8)
    for window in (3, 7, 11):
        gpu, _ = needed(m, resident=1, window=window)
        assert plan(m, ACTS, budgets(gpu), FAST, resident_blocks=1).window_size == window
        assert plan(m, ACTS, budgets(gpu - 1), FAST, resident_blocks=1).window_size == window - 1
    one = model(n_blocks=12)
    roomy = plan(one, ACTS, budgets(10 ** 12), FAST, resident_blocks=1)
    assert roomy.window_size == roomy.window_wanted < 11


def test_largest_fitting_window_bisects_to_the_edge():
    for edge in range(2, 40):
        calls = []

        def fits(w):
            calls.append(w)
            return w <= edge
        assert largest_fitting_window(fits, 2, 39) == edge
        assert len(calls) <= 7, "a bisection, not a walk over every size"
    assert largest_fitting_window(lambda w: w <= 50, 2, 39) == 39
    assert largest_fitting_window(lambda w: False, 2, 39) is None
    assert largest_fitting_window(lambda w: True, 2, 1) is None


def test_walk_is_bound_by_the_forward_copies_by_hand():
    """FAST: a 2 MB block loads in 2 ms; a pass of a block is 2 ms, 0.5 of it forward. R1, S3, W2, no
    accumulation: forward loads 3 blocks (6 ms) less the lead (the first slot fills during block 0's 0.5 ms
    forward) against 1.5 ms of streamed forward compute; backward loads 1 (2 ms) against 4.5 ms."""
    p = plan(model(), ACTS, budgets(10 ** 12), FAST, resident_blocks=1, window_size=2)
    assert p.floor.walk_s == pytest.approx(0.003 + 0.002 + (0.006 - 0.0005) + 0.0045)
    assert p.floor.gpu_s == pytest.approx(0.011)


def test_search_takes_the_most_resident_blocks_among_predictions_within_tolerance():
    """Measured rates are noisy (the first step's block time varied 7.0-9.4 ms on one machine): within
    SEARCH_TOLERANCE of the fastest prediction the most resident blocks win, beyond it the fastest."""
    import dataclasses
    from stronghold.planning.plan_search import SEARCH_TOLERANCE
    from stronghold.planning.planner import _most_resident_of_the_fastest
    m = model(n_blocks=6, accumulation_steps=8)
    base = plan(m, ACTS, budgets(10 ** 12), FAST, resident_blocks=2, window_size=2)

    def at(resident, step_s):
        return dataclasses.replace(base, resident_blocks=resident,
                                   floor=dataclasses.replace(base.floor, gpu_s=step_s, walk_s=0.0, cpu_tail_s=0.0,
                                                             cpu_adam_s=0.0, host_memory_s=0.0, h2d_s=0.0, d2h_s=0.0))

    fast, close, slow = at(1, 1.0), at(3, 1.0 + SEARCH_TOLERANCE * 0.99), at(5, 1.0 + SEARCH_TOLERANCE * 1.01)
    assert _most_resident_of_the_fastest([slow, close, fast]) is close
    assert _most_resident_of_the_fastest([slow, fast]) is fast


def test_search_ties_go_to_the_plan_that_stays_fast_when_the_blocks_are_faster_than_measured():
    """The first step's block time runs long (10.2 ms against 8.8 after it, on an H100), which hides
    a copy-bound walk. R5 W2 (3 streamed blocks, 2 slots: they load every pass) predicts within SEARCH_TOLERANCE
    of R4 W4 (every streamed block cached) and has one more resident block, but with the blocks BLOCK_TIME_LOW as
    long its copies bound it and R4 W4 wins; without the model and rates the old rule keeps R5."""
    from stronghold.planning.plan_search import BLOCK_TIME_LOW, SEARCH_TOLERANCE
    from stronghold.planning.planner import _floor, _most_resident_of_the_fastest
    m = model(n_blocks=8, accumulation_steps=8)
    r = Rates(h2d_bytes_per_s=5e8, d2h_bytes_per_s=1e12, cpu_adam_params_per_s=1e12, gpu_s_per_block=0.004,
              gpu_s_fixed=0.0)
    cached = plan(m, ACTS, budgets(10 ** 12), r, resident_blocks=4, window_size=4)
    copying = plan(m, ACTS, budgets(10 ** 12), r, resident_blocks=5, window_size=2)
    assert abs(copying.predicted_step_s / cached.predicted_step_s - 1) < SEARCH_TOLERANCE
    low = Rates(h2d_bytes_per_s=5e8, d2h_bytes_per_s=1e12, cpu_adam_params_per_s=1e12,
                gpu_s_per_block=0.004 * BLOCK_TIME_LOW, gpu_s_fixed=0.0)
    assert _floor(m, low, 5, 2)[0].step_s > (1 + SEARCH_TOLERANCE) * _floor(m, low, 4, 4)[0].step_s
    assert _most_resident_of_the_fastest([copying, cached], m, r) is cached
    assert _most_resident_of_the_fastest([copying, cached]) is copying


def test_search_ties_the_compute_bound_hides_go_to_the_least_host_traffic():
    """First-step blocks timed at 11.1 ms make the compute term bound both R16 W4 and R15 W17 even at BLOCK_TIME_LOW,
    and residency took R16 W4, which streams ~11x the bytes (0.742x vs 0.864x in one run). Here the same two of 32
    blocks, on a compute-bound model with a host-memory rate; both predict the same step. R16 W4 loads 12 of its 16
    streamed blocks twice a pass, R15 W17 each block once a step, which outweighs the CPU's passes over one more
    streamed block (~10% less traffic in all). The least traffic wins; within SEARCH_TOLERANCE of it, residency as before."""
    import dataclasses
    from stronghold.planning.plan_search import SEARCH_TOLERANCE, choose
    m = model(n_blocks=32, accumulation_steps=8)
    r = Rates(h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12, cpu_adam_params_per_s=1e12, gpu_s_per_block=0.05,
              gpu_s_fixed=0.0, host_memory_bytes_per_s=1e11)
    cached = plan(m, ACTS, budgets(10 ** 12), r, resident_blocks=15, window_size=17)
    copying = plan(m, ACTS, budgets(10 ** 12), r, resident_blocks=16, window_size=4)
    assert copying.predicted_step_s == pytest.approx(cached.predicted_step_s), "compute-bound: the same prediction"
    assert copying.floor.host_memory_s > (1 + SEARCH_TOLERANCE) * cached.floor.host_memory_s
    assert choose([copying, cached]) is cached and choose([cached, copying]) is cached
    near = dataclasses.replace(copying, floor=dataclasses.replace(
        copying.floor, host_memory_s=cached.floor.host_memory_s * (1 + SEARCH_TOLERANCE * 0.99)))
    assert choose([cached, near]) is near, "within tolerance of the least traffic, the most resident blocks"


def test_updates_deferred_by_clipping_add_the_lean_tail_and_with_accumulation_overlap_one_forward():
    """Rates.deferred_share (measured in the first step): deferred updates overlap the next forward, as lean
    blocks' do; with accumulation only the first pass's forward (step ~ the rest + max(forward, cpu))."""
    import dataclasses
    from stronghold.planning.planner import FORWARD_SHARE
    slow_cpu = Rates(h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12, cpu_adam_params_per_s=2.5e8, gpu_s_per_block=0.002,
                     gpu_s_fixed=0.0)
    clipped = dataclasses.replace(slow_cpu, deferred_share=1.0)
    m = model(n_blocks=5)
    lean = plan(m, ACTS, budgets(10 ** 12), slow_cpu, resident_blocks=1, lean_blocks=4)
    deferred = plan(m, ACTS, budgets(10 ** 12), clipped, resident_blocks=1)
    assert deferred.floor.cpu_tail_s == pytest.approx(lean.floor.cpu_tail_s) and deferred.floor.cpu_tail_s > 0
    m4 = model(n_blocks=5, accumulation_steps=4)
    p = plan(m4, ACTS, budgets(10 ** 12), clipped, resident_blocks=1, window_size=4)
    gpu_s, cpu = 4 * 5 * 0.002, 4 * N / 2.5e8
    forward = FORWARD_SHARE * gpu_s / 4
    assert p.floor.cpu_tail_s == pytest.approx(gpu_s - forward + max(forward, cpu) - max(gpu_s, cpu))
    # Without deferral only the last streamed block's chain is left (_floor's `chain`).
    assert plan(m4, ACTS, budgets(10 ** 12), slow_cpu, resident_blocks=1, window_size=4).floor.cpu_tail_s < p.floor.cpu_tail_s
    with pytest.raises(ValueError, match="deferred_share"):
        dataclasses.replace(slow_cpu, deferred_share=1.5)


# Spare gradient buffers ----------------------------------------------------------------------------
def test_spare_gradient_buffers_are_dropped_only_where_host_memory_needs_it():
    """With host accumulation each streamed block has two bf16 gradient buffers (store.py): 2 bytes a trainable
    parameter more. "auto" keeps them where the host holds them, drops them where it fits only without them, and a
    plan that must keep them fails there with the host's numbers."""
    m = model(accumulation_steps=4)
    roomy = plan(m, ACTS, budgets(10 ** 15), FAST, resident_blocks=1, window_size=2, gradient_spares=None)
    assert roomy.gradient_spares and roomy.host.grads == 3 * N * 2 * 2 + 3 * SQ
    tight = budgets(10 ** 15, host=roomy.host.needed - 1)
    lean = plan(m, ACTS, tight, FAST, resident_blocks=1, window_size=2, gradient_spares=None)
    assert not lean.gradient_spares and lean.host.grads == 3 * N * 2 + 3 * SQ
    assert lean.host.needed == roomy.host.needed - 3 * N * 2 <= tight.host_bytes
    assert "one gradient buffer a streamed block" in plan_text.table(lean)
    assert "one gradient buffer" not in plan_text.table(roomy)
    with pytest.raises(MemoryError, match="host"):
        plan(m, ACTS, tight, FAST, resident_blocks=1, window_size=2, gradient_spares=True)
    # Without accumulation there is no spare to keep or drop.
    assert not plan(model(), ACTS, budgets(10 ** 15), FAST, resident_blocks=1, gradient_spares=None).gradient_spares
