"""Store lookups, budgeted sweeps and resumption, with a fake runner (no subprocesses)."""
import json

import pytest
from bench_fakes import TINY, FakeClock, FakeRunner, record

from examples.bench.__main__ import build_parser
from examples.bench.figures import fig6a, fig7a, fig9
from examples.bench.point import Point
from examples.bench.store import Provenance, ResultStore, read_records
from examples.bench.sweep import BudgetExhausted, Sweep, SweepConfig

P = Point(system="no_offload", layers=4, **TINY)
LIMITS = {"no_offload": 8, "zero_offload": 20, "zero_infinity": 16, "stronghold": 40}
TINY_ARGS = ["--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2"]


def store(tmp_path, commit="c0", **kwargs):
    return ResultStore(tmp_path, Provenance(commit=commit, dirty=False), **kwargs)


def test_lookup_needs_same_key_and_commit(tmp_path):
    s = store(tmp_path)
    s.append("fig", record(P, commit="old"))
    assert s.lookup(P, 480) is None
    assert store(tmp_path, any_commit=True).lookup(P, 480) is not None
    s.append("fig", record(P))
    assert store(tmp_path).lookup(P, 480)["commit"] == "c0"
    assert store(tmp_path).lookup(P.with_(layers=8), 480) is None


def test_lookup_rules_per_outcome(tmp_path):
    s = store(tmp_path)
    s.append("fig", record(P, timed_steps=3))
    assert s.lookup(P.with_(timed_steps=3), 480) is not None
    assert s.lookup(P.with_(timed_steps=5), 480) is None, "fewer timed steps than asked for"
    t = P.with_(layers=8)
    s.append("fig", record(t, "timeout", timeout_s=100.0))
    assert s.lookup(t, 100) is not None and s.lookup(t, 480) is None, "a shorter timeout does not answer"
    o = P.with_(layers=12)
    s.append("fig", record(o, "oom_gpu"))
    assert s.lookup(o.with_(timed_steps=50), 480)["error"] == "oom_gpu"
    e = P.with_(layers=16)
    s.append("fig", record(e, "error"))
    assert s.lookup(e, 480) is not None
    assert store(tmp_path, retry_errors=True).lookup(e, 480) is None


def test_cut_off_lines_are_skipped(tmp_path, capsys):
    store(tmp_path).append("fig", record(P))
    with open(tmp_path / "fig.jsonl", "a") as f:
        f.write('{"key": "half a rec')
    assert len(read_records(tmp_path)) == 1
    assert "not JSON" in capsys.readouterr().err


def sweep(tmp_path, runner, budget_s=1000.0, clock=None, figure="fig6a"):
    config = SweepConfig(figure=figure, budget_s=budget_s, point_timeout_s=100.0, min_start_s=20.0)
    return Sweep(config=config, store=store(tmp_path), run=runner, clock=clock or FakeClock())


