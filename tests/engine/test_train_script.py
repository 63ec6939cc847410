"""examples/train.py, the main job (`make train`): what it leaves in its output directory, and --resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from examples.train import main, parse_args

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--deepspeed_config", str(ROOT / "ds_configs" / "stronghold_cpu.json"), "--seq", "32", "--layers", "3"]
CPU_METRICS = {"step", "loss", "lr", "step_s", "samples_per_s", "tokens_per_s", "host_GB"}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _checkpoint_tensors(run: Path) -> dict[str, torch.Tensor]:
    save_dir = run / "checkpoint"
    tag = (save_dir / "latest").read_text().strip()
    tensors = {}
    for shard in sorted((save_dir / tag).glob("state-*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU sizes; tests/engine/test_gpu.py runs the job on a GPU")
def test_a_run_leaves_its_results_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    """4 steps in one run against 2 steps, then --resume to 4: the same losses and learning rates step for step
    and bit-identical weights and AdamW states (fp32 on the CPU; the checkpoint holds the data position and
    the random state, so dropout draws the same masks)."""
    monkeypatch.chdir(tmp_path)
    main([*TINY, "--steps", "4", "--output-dir", str(tmp_path / "full")])
    capsys.readouterr()
    main([*TINY, "--steps", "2"])  # the default output directory: runs/<timestamp>
    out = capsys.readouterr().out
    (halted,) = (tmp_path / "runs").iterdir()

    # What the first part left: the resolved config, a line per step, the final checkpoint, the summary.
    config = json.loads((halted / "config.json").read_text())
    assert config["model"] == {"hidden": 128, "layers": 3, "heads": 4, "seq": 32, "vocab": 256}
    assert config["deepspeed"]["optimizer"]["type"] == "AdamW" and config["steps"] == 2
    assert {k: config["stronghold_resolved"][k] for k in ("window_size", "resident_blocks")} == {
        "window_size": 2, "resident_blocks": 1}
    metrics = _metrics(halted)
    assert [m["step"] for m in metrics] == [1, 2] and all(set(m) == CPU_METRICS for m in metrics)
    assert (halted / "checkpoint" / "latest").read_text().strip() == "global_step2"
    assert json.loads((halted / "summary.json").read_text())["steps"] == 2
    # The step lines on the CPU: no GPU fields; stdout is not a terminal here, so no progress bar either.
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and not any("GPU" in line or "TFLOP" in line for line in steps)
    assert "\r" not in out and "train:" not in out

    with pytest.raises(ValueError, match="--layers 5: the resumed run has layers 3"):
        main(["--resume", str(halted), "--layers", "5"])
    main(["--resume", str(halted), "--steps", "4"])
    full, resumed = _metrics(tmp_path / "full"), _metrics(halted)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert [(m["loss"], m["lr"]) for m in resumed] == [(m["loss"], m["lr"]) for m in full]
    expected, got = _checkpoint_tensors(tmp_path / "full"), _checkpoint_tensors(halted)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_gradient_checkpointing_flag_keeps_its_old_name():
    assert parse_args([*TINY, "--grad-checkpointing"]).grad_checkpointing
    assert parse_args([*TINY, "--checkpointing"]).grad_checkpointing
    assert not parse_args(TINY).grad_checkpointing


def test_resume_without_a_checkpoint_names_what_it_takes(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint there; give a run directory"):
        main(["--resume", str(tmp_path)])
