"""scripts/gpu_next_session.sh, the next GPU session's commands: it parses, names an unknown stage, refuses the
2-GPU stages without 2 GPUs, and survives a failed stage to run the next (what a 30-minute session relies on)."""
import os
import subprocess

from bench_fakes import ROOT

SCRIPT = ROOT / "scripts" / "gpu_next_session.sh"


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_stages_fail_alone_and_are_logged(tmp_path):
    # A copy in a tree without `.whl/` (a developer's checkout may hold the GPU machine's wheels, which the
    # script would install): these two stages need nothing else from the repository.
    (tmp_path / "scripts").mkdir()
    copy = tmp_path / "scripts" / SCRIPT.name
    copy.write_text(SCRIPT.read_text())
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "BENCH_COMMIT": "test", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(copy), "bogus", "dp", "scale"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    log = (out / "session.log").read_text()
    assert "unknown stage bogus" in log and "stage bogus: exit 1" in log
    assert "stage dp needs 2 GPUs" in log and "stage dp: exit 1" in log, "the stage after a failed one still runs"
    assert "stage scale needs several GPUs" in log and "stage scale: exit 1" in log
    assert done.returncode == 0, "the script reports stage failures in the log, not in its status"
