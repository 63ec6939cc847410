"""The blockwise backward's step-time floor (planning/plan_blockwise.py) against host accumulation's (plan_floor.py):
the byte counts and the serial chain of its schedule, from the arithmetic of the module's docstring."""
import dataclasses

import pytest

from stronghold.planning import plan_blockwise, plan_floor
from stronghold.planning.planner import BlockSpec, ModelSpec, PartSpec, Rates

N = 1_000_000
RATES = Rates(h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9, cpu_adam_params_per_s=1e8, gpu_s_per_block=0.002,
              gpu_s_fixed=0.003)


def spec(n_blocks=8, passes=4, rest=()):
    parts = tuple(rest) or (PartSpec(name="rest", numel=500_000, trainable_numel=500_000),)
    return ModelSpec(blocks=(BlockSpec(numel=N, trainable_numel=N),) * n_blocks,
                     rest_numel=sum(p.numel for p in parts), rest_trainable_numel=sum(p.trainable_numel for p in parts),
                     compute_bytes=2, accumulation_steps=passes, rest_parts=parts)


# (resident, window, blocks a later forward loads): one left out, the last W blocks shared with the next forward's
# first W (2(S - W)); more than two left out, one block ahead and the first W - 2 kept (S - W + 2; window.py).
@pytest.mark.parametrize("resident,window,later", [(2, 5, 2), (2, 3, 5), (0, 2, 8), (0, 4, 6), (8, 0, 0)])
def test_each_streamed_gradient_goes_down_once_in_fp32_and_the_loads_follow_the_window(resident, window, later):
    model = spec()
    terms, h2d, d2h = plan_blockwise.floor_terms(model, RATES, resident, window)
    s = 8 - resident
    left_out = max(0, s - window)
    loads = s + 3 * later + left_out if s else 0
    assert h2d == 2 * N * loads
    assert d2h == 4 * N * s
    assert terms.cpu_adam_s == pytest.approx(s * N / RATES.cpu_adam_params_per_s)  # no accumulation pass
    assert terms.gpu_s == pytest.approx(4 * (RATES.gpu_s_fixed + 8 * RATES.gpu_s_per_block))
    host, _, host_d2h = plan_floor.floor_terms(model, RATES, resident, window)
    assert host_d2h == 4 * 2 * N * s  # bf16 every micro-step
    assert host.cpu_adam_s >= terms.cpu_adam_s


def test_the_kept_inputs_cross_both_links_and_the_cached_input_is_summed_once():
    parts = (PartSpec(name="input", numel=3 * N, trainable_numel=3 * N),
             PartSpec(name="output", numel=2 * N, trainable_numel=2 * N, before_blocks=False))
    model = spec(rest=parts)
    bare, h2d, d2h = plan_blockwise.floor_terms(model, RATES, 4, 4)
    _, kept_h2d, kept_d2h = plan_blockwise.floor_terms(model, RATES, 4, 4, kept_bytes=1000)
    assert (kept_h2d - h2d, kept_d2h - d2h) == (1000, 1000)
    _, cached_h2d, cached_d2h = plan_blockwise.floor_terms(model, RATES, 4, 4, frozenset({"input", "output"}))
    # The input part: its weights up, its fp32 sum down once; the output part: its weights up, bf16 every micro-step.
    assert cached_h2d - h2d == 2 * 3 * N + 2 * 2 * N
    assert cached_d2h - d2h == 4 * 3 * N + 4 * 2 * 2 * N


def test_an_input_table_summed_as_rows_sends_the_windows_rows_and_is_updated_whole():
    """PartSpec.row_gradients: the walk sends the window's tokens' rows (a micro-batch's block input over the compute
    dtype's bytes, times the micro-batches), at most the table; the CPU still updates every row. Without the block
    input's size the whole table is counted."""
    rows_of = lambda table: spec(rest=(PartSpec(name="input", numel=table, trainable_numel=table,  # noqa: E731
                                                row_gradients=True),))
    cached, block_input = frozenset({"input"}), 2 * 1000  # 1000 elements a micro-batch's block input, bf16
    for table, sent in ((3 * N, 4 * 1000), (2000, 2000)):
        model = rows_of(table)
        whole, _, whole_d2h = plan_blockwise.floor_terms(model, RATES, 4, 4, cached)
        terms, _, d2h = plan_blockwise.floor_terms(model, RATES, 4, 4, cached, block_input_bytes=block_input)
        assert whole_d2h - d2h == 4 * (table - sent)
        assert terms.cpu_adam_s == whole.cpu_adam_s
    plain = spec(rest=(PartSpec(name="input", numel=3 * N, trainable_numel=3 * N),))
    assert (plan_blockwise.floor_terms(plain, RATES, 4, 4, cached, block_input_bytes=block_input)[2]
            == plan_blockwise.floor_terms(plain, RATES, 4, 4, cached)[2])