def test_budget_stops_cleanly_and_a_cut_point_is_not_recorded(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(LIMITS, seconds_per_run=60.0, clock=clock)
    sw = sweep(tmp_path, runner, budget_s=150.0, clock=clock)
    sw.point(P)
    sw.point(P.with_(layers=6))  # 120 s used; 30 s left >= min_start_s: starts, is cut at 30 s
    with pytest.raises(BudgetExhausted, match="cut"):
        sw.point(P.with_(layers=7))
    assert [r.source for r in sw.rows] == ["new", "new", "cut"]
    assert [r["layers"] for r in read_records(tmp_path)] == [4, 6]
    with pytest.raises(BudgetExhausted, match="min_start_s"):
        sw.point(P.with_(layers=5))
    assert "| cut |" in sw.summary()


def test_own_timeout_is_recorded(tmp_path):
    runner = FakeRunner(LIMITS, seconds_per_run=500.0, clock=FakeClock())
    sw = sweep(tmp_path, runner, clock=runner.clock)
    assert sw.point(P)["error"] == "timeout"
    assert read_records(tmp_path)[0]["error"] == "timeout"


def args(*argv):
    return build_parser().parse_args([*argv, *TINY_ARGS])


def test_fig6a_search_resumes_across_budget_cut_commands(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(LIMITS, seconds_per_run=30.0, clock=clock)
    a = args("fig6a", "--start", "8", "--step-layers", "2")
    commands = 0
    while True:
        commands += 1
        clock.now = 0.0
        sw = sweep(tmp_path, runner, budget_s=100.0, clock=clock)
        try:
            fig6a(sw, a)
            break
        except BudgetExhausted:
            assert commands < 20
    assert commands > 3, "the budget should have cut the sweep several times"
    keys = [p.key() for p in runner.calls]
    assert len(keys) == len(set(keys)), "a point was run twice"
    records = read_records(tmp_path)
    for system, limit in LIMITS.items():
        layers = {r["layers"]: r["error"] for r in records if r["system"] == system}
        assert layers[limit] is None and layers[limit + 2] is not None
        assert max(k for k, e in layers.items() if e is None) == limit


def test_fig6a_records_a_search_error_and_goes_on(tmp_path, capsys):
    def runner(point, timeout_s):
        return record(point, "error", error_detail="boom") if point.system == "zero_offload" else \
            FakeRunner(LIMITS)(point, timeout_s)

    fig6a(sweep(tmp_path, runner), args("fig6a", "--start", "8"))
    assert "zero_offload cap 32.0: search aborted" in capsys.readouterr().out
    assert {r["system"] for r in read_records(tmp_path)} == set(LIMITS)


def test_fig7a_runs_every_fitting_system_at_each_baseline_limit(tmp_path):
    fig6a(sweep(tmp_path, FakeRunner(LIMITS)), args("fig6a", "--start", "8", "--step-layers", "4"))
    probed = {(r["system"], r["layers"]) for r in read_records(tmp_path)}
    runner = FakeRunner(LIMITS)
    fig7a(sweep(tmp_path, runner, figure="fig7a"), args("fig7a"))
    sizes = (8, 16, 20)  # the baselines' limits; at each, every baseline that trains it, and stronghold
    wanted = {(s, n) for n in sizes for s in LIMITS if s == "stronghold" or LIMITS[s] >= n}
    assert {(p.system, p.layers) for p in runner.calls} == wanted - probed
    assert ("zero_offload", 16) in wanted - probed and ("no_offload", 16) not in wanted


def test_fig7a_without_a_finished_fig6a_says_what_to_run(tmp_path):
    with pytest.raises(ValueError, match="run `python -m examples.bench fig6a`"):
        fig7a(sweep(tmp_path, FakeRunner(LIMITS)), args("fig7a"))
    # Every baseline trained at 8 layers, none failed yet: 8 is a lower bound, not the limit.
    sw = sweep(tmp_path, FakeRunner(LIMITS))
    for system in ("no_offload", "zero_offload", "zero_infinity"):
        sw.point(Point(system=system, layers=8, **TINY))
    with pytest.raises(ValueError, match="no finished Fig. 6a search for no_offload"):
        fig7a(sweep(tmp_path, FakeRunner(LIMITS)), args("fig7a"))


def test_fig9_sweeps_each_knob_alone(tmp_path):
    runner = FakeRunner(LIMITS)
    fig9(sweep(tmp_path, runner), args("fig9", "--windows", "2,4", "--residents", "1", "--window-size", "3"))
    assert [p.stronghold for p in runner.calls] == [{"window_size": 2}, {"window_size": 4},
                                                    {"window_size": 3, "resident_blocks": 1}]
    assert all(p.layers == 32 and p.system == "stronghold" for p in runner.calls)
    assert json.loads(read_records(tmp_path)[0]["key"])["stronghold"] == {"window_size": 2}
