"""How examples/bench/data_parallel.py starts a configuration's ranks: its own spawn, or a user's launcher.

- `spawn`: the parent starts one process per rank with what a launcher sets (its default);
- `torchrun`: `torchrun --standalone --nproc_per_node N` (python -m torch.distributed.run) of the rank module;
- `deepspeed`: `deepspeed --num_gpus N --master_port P --module` of the rank module.

No binding flag is passed: with a launcher the ranks get what a plain launch gives a user's script (the engine
shares the node's cores among them itself, stronghold/engine/cores.py). A launcher's ranks write their lines to
the files the parent reads (`RANK_LOG_ENV`: the parent's stem, the rank appended), and the parent finds them
among the launcher's descendants (their command line has `--child`) to sample their memory and to kill them.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

LAUNCHES = ("spawn", "torchrun", "deepspeed")
RANK_LOG_ENV = "BENCH_DP_RANK_LOG"
"""Set by the parent for a launcher's ranks: `{stem}-r{RANK}.out` / `.err` receive the rank's stdout / stderr."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_argv(launch: str, world: int, module: str, args: list[str]) -> list[str]:
    """The command that starts `world` ranks of `python -m module args` under `launch` (torchrun or deepspeed)."""
    if launch == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                "-m", module, *args]
    if launch == "deepspeed":
        # --master_port: DeepSpeed's default 29500 may be taken; not a binding flag.
        return [sys.executable, "-m", "deepspeed.launcher.runner", f"--num_gpus={world}",
                f"--master_port={free_port()}", "--module", module, *args]
    raise ValueError(f"launch {launch!r}: expected one of {LAUNCHES}")


def redirect_rank_output() -> None:
    """In a launcher's rank: send stdout and stderr to the files the parent reads (no-op without RANK_LOG_ENV)."""
    stem = os.environ.get(RANK_LOG_ENV)
    if not stem:
        return
    rank = os.environ.get("RANK", "0")
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(f"{stem}-r{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def rank_pids(launcher: int) -> list[int]:
    """The launcher's descendants that are ranks (their command line has `--child`)."""
    ranks, todo = [], _children(launcher)
    while todo:
        pid = todo.pop()
        todo += _children(pid)
        try:
            if b"--child" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                ranks.append(pid)
        except OSError:
            pass
    return sorted(ranks)


def kill_ranks(launcher: int) -> None:
    """SIGKILL the launcher's ranks (a launcher may start them in their own sessions) and its process group."""
    for pid in rank_pids(launcher):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(launcher, signal.SIGKILL)
    except ProcessLookupError:
        pass
