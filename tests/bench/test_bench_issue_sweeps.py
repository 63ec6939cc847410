"""The seqlen sweep (issue 13), the kernels sweep and its report (issue 10), and the ZeRO-Infinity
cpu_checkpointing variant, with fakes (no GPU); one real CPU run checks DeepSpeed's checkpoint runs."""
import json
import subprocess
import sys

import pytest
from bench_fakes import ROOT, FakeClock, record

from examples.bench.__main__ import build_parser
from examples.bench.figures import kernels, seqlen
from examples.bench.kernels import KERNEL_SHAPES, applicable_kernels, kernels_points, set_label
from examples.bench.kernels_report import analyse, markdown
from examples.bench.point import Point
from examples.bench.search import IntSearch, largest_trainable
from examples.bench.store import Provenance, ResultStore, read_records
from examples.bench.sweep import BudgetExhausted, Sweep, SweepConfig
from examples.bench.systems import ds_config

LLAMA = ["--arch", "llama", "--hidden", "64", "--heads", "4", "--batch", "1", "--vocab", "300"]
SEQ_LIMITS = {"on": 40960, "off": 16384, "zero_infinity": 12288}


def variant(point):
    if point.system == "zero_infinity":
        return "zero_infinity"
    return "on" if point.stronghold.get("offload_activations") else "off"


class SeqRunner:
    """Trains up to SEQ_LIMITS[variant] tokens; above, GPU OOM (host OOM for ZeRO-Infinity)."""

    def __init__(self, clock=None, seconds=10.0):
        self.calls, self.clock, self.seconds = [], clock, seconds

    def __call__(self, point, timeout_s):
        self.calls.append(point)
        if self.clock is not None:
            self.clock.now += self.seconds
        if point.seq > SEQ_LIMITS[variant(point)]:
            return record(point, "oom_host" if point.system == "zero_infinity" else "oom_gpu", peak_gpu_GB=31.9)
        slower = 1.05 if variant(point) == "on" else 1.0
        return record(point, samples_per_s=1.0 / slower)


def sweep(tmp_path, runner, figure, budget_s=10_000.0, clock=None):
    store = ResultStore(tmp_path, Provenance(commit="c0", dirty=False))
    config = SweepConfig(figure=figure, budget_s=budget_s, point_timeout_s=100.0, min_start_s=20.0)
    return Sweep(config=config, store=store, run=runner, clock=clock or FakeClock())


def args(*argv):
    return build_parser().parse_args(list(argv))


SEQLEN = ("seqlen", *LLAMA, "--layers", "4", "--start-seq", "4096", "--step-seq", "2048")


def test_int_search_over_seq():
    plan = IntSearch(field="seq", start=4096, step=2048, growth=2.0, maximum=262144)
    result = largest_trainable(lambda seq: seq <= 40960, plan)
    assert (result.largest_fit, result.smallest_failure) == (40960, 43008)
    assert list(result.probes) == [4096, 8192, 16384, 32768, 65536, 49152, 40960, 45056, 43008]
    with pytest.raises(ValueError, match="step_seq=0"):
        IntSearch(field="seq", start=4096, step=0, maximum=8192)
    with pytest.raises(ValueError, match="start_seq=9000 must be in 1..max_seq=8192"):
        IntSearch(field="seq", start=9000, step=2048, maximum=8192)


def test_seqlen_probes_each_variant_then_times_the_pair(tmp_path, capsys):
    runner = SeqRunner()
    seqlen(sweep(tmp_path, runner, "seqlen"), args(*SEQLEN))
    by_variant = {}
    for p in runner.calls:
        by_variant.setdefault(variant(p), []).append((p.seq, p.timed_steps))
    assert [seq for seq, steps in by_variant["on"] if steps == 1] == \
        [4096, 8192, 16384, 32768, 65536, 49152, 40960, 45056, 43008]
    assert [seq for seq, _ in by_variant["off"]][:4] == [4096, 8192, 16384, 32768]
    # Stronghold's two searches, then the timed pair (2 warm-up, 3 timed) at the longest seq both
    # train, then ZeRO-Infinity's search.
    kinds = [(variant(p), p.timed_steps) for p in runner.calls]
    first_zi = kinds.index(("zero_infinity", 1))
    assert kinds[first_zi - 2:first_zi] == [("on", 3), ("off", 3)]
    timed = runner.calls[first_zi - 2:first_zi]
    assert [(p.seq, p.warmup_steps) for p in timed] == [(16384, 2), (16384, 2)]
    zi = [p for p in runner.calls if p.system == "zero_infinity"]
    assert all(p.cpu_checkpointing and p.layers == 4 and p.arch == "llama" for p in zi)
    assert max(p.seq for p in zi if p.seq <= 12288) == 12288
    out = capsys.readouterr().out
    assert "offload on cap 32.0: longest trainable seq 40960 (limit: seq 43008: oom_gpu (peak GPU 31.9" in out
    assert "zero_infinity cpu_checkpointing cap 32.0: longest trainable seq 12288 (limit: seq 14336: oom_host" in out
    assert "at seq 16384, step s offload on 1.05, off 1.0: offload costs +5.0%" in out
    assert "offload on / stronghold offload off: 2.50x" in out and "offload on / zero_infinity cpu_checkpointing: 3.33x" in out
    knobs = {json.dumps(r["stronghold_knobs"], sort_keys=True) for r in read_records(tmp_path)}
    assert knobs == {"{}", '{"kernels": true, "offload_activations": false}', '{"kernels": true, "offload_activations": true}'}, \
        "the same kernels in both stronghold variants (all), none for ZeRO-Infinity"


