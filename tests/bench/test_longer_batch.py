"""examples/bench/longer_batch.py on the CPU: the record of a point whose first micro-batches are shorter than the
rest, and the arguments it refuses. (On the CPU nothing is planned, so the window stays as built: the shrink itself is
tests/engine/test_batch_room.py's.)"""
import json
import subprocess
import sys

import pytest

from examples.bench.harness import child_env
from examples.bench.store import REPO_ROOT

TINY = ["--system", "stronghold", "--arch", "llama", "--layers", "3", "--hidden", "64", "--heads", "4", "--seq", "32",
        "--batch", "1", "--accumulation", "2", "--vocab", "256", "--warmup-steps", "1", "--timed-steps", "1"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**child_env(), "DS_ACCELERATOR": "cpu", "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "examples.bench.longer_batch", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a child process importing torch and DeepSpeed
def test_a_point_with_a_shorter_first_micro_batch_is_recorded(tmp_path):
    out = tmp_path / "longer.jsonl"
    done = _run(*TINY, "--first-seq", "16", "--first-micro-batches", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record == json.loads(done.stdout.strip().splitlines()[-1])
    assert record["error"] is None and record["figure"] == "longer_batch" and record["first_seq"] == 16
    assert record["first_micro_batches"] == 2
    assert len(record["step_s_all"]) == len(record["window_sizes"]) == len(record["resident_blocks"]) == 2
    assert record["step_s"] == record["step_s_all"][1] and len(record["losses"]) == 4
    assert record["seq"] == 32 and record["commit"]


@pytest.mark.parametrize("first", ["0", "33"])
def test_a_first_length_outside_one_to_seq_is_refused(first):
    done = _run(*TINY, "--first-seq", first)
    assert done.returncode == 2 and "1 <= --first-seq <= --seq (32)" in done.stderr


@pytest.mark.parametrize("count", ["0", "3"])
def test_first_micro_batches_outside_one_to_the_accumulation_are_refused(count):
    done = _run(*TINY, "--first-seq", "16", "--first-micro-batches", count)
    assert done.returncode == 2 and "--first-micro-batches must be from 1 to --accumulation (2)" in done.stderr
