"""The deferral share per optimizer step (deferral.py) and the placement's prediction following its median
(placement.py `_follow_deferral`), on a stand-in runtime: the counts come from the CPU optimizer's statistics,
which these tests set by hand, and the prediction is the pure planner's."""
import dataclasses
from types import SimpleNamespace

import pytest

from stronghold.planning import initial_plan, placement, plan_text, prediction

from stronghold.planning import planner
from stronghold.optim.cpu_records import CpuStats
from stronghold.optim.deferral import RECENT_STEPS, DeferralShares

from .test_placement import GIB, _settings, _spec


def _cpu():
    return SimpleNamespace(stats=CpuStats())


def test_each_step_counts_its_deferred_claimed_and_redone_updates_and_a_reset_starts_again():
    cpu, shares = _cpu(), DeferralShares()
    assert shares.end_step(None, 4) is None and shares.typical() is None
    shares.mark(cpu)
    cpu.stats.deferred_blocks += 4  # claimed updates are counted as deferred too (cpu_optim.finish_step)
    assert shares.end_step(cpu, 4) == 1.0
    cpu.stats.redo_blocks += 1
    assert shares.end_step(cpu, 4) == 0.25
    assert shares.end_step(cpu, 4) == 0.0
    assert list(shares.shares) == [1.0, 0.25, 0.0] and shares.typical() == 0.25
    # stronghold_report(reset=True) between two steps: the new statistics hold the next step whole.
    cpu.stats = CpuStats(deferred_blocks=2)
    assert shares.end_step(cpu, 4) == 0.5 and list(shares.shares) == [0.5]
    for _ in range(RECENT_STEPS + 3):
        shares.end_step(cpu, 4)
    assert len(shares.shares) == RECENT_STEPS, "a long run keeps the recent steps only"


def _placed(cpu, streamed: int = 6):
    """A Placement after its timed steps, on a stand-in runtime (2 resident blocks, 6 streamed)."""
    spec, budget = _spec(), planner.Budgets(gpu_bytes=40 * GIB, host_bytes=400 * GIB)
    settings = _settings()
    runtime = SimpleNamespace(mid_step=False, cpu=cpu, stores=dict.fromkeys(range(2, 2 + streamed)),
                              resident_count=2, window_size=4, lean_until=0, nvme_from=2 + streamed, device_accum=None,
                              blockwise=None, gradient_spares=True, compact_master=False, pooled_grads=False)
    placed = placement.Placement(runtime=runtime, spec=spec, budget=budget, settings=settings,
                                 plan=initial_plan.initial_plan(spec, budget, settings))
    # The CPU's updates of the 6 streamed blocks take as long as the GPU's step (0.4 s): deferring them all adds
    # 0.75 of it (plan_floor.floor_terms: the forward is a quarter of the pass), a third of them 0.08.
    rates = planner.Rates(h2d_bytes_per_s=5e10, d2h_bytes_per_s=5e10, cpu_adam_params_per_s=6 * 100 * 2 ** 20 / 0.4,
                          gpu_s_per_block=0.05, gpu_s_fixed=0.0, deferred_share=1.0)
    placed._activations = planner.Activations(fixed_peak_bytes=GIB, per_block_bytes=0)
    placed.measured["rates_refreshed"] = dataclasses.asdict(rates)
    placed.pending, placed._placed, placed._timing_left = False, True, 0
    placed._deferral.mark(cpu)
    return placed, rates


def _expected(placed, rates, share, budget=None):
    return planner.plan(placed.spec, placed._activations, budget or placed.budget,
                        dataclasses.replace(rates, deferred_share=share), resident_blocks=2, window_size=4,
                        activation_blocks=placed.plan.activation_blocks, lean_until=0,
                        gpu_accumulation=False).predicted_step_s


def test_the_prediction_follows_the_median_share_of_the_steps_since_the_placement():
    """Steps 1-2 after the placement deferred every update (no forecast of the norm yet), the later ones few:
    the prediction moves to the later steps' once they are the median, and a report's reset restarts the count."""
    cpu = _cpu()
    placed, rates = _placed(cpu)
    clipping, steady = _expected(placed, rates, 1.0), _expected(placed, rates, 2 / 6)
    assert clipping > 1.5 * steady
    for deferred in (6, 6, 2, 2):
        cpu.stats.deferred_blocks += deferred
        placed.after_step()
    assert placed.measured["deferred_share_per_step"] == [1.0, 1.0, pytest.approx(1 / 3), pytest.approx(1 / 3)]
    assert placed.plan.predicted_step_s == pytest.approx(_expected(placed, rates, 2 / 3)), "median of four"
    cpu.stats.deferred_blocks += 2
    placed.after_step()
    assert placed.plan.predicted_step_s == pytest.approx(steady)
    placed.after_step()  # no update deferred: the median stays, and the report still lists every step
    assert placed.measured["deferred_share_per_step"][-2:] == [pytest.approx(1 / 3), 0.0]
    assert placed.measured["rates_refreshed"]["deferred_share"] == pytest.approx(1 / 3)
    cpu.stats = CpuStats(deferred_blocks=6)  # the warm-up's end: the report's window starts with this step
    placed.after_step()
    assert placed.measured["deferred_share_per_step"] == [1.0]
    assert placed.plan.predicted_step_s == pytest.approx(clipping)
    runtime = placed.runtime
    runtime.mid_step = True  # a micro-step of accumulation is no step's end
    placed.after_step()
    assert placed.measured["deferred_share_per_step"] == [1.0]


def test_a_placement_whose_byte_counts_do_not_fit_is_still_predicted_at_the_measured_rates():
    """The measured peak counts the allocator's cached-but-free memory, which can fill the whole cap: the planner
    then finds no plan at the placement that runs, which runs on, and its prediction must still be the measured
    rates' (not the start-up defaults')."""
    cpu = _cpu()
    placed, rates = _placed(cpu)
    placed._activations = planner.Activations(fixed_peak_bytes=39 * GIB, per_block_bytes=0)
    with pytest.raises(MemoryError):
        _expected(placed, rates, 1 / 3)
    stale = placed.plan.predicted_step_s
    unbounded = dataclasses.replace(placed.budget, gpu_bytes=prediction.UNBOUNDED_BYTES,
                                    host_bytes=prediction.UNBOUNDED_BYTES)
    expected = _expected(placed, rates, 1 / 3, unbounded)
    assert expected != pytest.approx(stale)
    cpu.stats.deferred_blocks += 2
    placed.after_step()
    assert placed.plan.predicted_step_s == pytest.approx(expected)
    assert placed.plan.gpu_budget_bytes == 40 * GIB < placed.plan.gpu.needed, "the real budget, over it"
    assert plan_text.OVER_GPU_BUDGET in plan_text.table(placed.plan)
    assert plan_text.OVER_GPU_BUDGET not in plan_text.table(_placed(cpu)[0].plan)
