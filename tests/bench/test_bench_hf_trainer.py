"""examples/hf_trainer.py with --arch llama and accumulation: its flag checks, and one tiny run of the
one-liner on the CPU whose JSON line has the steady-state samples/s and the set-up time."""
import json
import subprocess
import sys

import pytest
from bench_fakes import ROOT

from examples.hf_trainer import parse_args

LLAMA = ["--arch", "llama", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq", "64",
         "--batch", "2", "--accumulation", "2", "--vocab", "300"]


@pytest.mark.parametrize("argv, words", [
    (["--intermediate", "100"], "Llama-only"),
    (["--arch", "llama", "--kv-heads", "3"], "not a multiple of kv_heads=3"),
    (["--steps", "4", "--warmup-steps", "4"], "below --steps"),
    (["--vocab", "100"], "at least 256"),
])
def test_bad_flags_are_refused_with_the_fix(capsys, argv, words):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert words in capsys.readouterr().err


def test_default_warmup_leaves_a_step_to_time():
    assert parse_args([]).warmup_steps == 3
    assert parse_args(["--steps", "2"]).warmup_steps == 1
    opts = parse_args(LLAMA)
    assert (opts.arch, opts.kv_heads, opts.intermediate, opts.accumulation) == ("llama", 2, None, 2)


@pytest.mark.slow
def test_one_liner_reports_steady_state_and_set_up(tmp_path):
    pytest.importorskip("stronghold.engine.engine")
    out = tmp_path / "hf.jsonl"
    run = subprocess.run([sys.executable, "examples/hf_trainer.py", *LLAMA, "--steps", "4", "--warmup-steps", "2",
                          "--output-dir", str(tmp_path / "trainer"), "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["stronghold"] and s["trained"] and (s["arch"], s["intermediate"], s["kv_heads"]) == ("llama", 256, 2)
    assert s["timed_steps"] == 2 and len(s["step_s_all"]) == 4
    # Both sides are the same quotient; each step time is rounded to 1e-6 s and a CPU step here takes at
    # least ~1e-2 s, so the sums differ by at most 2e-6 / 2e-2 = 1e-4 relative (samples_per_s keeps 6 decimals).
    assert s["samples_per_s"] == pytest.approx(2 * 2 * 2 / sum(s["step_s_all"][2:]), rel=1e-4)
    assert s["setup_s"] > s["startup_s"] + s["build_s"] + s["trainer_setup_s"] > 0
    assert s["prepare_s"] is not None and s["engine"]["steps"] == 4
