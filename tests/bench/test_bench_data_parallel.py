"""examples/bench/data_parallel.py on the CPU (gloo, DS_ACCELERATOR=cpu): a tiny GPT-2 through stronghold on 1
and 2 ranks, with a configuration in between whose rank 1 crashes at start (its rank 0 waits in the rendezvous
and is killed after the grace period); the lines, the summary's ratios, and the refusal without GPUs.

ZeRO-Offload is not run here: its first use JIT-builds DeepSpeedCPUAdam (~45 s on a fresh machine), past this
test's budget; test_bench_harness.py trains it on the CPU at world 1, and `--configs zero_offload:1,zero_offload:2
--device cpu` runs it by hand (~15 s a configuration once built). The crashing configuration is named
zero_offload so that the summary's ZeRO-Offload ratio has no success to use.
"""
import json
import subprocess
import sys

import pytest
from bench_fakes import ROOT

SHAPE = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "256",
         "--window-size", "2", "--resident-blocks", "1", "--warmup-steps", "1", "--timed-steps", "2"]


def _bench(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "examples.bench.data_parallel", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def dp_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dp")


# Three configurations trained in subprocesses, one and two ranks: every test that uses it is marked slow.
@pytest.fixture(scope="module")
def run(dp_dir):
    pytest.importorskip("stronghold.engine.engine")
    tmp = dp_dir
    out = _bench("--device", "cpu", "--out", str(tmp / "dp.jsonl"), "--log-dir", str(tmp / "logs"),
                 "--configs", "stronghold:1,zero_offload:2,stronghold:2", "--simulate-crash", "zero_offload:2@1",
                 "--grace-s", "2", "--config-timeout-s", "120", *SHAPE)
    lines = [json.loads(line) for line in (tmp / "dp.jsonl").read_text().splitlines()]
    return out, lines


@pytest.mark.slow
def test_each_configuration_is_a_line_with_its_measurements(run):
    out, lines = run
    assert out.returncode == 1, "a configuration failed"
    configs = [r for r in lines if r["kind"] == "config"]
    assert [(r["system"], r["world_size"]) for r in configs] == [("stronghold", 1), ("zero_offload", 2),
                                                                 ("stronghold", 2)]
    for r in (configs[0], configs[2]):
        world = r["world_size"]
        assert r["error"] is None, r.get("stderr_tail")
        assert r["commit"] and r["device"].startswith("cpu") and r["params_B"] > 0
        assert len(r["ranks"]) == world and [x["rank"] for x in r["ranks"]] == list(range(world))
        steps = list(zip(*(x["step_s_all"] for x in r["ranks"])))
        assert r["step_s_all"] == [max(s) for s in steps] and len(steps) == 2, "a step is the slowest rank's"
        assert r["samples_per_s"] > 0 and r["samples_per_s"] == pytest.approx(world * 2 / r["step_s"])
        assert all(x["peak_host_GB"] > 0.1 and x["rss_steady_GB"] > 0.1 for x in r["ranks"])
        assert all(len(x["per_step"]) == 2 and "deferred_blocks" in x["per_step"][0] for x in r["ranks"])
        for x in r["ranks"]:  # the rank's own timeline, its phases in order, its peak on it
            marks = x["rss_marks_s"]
            assert 0 < marks["built"] <= marks["first_step_done"] <= marks["warmed_up"] <= marks["timed_steps_done"]
            assert x["rss_peak_GB"] > 0.1 and len(x["warmup_step_s"]) == 1
            assert max(gb for _, gb, _ in x["rss_timeline_GB"]) == pytest.approx(x["rss_peak_GB"], abs=1e-3)  # rounded
            assert all(0 <= shared <= gb for _, gb, shared in x["rss_timeline_GB"])
        node = r["node"]
        assert node["samples"] > 0 and node["peak_used_GB"] > 0 and node["steady_used_GB"] is not None
        assert node["ranks_rss_sum_peak_GB"] > 0.1
        assert all(len(point) == 4 for point in node["timeline_GB"]), "[seconds, used, Shmem, AnonPages]"
        assert max(anon for *_, anon in node["timeline_GB"]) > 0.1, "the ranks' private memory (torch alone)"
        host = r["stronghold"]["host"]
        assert host["local_ranks"] == world and host["working_shared"] == (world > 1)
        assert r["floor"]["cpu_optim_s"] > 0 and r["floor_s"] is not None, "floor terms from rank 0"
        assert 4 < r["loss_first"] < 7, "ln(256) at init"
    one, two = configs[0]["stronghold"]["host"], configs[2]["stronghold"]["host"]
    assert two["rank_state_bytes"] < one["rank_state_bytes"], "each rank holds its shard of the states"
    assert all(r["launch"] == "spawn" for r in configs)
    assert configs[0]["speedup_vs_1gpu"] == 1.0 and configs[1]["speedup_vs_1gpu"] is None
    assert configs[2]["speedup_vs_1gpu"] == pytest.approx(configs[2]["samples_per_s"] / configs[0]["samples_per_s"])


@pytest.mark.slow
def test_a_failing_configuration_is_recorded_and_the_next_still_runs(run):
    _, lines = run
    failed = lines[1]
    assert failed["label"] == "zero_offload:2" and failed["error"] == "error" and failed["error_rank"] == 1
    assert "simulated crash on rank 1" in failed["error_detail"] and "simulated crash" in failed["stderr_tail"]
    survivor = failed["ranks"][0]
    assert survivor["error"] == "killed_after_peer_failure", "rank 0 waited for rank 1 and was stopped"
    assert failed["wall_s"] < 60, "stopped after the grace period, not at the configuration's timeout"
    assert lines[2]["error"] is None, "the configuration after the failure ran"


@pytest.mark.slow
def test_the_summary_holds_the_ratios_of_the_lines(run):
    out, lines = run
    configs = {(r["system"], r["world_size"]): r for r in lines if r["kind"] == "config"}
    summary = lines[-1]
    assert summary["kind"] == "summary" and len(lines) == 4
    one, two = configs["stronghold", 1], configs["stronghold", 2]
    ratios = summary["ratios"]
    assert ratios["stronghold_2_over_1"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert ratios["node_host_2_over_1_peak"] == pytest.approx(two["node"]["peak_used_GB"] / one["node"]["peak_used_GB"])
    assert ratios["stronghold_over_zero_offload_at_2"] is None and summary["pass"]["stronghold_over_zero_offload_at_2"] is None
    assert summary["configs"] == {"stronghold:1": None, "zero_offload:2": "error", "stronghold:2": None}
    assert "stronghold_2_over_1 =" in out.stdout and "| stronghold:2 (L4) |" in out.stdout


def test_refuses_without_enough_gpus(tmp_path):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    out = _bench("--out", str(tmp_path / "dp.jsonl"), *SHAPE)
    assert out.returncode == 3 and "needs 2 GPUs" in out.stderr
    assert not (tmp_path / "dp.jsonl").exists()


def test_prediction_of_the_largest_size_scales_the_node_peak():
    from examples.bench.dp_summary import predict_largest_layers, summarize

    record = {"kind": "config", "role": "measure", "label": "stronghold:2", "system": "stronghold", "world_size": 2,
              "error": None, "layers": 100, "host_total_GB": 251.0, "samples_per_s": 4.0,
              "node": {"baseline_GB": 11.0, "peak_used_GB": 96.0, "steady_used_GB": 90.0}}
    assert predict_largest_layers(record) == int(0.95 * 240 / 0.96)
    assert predict_largest_layers({**record, "error": "oom_host"}) is None
    summary = summarize([record, {**record, "label": "stronghold:1", "world_size": 1, "samples_per_s": 2.5,
                                  "node": {"baseline_GB": 11.0, "peak_used_GB": 90.0, "steady_used_GB": 88.0}}])
    assert summary["ratios"]["stronghold_2_over_1"] == pytest.approx(1.6) and summary["pass"]["stronghold_2_over_1"] is False
    assert summary["pass"]["node_host_2_over_1_peak"] is True and summary["predicted_largest_layers_at_2"] == 237


@pytest.mark.slow
def test_resume_skips_what_this_commit_measured(run, dp_dir):
    """--resume (an 8-GPU scaling run spans device calls): stronghold:1 succeeded in `run`, so it is not run again,
    and the summary line still counts it."""
    before = (dp_dir / "dp.jsonl").read_text().splitlines()
    out = _bench("--device", "cpu", "--out", str(dp_dir / "dp.jsonl"), "--log-dir", str(dp_dir / "logs"),
                 "--configs", "stronghold:1", "--resume", *SHAPE)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stronghold:1: measured at this commit already" in out.stdout
    after = [json.loads(line) for line in (dp_dir / "dp.jsonl").read_text().splitlines()]
    assert len(after) == len(before) + 1 and after[-1]["kind"] == "summary", "only a summary line is added"
    assert after[-1]["configs"] == {"stronghold:1": None}


def test_the_gc_mode_is_one_the_ranks_know(monkeypatch):
    from examples.bench.data_parallel_rank import GC_ENV, gc_mode

    monkeypatch.delenv(GC_ENV, raising=False)
    assert gc_mode() == "python"
    monkeypatch.setenv(GC_ENV, "freeze")
    assert gc_mode() == "freeze"
    monkeypatch.setenv(GC_ENV, "off")
    with pytest.raises(ValueError, match="BENCH_GC='off': use one of python, freeze"):
        gc_mode()


@pytest.mark.slow
@pytest.mark.parametrize("launch,configs,gc", [("torchrun", "stronghold:1,stronghold:2", "python"),
                                               ("deepspeed", "stronghold:2", "freeze")])
def test_a_users_launcher_starts_the_ranks(tmp_path, launch, configs, gc):
    """`--launch torchrun|deepspeed`: the launcher starts the ranks with no binding flag; each rank's lines reach
    the record, which names the launcher, and the engine shared the cores among the ranks itself. Each rank's record
    names its garbage-collection mode (BENCH_GC), and under "freeze" the rank froze its objects after the warm-up."""
    pytest.importorskip("stronghold.engine.engine")
    import os

    from examples.bench.data_parallel_rank import GC_ENV
    from stronghold.engine.cores import node_cpus

    out = _bench("--device", "cpu", "--out", str(tmp_path / "dp.jsonl"), "--log-dir", str(tmp_path / "logs"),
                 "--configs", configs, "--launch", launch, "--no-floor", "--config-timeout-s", "200", *SHAPE,
                 env={**os.environ, GC_ENV: gc})
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "dp.jsonl").read_text().splitlines()]
    records = {r["world_size"]: r for r in records if r["kind"] == "config"}
    two = records[2]
    assert two["launch"] == launch and two["error"] is None and len(two["ranks"]) == 2
    assert all(len(rank["step_s_all"]) == 2 for rank in two["ranks"]), "both ranks' lines were read"
    assert all(rank["gc_mode"] == gc and (rank["gc_frozen"] > 0) == (gc == "freeze") for rank in two["ranks"])
    assert two["node"]["ranks_rss_sum_peak_GB"] > 0.1, "the ranks were found among the launcher's descendants"
    assert all("inductor_compile_threads" in rank and rank["children_at_peak"] >= 0 for rank in two["ranks"])
    if 1 in records:
        assert records[1]["speedup_vs_1gpu"] == 1.0
        assert two["speedup_vs_1gpu"] == pytest.approx(two["samples_per_s"] / records[1]["samples_per_s"])
    else:
        assert two["speedup_vs_1gpu"] is None, "no 1-rank configuration in this command"
    cores = two["stronghold"]["cores"]
    if len(node_cpus()) >= 2 and set(os.sched_getaffinity(0)) == set(node_cpus()):
        assert cores["how"] == "share" and two["cores_per_rank"] == cores["cores"] <= len(node_cpus()) // 2 + 1