def test_seqlen_resumes_across_budget_cut_commands(tmp_path):
    clock = FakeClock()
    runner = SeqRunner(clock=clock, seconds=30.0)
    commands = 0
    while True:
        commands += 1
        clock.now = 0.0
        try:
            seqlen(sweep(tmp_path, runner, "seqlen", budget_s=100.0, clock=clock), args(*SEQLEN))
            break
        except BudgetExhausted:
            assert commands < 40
    assert commands > 5
    runs = [(p.key(), p.timed_steps) for p in runner.calls]
    assert len(runs) == len(set(runs)), "a point was run twice"
    fresh = SeqRunner()
    seqlen(sweep(tmp_path, fresh, "seqlen"), args(*SEQLEN))
    assert fresh.calls == [], "a finished sweep runs nothing again"


def test_seqlen_on_gpt2_skips_zero_infinity(tmp_path, capsys):
    runner = SeqRunner()
    seqlen(sweep(tmp_path, runner, "seqlen"), args("seqlen", "--hidden", "64", "--heads", "4", "--layers", "4",
                                                  "--start-seq", "8192", "--step-seq", "4096"))
    assert {p.system for p in runner.calls} == {"stronghold"}
    assert "not run for arch gpt2" in capsys.readouterr().out


def test_kernels_points_per_arch():
    assert applicable_kernels("gpt2") == ["layer_norm", "gelu_tanh", "fused_linear_cross_entropy"]
    assert applicable_kernels("llama") == ["rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"]
    full = kernels_points(args("kernels"), "llama", 32.0)
    assert [(p.stronghold["kernels"], p.repeat) for p in full] == [
        (False, 0), (True, 0), (["rms_norm"], 0), (["swiglu"], 0), (["rope"], 0),
        (["fused_linear_cross_entropy"], 0), (False, 1), (True, 1)]
    p = full[0]
    assert (p.arch, p.hidden, p.heads, p.layers, p.seq, p.batch, p.accumulation, p.vocab, p.gpu_cap_GB) == \
        ("llama", 2560, 20, 32, 2048, 2, 8, 32000, 32.0)
    assert all(q.stronghold["resident_blocks"] == 16 for q in full)
    assert len({q.key() for q in full}) == len(full), "repeats are their own records"
    gpt2 = kernels_points(args("kernels", "--layers", "16", "--timed-steps", "5"), "gpt2", 32.0)
    assert [set(q.stronghold) for q in gpt2] == [{"kernels", "resident_blocks"}] * 7
    assert {(q.layers, q.stronghold["resident_blocks"], q.seq, q.batch, q.timed_steps) for q in gpt2} == \
        {(16, 12, 1024, 4, 5)}, "16 layers: the same 4 streamed blocks as at 32 with 28 resident"
    assert KERNEL_SHAPES["llama"].resident_at(16) == 8
    given = kernels_points(args("kernels", "--resident-blocks", "3"), "gpt2", None)
    assert {q.stronghold["resident_blocks"] for q in given} == {3}


def test_kernels_defaults_sets_run_none_default_and_all_twice():
    points = kernels_points(args("kernels", "--kernel-sets", "defaults", "--layers", "16"), "gpt2", 32.0)
    assert [(p.stronghold["kernels"], p.repeat) for p in points] == [
        (False, 0), ("auto", 0), (True, 0), (False, 1), ("auto", 1), (True, 1)]
    assert [set_label(p.stronghold["kernels"]) for p in points[:3]] == ["none", "default", "all"]


def test_kernels_sweep_runs_every_arch_in_order(tmp_path):
    calls = []

    def runner(point, timeout_s):
        calls.append(point)
        return record(point)

    kernels(sweep(tmp_path, runner, "kernels"), args("kernels", "--layers", "4"))
    assert [p.arch for p in calls] == ["gpt2"] * 7 + ["llama"] * 8
    kernels(sweep(tmp_path, runner, "kernels"), args("kernels", "--layers", "4"))
    assert len(calls) == 15, "the second command finds every point in the store"


