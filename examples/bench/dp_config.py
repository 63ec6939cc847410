"""One configuration of the data-parallel bench (data_parallel.py): start its ranks (this parent, torchrun or
deepspeed), watch them and the node's memory until they end or are killed, and build the configuration's record from
the ranks' lines (data_parallel_rank.py) and what only the parent sees (the node's memory, kills, timeouts)."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.bench.data_parallel_rank import (BASELINE_ENV, dev_shm_bytes, node_memory_bytes, proc_rss,
                                               settle_node_memory)
from examples.bench.harness import RENDEZVOUS, child_env, classify, parse_child_output, tail
from examples.bench.launchers import RANK_LOG_ENV, kill_ranks, launcher_argv, rank_pids
from examples.bench.point import Point
from examples.bench.run_one import GiB
from examples.bench.store import REPO_ROOT, current_provenance, now_iso, point_fields

FIGURE = "data_parallel"
TIMELINE_S = 1.0


@dataclass(kw_only=True)
class Options:
    device: str = "cuda"
    """`cuda`, or `cpu` (DS_ACCELERATOR=cpu, gloo, CUDA hidden from the ranks: tests)."""
    log_dir: Path
    grace_s: float = 30.0
    """After a rank fails, how long the others get to report before they are killed."""
    sample_s: float = 0.2
    floor: bool = True
    bind_cores: bool = False
    """Bind each rank to an equal share of the cores before it starts (the engine shares them itself)."""
    launch: str = "spawn"
    """Who starts the ranks: this parent (`spawn`), `torchrun` or `deepspeed` (launchers.py)."""
    simulate_crash: str | None = None
    """Test-only: `system:world@rank` makes that rank raise at start."""


def _child_argv(point: Point, world: int, rank: int, opts: Options) -> list[str]:
    argv = [sys.executable, "-m", "examples.bench.data_parallel", "--child", *point.to_argv()]
    if not opts.floor:
        argv.append("--no-floor")
    if opts.bind_cores:
        argv.append("--bind-cores")
    if opts.simulate_crash == f"{point.system}:{world}@{rank}":
        argv.append("--simulate-crash")
    return argv


def _rank_env(rank: int, world: int, port: int, baseline: int, device: str) -> dict[str, str]:
    env = child_env()
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    env[BASELINE_ENV] = str(baseline)
    if device == "cpu":
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    return env


def run_config(point: Point, world: int, timeout_s: float, opts: Options, role: str = "measure") -> dict[str, Any]:
    """Run `point` on `world` ranks; the configuration's record (also for failures)."""
    import torch.distributed

    label = f"{point.system}:{world}"
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    baseline = settle_node_memory()
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    started = time.monotonic()
    procs, paths = [], []  # procs: (process, the ranks it runs): one per rank, or a launcher for all
    for rank in range(world):
        stem = opts.log_dir / f"{point.label()}-w{world}-r{rank}"
        paths.append((stem.with_suffix(".out"), stem.with_suffix(".err")))
        if opts.launch == "spawn":
            with open(paths[-1][0], "w") as out, open(paths[-1][1], "w") as err:
                procs.append((subprocess.Popen(_child_argv(point, world, rank, opts), stdout=out, stderr=err,
                                               cwd=REPO_ROOT, start_new_session=True,
                                               env=_rank_env(rank, world, store.port, baseline, opts.device)),
                              [rank]))
    if opts.launch != "spawn":
        env = {k: v for k, v in _rank_env(0, world, store.port, baseline, opts.device).items()
               if k not in (*RENDEZVOUS, "TORCHELASTIC_USE_AGENT_STORE")}
        env[RANK_LOG_ENV] = str(opts.log_dir / f"{point.label()}-w{world}")
        child = _child_argv(point, world, 0, opts)  # [python, -m, module, --child, ...]
        argv = launcher_argv(opts.launch, world, child[2], child[3:])
        stem = opts.log_dir / f"{point.label()}-w{world}-launcher"
        with open(stem.with_suffix(".out"), "w") as out, open(stem.with_suffix(".err"), "w") as err:
            procs.append((subprocess.Popen(argv, stdout=out, stderr=err, cwd=REPO_ROOT, env=env,
                                           start_new_session=True), list(range(world))))
    alive = dict(enumerate(procs))
    reaped: dict[int, tuple[int, Any, float]] = {}
    killed: dict[int, str] = {}
    first_failure: float | None = None
    peak_used = peak_rss = peak_shmem = samples = 0
    # When the node's peak came (seconds since the launch) and its used memory about every TIMELINE_S, with its shared
    # and private anonymous parts: where in the ranks' start-up (their build_s, engine_init_s) the peak falls, and
    # which kind of memory it is.
    peak_at_s, timeline, next_point = 0.0, [], 0.0
    _, shmem_base, anon_base = node_memory_bytes()
    while alive:
        for index, (proc, covered) in list(alive.items()):
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                for rank in covered:
                    reaped[rank] = (status, rusage, time.monotonic() - started)
                del alive[index]
                if os.waitstatus_to_exitcode(status) != 0 and first_failure is None:
                    first_failure = time.monotonic()
        rss = [proc_rss(pid) for proc, _ in alive.values()
               for pid in ([proc.pid] if opts.launch == "spawn" else rank_pids(proc.pid))]
        used, shmem, anon = node_memory_bytes()
        used, since = used - baseline, time.monotonic() - started
        if used > peak_used:
            peak_used, peak_at_s = used, since
        if since >= next_point:
            timeline.append([round(since, 1), round(used / GiB, 2), round((shmem - shmem_base) / GiB, 2),
                             round((anon - anon_base) / GiB, 2)])
            next_point = since + TIMELINE_S
        peak_rss, peak_shmem = max(peak_rss, sum(r for r, _ in rss)), max(peak_shmem, sum(s for _, s in rss))
        samples += 1
        now = time.monotonic()
        why = "timeout" if now >= started + timeout_s else (
            "killed_after_peer_failure" if first_failure is not None and now >= first_failure + opts.grace_s else None)
        if why:
            for proc, covered in alive.values():
                for rank in covered:
                    killed.setdefault(rank, why)
                kill_ranks(proc.pid)
        time.sleep(opts.sample_s)
    for proc, covered in procs:
        proc.returncode = os.waitstatus_to_exitcode(reaped[covered[0]][0])  # reaped by wait4, not by Popen
        kill_ranks(proc.pid)  # anything a rank left behind in its session
    del store
    wall_s = time.monotonic() - started

    ranks = []
    for rank in range(world):
        start, result = parse_child_output(paths[rank][0].read_text(errors="replace"))
        status, rusage, ended_s = reaped[rank]
        returncode = os.waitstatus_to_exitcode(status)
        error = classify(result, returncode, rank in killed)
        if result is None and killed.get(rank) == "killed_after_peer_failure":
            error = "killed_after_peer_failure"
        entry = {**start, **(result or {}), "rank": rank, "error": error, "returncode": returncode, "ended_s": ended_s}
        entry.pop("event", None)
        entry["peak_host_GB"] = max(entry.get("peak_host_GB") or 0.0, rusage.ru_maxrss * 1024 / GiB)
        if error is not None:
            entry["stderr_tail"] = tail(paths[rank][1])
        ranks.append(entry)

    first = ranks[0]
    provenance = current_provenance()
    record: dict[str, Any] = {
        "kind": "config", "role": role, "figure": FIGURE, "label": label, **point_fields(point),
        "world_size": world, "commit": provenance.commit, "dirty": provenance.dirty, "date": now_iso(),
        "launch": opts.launch, "timeout_s": timeout_s, "wall_s": wall_s, "cores_per_rank": first.get("cores"),
        **{k: first.get(k) for k in ("device", "gpu_total_GB", "host_total_GB", "cpu_cores", "hostname", "versions")},
        "dev_shm_GB": dev_shm_bytes() / GiB,
        "node": {"baseline_GB": baseline / GiB, "peak_used_GB": peak_used / GiB,
                 "steady_used_GB": first.get("node_steady_used_GB"), "ranks_rss_sum_peak_GB": peak_rss / GiB,
                 "ranks_shmem_sum_peak_GB": peak_shmem / GiB, "sample_s": opts.sample_s, "samples": samples,
                 "peak_at_s": peak_at_s, "timeline_GB": timeline},
        "ranks": [{k: v for k, v in r.items() if k not in ("stronghold", "floor", "versions", "device", "hostname")}
                  for r in ranks],
    }
    # A rank's own failure: its result line's error, or a death we did not cause (the OOM killer); not the
    # timeouts and kills this parent dealt out.
    # (Ranks under one launcher end together: one with its own result line's error comes first.)
    own = sorted((r for r in ranks if r["error"] not in (None, "timeout", "killed_after_peer_failure")),
                 key=lambda r: (r.get("error_detail") is None, r["ended_s"]))
    if own:
        culprit = own[0]
    elif killed:
        culprit = {**ranks[0], "error": "timeout"}
    else:
        culprit = None
    record["error"] = culprit and culprit["error"]
    if culprit is not None:
        stderr_tail = culprit.get("stderr_tail") or ""
        record.update(error_rank=culprit["rank"], stderr_tail=stderr_tail,
                      error_detail=culprit.get("error_detail") or (stderr_tail.splitlines() or [""])[-1])
        return record
    steps = list(zip(*(r["step_s_all"] for r in ranks)))  # per timed step, every rank's seconds
    record["step_s_all"] = [max(s) for s in steps]
    record["step_s"] = statistics.median(record["step_s_all"])
    samples_per_step = world * point.batch * point.accumulation
    record.update(samples_per_s=samples_per_step / record["step_s"],
                  tokens_per_s=samples_per_step * point.seq / record["step_s"],
                  loss_first=first.get("loss_first"), loss_last=first.get("loss_last"))
    for key in ("stronghold", "floor", "floor_s", "floor_error", "floor_skipped"):
        if key in first:
            record[key] = first[key]
    engine_cores = (record.get("stronghold") or {}).get("cores") or {}
    if engine_cores.get("cores"):  # the cores the engine gave the rank (engine/cores.py), not its start's affinity
        record["cores_per_rank"] = engine_cores["cores"]
    return record
