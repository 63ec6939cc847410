"""Parent side of one point: run run_one in its own subprocess and classify how it ended.

The child runs in a new session (process group) so that a timeout kills it with everything it
started (DeepSpeed's JIT compilers). We reap it with os.wait4, whose rusage is the child's own,
including its peak RSS after it was SIGKILLed, which nothing inside the child could report.
Outcomes: the child's own result line (success, oom_gpu, oom_host from a caught MemoryError,
error); no result line and SIGKILL -> oom_host (the kernel's OOM killer); our deadline ->
timeout; anything else -> error with the tail of stderr.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .point import Point
from .run_one import DEFAULT_PEAK_SOURCE, DEFAULT_PEAK_TFLOPS, GiB
from .store import REPO_ROOT, Provenance, now_iso, point_fields

STDERR_TAIL_LINES = 40
POLL_S = 0.2


@dataclass(kw_only=True)
class RunnerConfig:
    """How the parent starts children."""

    log_dir: Path | None = None
    """Where each child's stdout/stderr go (<label>.out/.err); None = a temporary directory."""
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
    """The denominator of mfu/hfu, in TFLOP/s."""
    peak_tflops_source: str = DEFAULT_PEAK_SOURCE
    python: str = sys.executable
    floor: bool = True
    """Run telemetry.floor_terms after a stronghold point's timed steps (False: `--no-floor`)."""
    profile: bool = False
    """Profile one more step after the timed ones into the record's `profile` (`--profile`, profile_step.py)."""
    simulate: str | None = None
    """Test-only: make the child fail in one of run_one.SIMULATIONS."""


RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env() -> dict[str, str]:
    """This process's environment for a point's child, without a rendezvous: the child is a process group of its own
    (one process that picks a free port, or ranks given theirs). An engine built earlier in this process set
    MASTER_PORT and still listens on it, and a child that inherited it failed with EADDRINUSE."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def parse_child_output(stdout: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(start line, result line or None) from the child's stdout, among DeepSpeed's log lines."""
    start: dict[str, Any] = {}
    result = None
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("event") == "start":
            start = record
        elif record.get("event") == "result":
            result = record
    return start, result


def classify(result: dict[str, Any] | None, returncode: int, timed_out: bool) -> str | None:
    """The recorded outcome: None (success), oom_gpu, oom_host, timeout or error."""
    if result is not None:
        # A result line is the child's own verdict, even if it was killed while exiting.
        return result.get("error")
    if timed_out:
        return "timeout"
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "oom_host"
    return "error"


def _wait(pid: int, deadline: float, on_poll: Callable[[], None] | None = None) -> tuple[int, Any, bool]:
    """Reap `pid` (waitstatus, rusage, timed_out), killing its process group at `deadline`; `on_poll` runs every
    POLL_S while it lives."""
    while True:
        reaped, status, rusage = os.wait4(pid, os.WNOHANG)
        if reaped:
            return status, rusage, False
        if time.monotonic() >= deadline:
            _kill_group(pid)
            _, status, rusage = os.wait4(pid, 0)
            return status, rusage, True
        if on_poll is not None:
            on_poll()
        time.sleep(POLL_S)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass(kw_only=True)
class ChildExit:
    """How a child run by `run_child` ended."""

    returncode: int
    """Its exit code, or -signal for a killed child (a SIGKILL without a result line: the kernel's OOM killer)."""
    timed_out: bool
    """Killed by us at the deadline."""
    peak_rss_GB: float
    """wait4's ru_maxrss: the child's peak RSS (or its largest reaped descendant's), killed or not, GiB."""
    wall_s: float


def run_child(argv: list[str], *, timeout_s: float, out_path: Path, err_path: Path,
              on_poll: Callable[[], None] | None = None) -> ChildExit:
    """Run `argv` from the repository root in its own session (so that a kill takes everything it started:
    DeepSpeed's JIT compilers, ZenFlow's optimizer process), stdout and stderr to the two files; reap it with
    wait4, kill its process group at the deadline and again once it has exited."""
    started = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=REPO_ROOT, env=child_env(), start_new_session=True)
        status, rusage, timed_out = _wait(proc.pid, started + timeout_s, on_poll)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, not by Popen
    _kill_group(proc.pid)  # anything the child left behind in its session
    return ChildExit(returncode=proc.returncode, timed_out=timed_out, peak_rss_GB=rusage.ru_maxrss * 1024 / GiB,
                     wall_s=time.monotonic() - started)


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    """The last `lines` lines of a log file (empty if it is missing)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def extension_build_locks() -> list[str]:
    """Lock files of torch's JIT extension builds (DeepSpeed's ops). A build killed midway leaves its lock, and
    every later build or load of that op waits on it forever: a child that times out may be one of them."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return sorted(str(p) for pattern in ("*/lock", "*/*/lock") for p in root.glob(pattern))


def failure_fields(error: str, err_path: Path, detail: str | None) -> dict[str, Any]:
    """What a failed child's record carries: its stderr's tail, a one-line detail (the child's own `detail`, else
    the tail's last line), and after a timeout the extension build locks that may have held it."""
    fields: dict[str, Any] = {"stderr_tail": tail(err_path)}
    fields["error_detail"] = detail or (fields["stderr_tail"].splitlines()[-1] if fields["stderr_tail"] else "")
    if error == "timeout":
        locks = extension_build_locks()
        if locks:
            fields["build_locks"] = locks
            fields["error_detail"] = (f"torch extension build lock(s) present: {', '.join(locks)}; if no build is "
                                      "running, a killed build left them and every DeepSpeed op load waits on them: "
                                      f"delete them and run again. {fields['error_detail']}")
    return fields


def run_point(point: Point, timeout_s: float, config: RunnerConfig, provenance: Provenance) -> dict[str, Any]:
    """Run `point` in a child with a wall-clock limit; the full record to store."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    argv = [config.python, "-m", "examples.bench.run_one", *point.to_argv(),
            "--peak-tflops", repr(config.peak_tflops), "--peak-tflops-source", config.peak_tflops_source]
    if not config.floor:
        argv.append("--no-floor")
    if config.profile:
        argv.append("--profile")
    if config.simulate:
        argv += ["--simulate", config.simulate]
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(config.log_dir) if config.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        out_path, err_path = log_dir / f"{point.label()}.out", log_dir / f"{point.label()}.err"
        ended = run_child(argv, timeout_s=timeout_s, out_path=out_path, err_path=err_path)
        start, result = parse_child_output(out_path.read_text(errors="replace"))
        error = classify(result, ended.returncode, ended.timed_out)
        record: dict[str, Any] = {**start, **(result or {})}
        record.pop("event", None)
        record.update(point_fields(point))
        record.update(
            error=error, returncode=ended.returncode, timeout_s=timeout_s, wall_s=ended.wall_s,
            commit=provenance.commit, dirty=provenance.dirty, date=now_iso(),
        )
        # wait4's ru_maxrss (KiB) covers the child and its reaped descendants, killed or not.
        record["peak_host_GB"] = max(record.get("peak_host_GB") or 0.0, ended.peak_rss_GB)
        if error is not None:
            # Logs stay on the machine that ran the point; the tail travels with the record.
            record.update(failure_fields(error, err_path, record.get("error_detail")))
        record["log"] = str(out_path) if config.log_dir else None
    return record