def _config_line(world: int, samples_per_s: float, peak: float, round_: int = 1, system: str = "stronghold") -> dict:
    return {"kind": "config", "role": "measure", "label": f"{system}:{world}", "system": system, "world_size": world,
            "error": None, "layers": 100, "host_total_GB": 251.0, "samples_per_s": samples_per_s, "round": round_,
            "node": {"baseline_GB": 1.0, "peak_used_GB": peak, "steady_used_GB": peak}}


def test_rounds_pair_their_own_configurations_and_report_the_median():
    """Three rounds of 1 and 2 ranks: each round's ratio is its own pair's, the summary's is their median (not the
    ratio of the newest lines, 9/4.5 = 2.0), and the labels name the rounds after the first."""
    from examples.bench.dp_summary import summarize

    lines = [_config_line(1, 5.0, 50.0, 1), _config_line(2, 8.0, 60.0, 1),
             _config_line(1, 4.0, 50.0, 2), _config_line(2, 8.8, 55.0, 2),
             _config_line(1, 4.5, 50.0, 3), _config_line(2, 9.0, 58.0, 3)]
    summary = summarize(lines)
    assert summary["ratios_by_round"]["stronghold_2_over_1"] == pytest.approx([1.6, 2.2, 2.0])
    assert summary["ratios"]["stronghold_2_over_1"] == pytest.approx(2.0)
    assert summary["ratios"]["node_host_2_over_1_peak"] == pytest.approx(1.16)
    assert summary["pass"]["stronghold_2_over_1"] is True and summary["pass"]["node_host_2_over_1_peak"] is False
    assert list(summary["configs"]) == ["stronghold:1", "stronghold:2", "stronghold:1#2", "stronghold:2#2",
                                        "stronghold:1#3", "stronghold:2#3"]
    one_round = summarize(lines[:2])
    assert "ratios_by_round" not in one_round and one_round["ratios"]["stronghold_2_over_1"] == pytest.approx(1.6)


