"""host_load.py: the host's busy CPUs and the other busiest processes between two snapshots."""
import subprocess
import sys

import psutil

from stronghold.planning import host_load


def snap(host_busy_s: float, **processes) -> dict:
    return {"host_busy_s": host_busy_s,
            "processes": {int(pid[1:]): (name, seconds) for pid, (name, seconds) in processes.items()}}


def test_the_other_processes_busiest_first_without_this_one_or_the_idle_ones():
    before = snap(100.0, p1=("me", 10.0), p2=("compile", 5.0), p3=("idle", 1.0), p4=("gone", 3.0))
    after = snap(106.0, p1=("me", 14.0), p2=("compile", 6.5), p3=("idle", 1.01), p5=("new", 0.5))
    seen = host_load.between(before, after, wall_s=2.0, own_pid=1)
    assert seen == {"host_cpus_busy": 3.0, "other_processes": [{"pid": 2, "name": "compile", "cpus_busy": 0.75},
                                                               {"pid": 5, "name": "new", "cpus_busy": 0.25}]}
    many = snap(0.0, **{f"p{i}": ("busy", float(i)) for i in range(2, 12)})
    listed = host_load.between(snap(0.0), many, wall_s=1.0, own_pid=1)["other_processes"]
    assert [entry["pid"] for entry in listed] == [11, 10, 9, 8, 7][:host_load.TOP]


def test_a_real_snapshot_sees_a_busy_child_process():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before = host_load.snapshot()
        assert child.pid in before["processes"] and before["host_busy_s"] > 0
        watched = psutil.Process(child.pid)
        start = sum(watched.cpu_times()[:2])
        while sum(watched.cpu_times()[:2]) - start < 0.2:  # CPU time it has used, not a clock: no timing verdict
            pass
        seen = host_load.between(before, host_load.snapshot(), wall_s=1.0)
    finally:
        child.kill()
        child.wait()
    assert any(entry["pid"] == child.pid and entry["cpus_busy"] >= 0.2 for entry in seen["other_processes"])
