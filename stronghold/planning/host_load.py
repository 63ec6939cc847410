"""What else the host ran over an interval: the CPUs busy in all, and the other processes that kept them busy.

The placement's CPU AdamW probe at construction has measured rates that differ by more than a third between runs of
one shape on one machine, with this process keeping fewer CPUs busy in the slow runs: other work held cores. Its
record (measured_rates.py, `cpu_adam_probe`) keeps this interval's view beside the rate, so that a slow probe names
what ran beside it. Reads /proc through psutil: two snapshots of every process's CPU times, a few milliseconds each
on a host with hundreds of processes, taken once.
"""
from __future__ import annotations

import os
from typing import Optional

import psutil

TOP = 5
"""The other processes listed, busiest first."""
MIN_CPUS = 0.05
"""A process busy for less than this share of one CPU over the interval is left out."""


def snapshot() -> dict:
    """The host's CPU times and every process's (pid -> (name, user + system seconds)) now."""
    processes = {}
    for process in psutil.process_iter(["name", "cpu_times"]):
        times = process.info.get("cpu_times")
        if times is not None:
            processes[process.pid] = (process.info.get("name") or "?", times.user + times.system)
    host = psutil.cpu_times()  # Linux counts guest time inside user time as well: not twice
    idle = host.idle + sum(getattr(host, name, 0.0) for name in ("iowait", "guest", "guest_nice"))
    return {"host_busy_s": sum(host) - idle, "processes": processes}


def between(before: dict, after: dict, wall_s: float, own_pid: Optional[int] = None) -> dict:
    """CPUs busy over `wall_s` between two snapshots: the host's in all, and the other busiest processes (a process
    that started or ended between them counts from what the snapshot it is in shows)."""
    own_pid = os.getpid() if own_pid is None else own_pid
    wall_s = max(wall_s, 1e-9)
    others = []
    for pid, (name, seconds) in after["processes"].items():
        if pid == own_pid:
            continue
        busy = (seconds - before["processes"].get(pid, (name, 0.0))[1]) / wall_s
        if busy >= MIN_CPUS:
            others.append({"pid": pid, "name": name, "cpus_busy": round(busy, 2)})
    others.sort(key=lambda entry: -entry["cpus_busy"])
    return {"host_cpus_busy": round((after["host_busy_s"] - before["host_busy_s"]) / wall_s, 2),
            "other_processes": others[:TOP]}