def ab_records(times, base=Point(system="stronghold", layers=16, arch="llama", hidden=64, heads=4, seq=32, batch=2)):
    out = []
    for (value, repeat), step_s in times.items():
        value = list(value) if isinstance(value, tuple) else value
        point = base.with_(stronghold={"resident_blocks": 8, "kernels": value}, repeat=repeat)
        out.append(record(point, samples_per_s=point.batch / step_s) if step_s else record(point, "oom_gpu"))
    return out


def test_kernels_report_ratios_noise_and_winners():
    times = {(False, 0): 1.00, (True, 0): 0.90, (("rms_norm",), 0): 0.95, (("swiglu",), 0): 0.99,
             (("rope",), 0): 1.05, (("fused_linear_cross_entropy",), 0): None, (False, 1): 1.04, (True, 1): 0.91}
    records = ab_records(times)
    from examples.bench.kernels_report import ab_groups

    (sets,) = ab_groups(records).values()
    result = analyse(sets)
    assert result["base_s"] == pytest.approx(1.02)
    assert result["noise"] == pytest.approx(0.04 / 1.02), "none's spread, larger than all's"
    rows = result["rows"]
    assert rows["rms_norm"]["speedup"] == pytest.approx(1.02 / 0.95)
    assert rows["all"]["speedup"] == pytest.approx(1.02 / 0.905)
    assert rows["rms_norm"]["verdict"].startswith("on")
    assert rows["swiglu"]["verdict"].startswith("off") and "within the noise" in rows["swiglu"]["verdict"]
    assert rows["rope"]["verdict"].startswith("off: 0.971x < 1.02")
    assert rows["fused_linear_cross_entropy"]["errors"] == ["oom_gpu"]
    assert result["winners"] == ["rms_norm"]
    text = markdown(records)
    assert "## llama: h64, 16 layers" in text and "Noise (repeated baselines): 3.92%" in text
    assert "| rms_norm | 0.9500 | 0.9500 | 1.074 |" in text and "Winners alone: rms_norm." in text


def test_zero_infinity_cpu_checkpointing_config_and_key():
    p = Point(system="zero_infinity", layers=32, arch="llama", hidden=2560, heads=20, seq=8192, batch=1,
              vocab=32000, cpu_checkpointing=True)
    config = ds_config(p)
    assert config["zero_optimization"]["stage"] == 3 and "offload_param" in config["zero_optimization"]
    assert config["activation_checkpointing"] == {
        "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
        "number_checkpoints": 32, "synchronize_checkpoint_boundary": False, "profile": False}
    assert "activation_checkpointing" not in ds_config(p.with_(cpu_checkpointing=False))
    assert json.loads(p.key())["cpu_checkpointing"] is True
    assert "cpu_checkpointing" not in json.loads(p.with_(cpu_checkpointing=False).key()), "old keys unchanged"
    assert p.label().endswith("-cpuckpt")
    one = build_parser().parse_args(["one", "--system", "zero_infinity", *p.with_(system="zero_infinity").to_argv()[2:]])
    from examples.bench.point import point_from_args

    assert point_from_args(one) == p
    for bad, words in ((dict(system="stronghold"), "DeepSpeed system"), (dict(checkpointing=False), "checkpointing on"),
                       (dict(arch="gpt2", hidden=64, heads=4), "GPT-2")):
        with pytest.raises(ValueError, match=words):
            p.with_(**bad)


def run_one(*extra):
    argv = [sys.executable, "-m", "examples.bench.run_one", "--system", "zero_infinity", "--arch", "llama",
            "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--accumulation", "2",
            "--gpu-cap-gb", "none", "--warmup-steps", "1", "--timed-steps", "1", *extra]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"') and '"result"' in line]
    assert lines, out.stderr[-2000:]
    return lines[-1]


@pytest.mark.slow
def test_deepspeed_cpu_checkpointing_trains_like_torch_checkpointing_on_the_cpu():
    pytest.importorskip("deepspeed")
    torch_ckpt, ds_ckpt = run_one(), run_one("--cpu-checkpointing")
    assert torch_ckpt["error"] is None and ds_ckpt["error"] is None, ds_ckpt.get("error_detail")
    assert ds_ckpt["ds_checkpoint_calls_first_step"] == 4, "2 blocks x 2 micro-batches through DeepSpeed's checkpoint"
    assert "ds_checkpoint_calls_first_step" not in torch_ckpt
    assert ds_ckpt["loss_first"] == torch_ckpt["loss_first"]
    assert ds_ckpt["loss_last"] == pytest.approx(torch_ckpt["loss_last"], rel=1e-6)
