"""The report from synthetic results: every figure's table, the claims' verdicts, the headline, PNGs.

The results come from the real figure sweeps driven by a fake runner (seed-like limits and speeds)
and go to a temporary directory, never into results/."""
import importlib.util

from bench_fakes import FakeRunner

from examples.bench.__main__ import build_parser
from examples.bench.figures import FIGURES
from examples.bench.report import write_report
from examples.bench.store import Provenance, ResultStore
from examples.bench.sweep import Sweep, SweepConfig

SHAPE = ["--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "128"]
# Seed-like: stronghold trains 28 layers where ZeRO stops at 12 and plain training at 8 (Fig. 6a).
LIMITS = {"no_offload": 8, "zero_offload": 12, "zero_infinity": 12, "stronghold": 28}
SYSTEM_SPEED = {"no_offload": 10.0, "zero_offload": 4.0, "zero_infinity": 3.8, "stronghold": 9.0}


def seed_like_speed(point):
    """samples/s: inverse in layers; stronghold's rises with the window up to 4, then flat."""
    window = point.stronghold.get("window_size", 4)
    return SYSTEM_SPEED[point.system] / point.layers * min(1.0, 0.5 + window / 8)


def run_all_figures(tmp_path, speed=seed_like_speed):
    runner = FakeRunner(LIMITS, speed=speed)
    extra = {"fig6a": ["--start", "8"], "fig8b": ["--layers", "4,8,12,16"], "fig9": ["--layers", "8"]}
    for figure, run in FIGURES.items():
        args = build_parser().parse_args([figure, *SHAPE, *extra.get(figure, [])])
        store = ResultStore(tmp_path, Provenance(commit="c0", dirty=False))
        run(Sweep(config=SweepConfig(figure=figure), store=store, run=runner), args)
    return write_report(build_parser().parse_args(["report", "--results-dir", str(tmp_path), *SHAPE,
                                                   "--fig9-layers", "8"]))


def claims_in(text):
    return {line.split("**")[1]: line.split("**: ")[1].split(".")[0] for line in text.splitlines()
            if line.startswith("- **")}


def test_seed_like_results_confirm_every_claim(tmp_path):
    report = run_all_figures(tmp_path).read_text()
    verdicts = claims_in(report)
    assert len(verdicts) == 5 and set(verdicts.values()) == {"confirmed"}, verdicts
    headline = (tmp_path / "headline.md").read_text()
    assert "best peer (zero_offload)" in headline, "the largest peer; ties broken by samples/s"
    assert "28 layers" in headline and "12 layers" in headline
    fig6a = (tmp_path / "fig6a.md").read_text()
    assert "| stronghold | " in fig6a and "oom_gpu at 32" in fig6a and "oom_host at 16" in fig6a
    assert "Device: FakeGPU (32 GiB). Commit: c0." in fig6a
    assert "R^2 = 1.0000" in (tmp_path / "fig8b.md").read_text()
    for name in ("fig7a", "fig9", "engine", "headline"):
        assert (tmp_path / f"{name}.md").exists()
    if importlib.util.find_spec("matplotlib"):
        pngs = sorted(p.name for p in tmp_path.glob("*.png"))
        assert pngs == ["fig6a.png", "fig7a.png", "fig8b.png", "fig9.png"]
        assert "![fig7a 32 GiB cap](fig7a.png)" in (tmp_path / "fig7a.md").read_text()


def test_slow_stronghold_is_not_confirmed(tmp_path):
    def slow(point):
        return seed_like_speed(point) * (0.3 if point.system == "stronghold" else 1.0)

    verdicts = claims_in(run_all_figures(tmp_path, speed=slow).read_text())
    assert verdicts["1.2x-3.7x the offloading baselines' throughput"] == "not confirmed"
    assert verdicts["close to Megatron-LM's throughput at Megatron-LM's largest size (no_offload stands in)"] == "not confirmed"


def test_empty_results_say_not_yet_measured(tmp_path):
    report = write_report(build_parser().parse_args(["report", "--results-dir", str(tmp_path)])).read_text()
    assert set(claims_in(report).values()) == {"not yet measured"}
    assert "Headline: not yet measured" in report


def test_unfinished_searches_give_no_verdict(tmp_path):
    """Only the engine check ran: every run trained, no search found a limit, so sizes are bounds."""
    store = ResultStore(tmp_path, Provenance(commit="c0", dirty=False))
    args = build_parser().parse_args(["engine", *SHAPE])
    FIGURES["engine"](Sweep(config=SweepConfig(figure="engine"), store=store, run=FakeRunner(
        {s: 1000 for s in LIMITS}, speed=seed_like_speed)), args)
    report = write_report(build_parser().parse_args(["report", "--results-dir", str(tmp_path), *SHAPE])).read_text()
    verdicts = claims_in(report)
    assert set(verdicts.values()) == {"not yet measured"}, verdicts
    assert "search has not finished for no_offload, zero_offload, zero_infinity" in report
    assert "lower bounds" in (tmp_path / "headline.md").read_text()


def test_report_finds_the_sweeps_knobs_without_being_told(tmp_path):
    """Sweeps run with --window-size 4 --resident-blocks 2; the report is called with no knob flags."""
    runner = FakeRunner(LIMITS, speed=seed_like_speed)
    store = ResultStore(tmp_path, Provenance(commit="c0", dirty=False))
    for figure, extra in (("fig8b", ["--layers", "4,8,12"]), ("fig9", ["--layers", "8", "--windows", "2,8"])):
        args = build_parser().parse_args([figure, *SHAPE, "--window-size", "4", "--resident-blocks", "2", *extra])
        FIGURES[figure](Sweep(config=SweepConfig(figure=figure), store=store, run=runner), args)
    write_report(build_parser().parse_args(["report", "--results-dir", str(tmp_path), *SHAPE, "--fig9-layers", "8"]))
    assert "R^2 = 1.0000" in (tmp_path / "fig8b.md").read_text()
    fig9 = (tmp_path / "fig9.md").read_text()
    assert "| 2 | ok |" in fig9 and "| 8 | ok |" in fig9, "window sweep found with resident_blocks=2 held"


def test_each_figure_is_reported_with_its_own_sweeps_knobs(tmp_path):
    """Fig. 6a/7a ran with resident_blocks 3 (more runs than any other sweep), Fig. 8b with 2, Fig. 6a
    uncapped with 5: Fig. 8b still reports its own series, the headline compares at Fig. 6a's knobs,
    and the uncapped table at the uncapped search's."""
    runner = FakeRunner(LIMITS, speed=seed_like_speed)
    store = ResultStore(tmp_path, Provenance(commit="c0", dirty=False))
    for figure, extra in (("fig8b", ["--layers", "4,8,12", "--resident-blocks", "2"]),
                          ("fig6a", ["--start", "8", "--resident-blocks", "3"]),
                          ("fig7a", ["--resident-blocks", "3"]),
                          ("fig6a", ["--start", "8", "--caps", "none", "--resident-blocks", "5",
                                     "--systems", "stronghold"])):
        args = build_parser().parse_args([figure, *SHAPE, *extra])
        FIGURES[figure](Sweep(config=SweepConfig(figure=figure), store=store, run=runner), args)
    write_report(build_parser().parse_args(["report", "--results-dir", str(tmp_path), *SHAPE]))
    fig8b_rows = [line for line in (tmp_path / "fig8b.md").read_text().splitlines() if line.startswith("| 0.")]
    assert len(fig8b_rows) == 3, "only the Fig. 8b sweep's three points, not Fig. 6a's search probes"
    assert "28 layers" in (tmp_path / "headline.md").read_text()
    assert "not yet measured" not in (tmp_path / "fig7a.md").read_text()
    uncapped = (tmp_path / "fig6a.md").read_text().split("### uncapped")[1]
    assert "| stronghold | 0." in uncapped, "the uncapped search (its own knobs) is found"


def test_knob_groups_hold_the_other_knobs():
    from bench_fakes import record

    from examples.bench.point import Point
    from examples.bench.queries import knob_groups, latest

    base = Point(system="stronghold", layers=8, hidden=64, heads=4, seq=32, batch=2)
    runs = [record(base.with_(stronghold={"window_size": w, "resident_blocks": r})) for w, r in
            ((2, 1), (4, 1), (8, 1), (4, 8), (2, 8))] + [record(base.with_(layers=12, stronghold={"window_size": 2}))]
    groups = knob_groups(latest(runs), base, "window_size")
    assert {held: [v for v, _ in found] for held, found in groups.items()} == {
        '{"resident_blocks": 1}': [2, 4, 8], '{"resident_blocks": 8}': [2, 4]}