def test_the_mean_step_ratio_counts_the_pauses_the_median_leaves_out():
    """Twelve steps of 1.0 s at 1 rank; at 2 ranks ten of 1.0 s and two of 1.5 s (a full collection on each rank,
    on different steps): the median sees 2.0x, the mean 2 x 12 / 13 = 1.846x."""
    from examples.bench.dp_summary import summarize

    one, two = _config_line(1, 4.0, 50.0, 1), _config_line(2, 8.0, 55.0, 1)
    one.update(step_s=1.0, step_s_all=[1.0] * 12)
    two.update(step_s=1.0, step_s_all=[1.0] * 10 + [1.5] * 2)
    ratios = summarize([one, two])["ratios"]
    assert ratios["stronghold_2_over_1"] == pytest.approx(2.0)
    assert ratios["stronghold_2_over_1_mean_step"] == pytest.approx(2 * 12 / 13)
    assert summarize([_config_line(1, 4.0, 50.0, 1), _config_line(2, 8.0, 55.0, 1)])["ratios"][
        "stronghold_2_over_1_mean_step"] is None, "records without their steps"


def test_rounds_run_the_configurations_in_turn(monkeypatch, tmp_path):
    """--rounds 2 runs 1, 2, 1, 2 (each 2-rank line's speedup is over the 1-rank line just before it), each line
    names its round, and --resume skips a round already measured at this commit."""
    import examples.bench.data_parallel as dp

    speeds = iter([5.0, 8.0, 4.0, 8.8, 4.4])
    ran = []

    def fake_run_config(point, world, timeout_s, opts):
        ran.append(world)
        return {**_config_line(world, next(speeds), 50.0 + world), "commit": dp.current_provenance().commit,
                "key": point.key()}

    monkeypatch.setattr(dp, "run_config", fake_run_config)
    out = tmp_path / "dp.jsonl"
    assert dp.main(["--device", "cpu", "--out", str(out), "--configs", "stronghold:1,stronghold:2", "--rounds", "2",
                    "--no-floor"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    configs = [r for r in lines if r["kind"] == "config"]
    assert ran == [1, 2, 1, 2] and [r["round"] for r in configs] == [1, 1, 2, 2]
    assert [r["speedup_vs_1gpu"] for r in configs] == pytest.approx([1.0, 1.6, 1.0, 2.2])
    assert lines[-1]["ratios_by_round"]["stronghold_2_over_1"] == pytest.approx([1.6, 2.2])
    assert dp.main(["--device", "cpu", "--out", str(out), "--configs", "stronghold:1", "--rounds", "3", "--resume",
                    "--no-floor"]) == 0
    assert ran == [1, 2, 1, 2, 1], "rounds 1 and 2 of stronghold:1 were measured at this commit"
    with pytest.raises(SystemExit):
        dp.main(["--device", "cpu", "--out", str(out), "--rounds", "0"])


def test_full_collection_steps_count_a_step_once_whichever_ranks_collected(capsys):
    """Rank 0 collects in step 1, rank 1 in step 2, both in step 3: three steps of four, each at its longest rank's
    pause; the table prints it beside the mean step."""
    from examples.bench.dp_summary import full_collection_steps, print_table, summarize

    record = _config_line(2, 8.0, 55.0, 1)
    record.update(step_s=1.0, step_s_all=[1.3, 1.4, 1.5, 1.0], ranks=[
        {"per_step": [{"gc2_s": 0.3}, {"gc2_s": 0.0}, {"gc2_s": 0.5}, {"gc2_s": 0.0}]},
        {"per_step": [{"gc2_s": 0.0}, {"gc2_s": 0.4}, {"gc2_s": 0.2}, {"gc2_s": 0.0}]}])
    assert full_collection_steps(record) == (3, 4, pytest.approx(1.2))
    assert full_collection_steps(_config_line(1, 4.0, 50.0, 1)) is None
    print_table([record], summarize([record]))
    assert "| 1.300 | 3/4 (1.20) |" in capsys.readouterr().out


def test_the_rank_timeline_reads_its_descendants_memory():
    """A child holding 64 MiB of its own pages shows in the rank's descendants' count and PSS (Inductor's compile
    workers are such children)."""
    import time

    from examples.bench.data_parallel_rank import RssTimeline

    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(64 << 20); print('held', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        timeline = RssTimeline(period_s=0.01, children_period_s=0.01)
        deadline = time.monotonic() + 60
        while not any(n >= 1 and pss > (48 << 20) for _, n, pss in list(timeline.children)):
            assert time.monotonic() < deadline, timeline.children[-3:]
            time.sleep(0.01)
        record = timeline.record()
    finally:
        child.communicate("")
    assert record["children_at_peak"] >= 1 and record["children_pss_peak_GB"] > 48 / 1024
    assert record["children_timeline"] and len(record["children_timeline"][0]) == 3