def test_deferred_updates_hold_the_first_forward_then_the_later_forwards_and_the_walk_follow():
    """Every update deferred (clipping): the step is at least the CPU's updates (the first forward waits for them in
    order), then the later forwards one after another, then the whole walk; where the CPU is quicker than the first
    forward, that forward instead. With none deferred the updates overlap the walk."""
    model = spec()
    forward = plan_floor.FORWARD_SHARE * RATES.gpu_s_per_block
    later = 3 * (RATES.gpu_s_fixed + 8 * forward)  # two resident blocks and six slots: the later forwards load nothing
    first = RATES.gpu_s_fixed + max(8 * forward, 6 * 2 * N / RATES.h2d_bytes_per_s)
    walk = 4 * 8 * (RATES.gpu_s_per_block - forward)
    slow_cpu = dataclasses.replace(RATES, cpu_adam_params_per_s=1e6, deferred_share=1.0)
    terms, _, _ = plan_blockwise.floor_terms(model, slow_cpu, 2, 6)
    assert terms.cpu_adam_s > first
    assert terms.step_s == pytest.approx(terms.cpu_adam_s + later + walk)
    fast_cpu = dataclasses.replace(RATES, cpu_adam_params_per_s=1e12, deferred_share=1.0)
    quick, _, _ = plan_blockwise.floor_terms(model, fast_cpu, 2, 6)
    assert quick.cpu_adam_s < first
    assert quick.step_s == pytest.approx(first + later + walk)
    early, _, _ = plan_blockwise.floor_terms(model, dataclasses.replace(slow_cpu, deferred_share=0.0), 2, 6)
    assert early.step_s < terms.step_s


def test_the_forwards_block_by_block_load_each_block_once_and_run_under_the_updates():
    """`ahead` (engine/block_major.py): the window's forwards load every streamed block once, at the first, which runs
    every micro-batch's blocks; the later forwards run only what is outside the blocks. With every update deferred
    and a slow CPU, the blocks' forwards all hide under the updates: the step is the updates, the later forwards'
    fixed parts, then the walk."""
    model = spec()
    forward = plan_floor.FORWARD_SHARE * RATES.gpu_s_per_block
    walk = 4 * 8 * (RATES.gpu_s_per_block - forward)
    one_by_one, h2d, _ = plan_blockwise.floor_terms(model, RATES, 0, 2)
    ahead, ahead_h2d, _ = plan_blockwise.floor_terms(model, RATES, 0, 2, ahead=True)
    assert ahead_h2d == 2 * N * (8 + 6) and h2d == 2 * N * (8 + 3 * 8 + 6)  # the first forward and the walk's 6
    assert ahead.step_s < one_by_one.step_s
    slow_cpu = dataclasses.replace(RATES, cpu_adam_params_per_s=1e6, deferred_share=1.0)
    terms, _, _ = plan_blockwise.floor_terms(model, slow_cpu, 2, 6, ahead=True)
    assert terms.cpu_adam_s > RATES.gpu_s_fixed + 4 * 8 * forward
    assert terms.step_s == pytest.approx(terms.cpu_adam_s + 3 * RATES.gpu_s_fixed + walk)


def test_the_plan_counts_the_blockwise_stores_on_the_host():
    """One fp32 gradient buffer a streamed block and none of host accumulation's accumulators or spares: 4 bytes a
    parameter against 8 (bf16 gradient, its spare, the fp32 accumulator); never pooled buffers."""
    from stronghold.planning.planner import Activations, Budgets, plan
    model = spec()
    acts, budgets = Activations(fixed_peak_bytes=0, per_block_bytes=0), Budgets(gpu_bytes=2 ** 40, host_bytes=2 ** 40,
                                                                               gpu_margin_bytes=0, host_margin_bytes=0)
    host = plan(model, acts, budgets, RATES, resident_blocks=2, window_size=2)
    blockwise = plan(model, acts, budgets, RATES, resident_blocks=2, window_size=2, blockwise=True)
    assert blockwise.blockwise_backward and not blockwise.gradient_spares and host.gradient_spares
    assert (blockwise.host.grads, blockwise.host.accumulators) == (6 * (4 * N + 4), 0)
    assert host.host.total - blockwise.host.total == 6 * N * (2 + 2 + 4 - 4)
    assert not plan(model, acts, budgets, RATES, resident_blocks=2, window_size=2, blockwise=True,
                    pooled_grads=None).pooled_grads
    with pytest.raises(ValueError, match="blockwise_backward needs pooled_grads off .*no pooled buffers"):
        plan(model, acts, budgets, RATES, resident_blocks=2, window_size=2, blockwise=True, pooled_grads=True)
    with pytest.raises(ValueError, match="blockwise_backward needs gpu_accumulation off .*block by block"):
        plan(model, acts, budgets, RATES, resident_blocks=2, window_size=2, blockwise=True, gpu_accumulation=True)
    tight = dataclasses.replace(budgets, host_bytes=blockwise.host.total)
    assert plan(model, acts, tight, RATES, resident_blocks=2, window_size=2, blockwise=True).host.needed <= \
        tight.host_bytes
    with pytest.raises(MemoryError):
        plan(model, acts, tight, RATES, resident_blocks=2, window_size=2, gradient_spares=True)
