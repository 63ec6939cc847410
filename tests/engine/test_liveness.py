"""A node that dies or freezes takes the job down with an error naming it (distributed/liveness.py), on the CPU
(gloo) with 2 simulated nodes of 1 rank each: after the first step rank 1 either exits (its sockets close: rank 0's
next collective fails at once and the error names rank 1 and its node) or stops (SIGSTOP, as a host that froze or
lost its network: rank 0's collectives would wait for ever, so its heartbeat watch ends it within the stall timeout,
naming rank 1)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from .helpers import BATCH, batches, ds_config, run_steps, tiny_gpt2

WORLD, GAS = 2, 2
STALL_S = 10.0
"""The config's stall_timeout_s here: the heartbeat watch fires after this long without a peer's beat."""
LIMIT_S = 240


def _worker(rank: int, out: str, port: int, how: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    out_dir = Path(out)
    log = os.open(out_dir / f"stderr{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)  # the watch's last words go to stderr
    import stronghold
    model = tiny_gpt2(4, seed=0)
    model.train()
    engine = stronghold.initialize(model=model, config=ds_config(window=2, resident=1, gas=GAS,
                                                                 stall_timeout_s=STALL_S))[0]
    data = batches(3 * GAS, batch=BATCH)
    run_steps(engine, data[:GAS])
    if rank == 1:
        (out_dir / "gone_at").write_text(repr(time.time()))
        if how == "exit":
            os._exit(0)
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        run_steps(engine, data[GAS:])
        outcome = None
    except Exception as err:  # noqa: BLE001 - what the survivor saw is the result
        outcome = f"{type(err).__name__}: {err}"
    torch.save({"error": outcome, "at": time.time()}, out_dir / "survivor.pt")
    os._exit(0)  # the peer is gone: skip the process group's teardown


def _run(out: Path, how: str):
    """Start both ranks; wait for rank 0 to end (or fail the test at LIMIT_S); kill rank 1; rank 0's exit code and
    when it ended."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = torch.multiprocessing.start_processes(_worker, args=(str(out), store.port, how), nprocs=WORLD,
                                                     join=False, start_method="spawn")
    survivor, frozen = context.processes
    deadline = time.monotonic() + LIMIT_S
    try:
        while survivor.exitcode is None:
            if time.monotonic() > deadline:
                pytest.fail(f"rank 0 still running {LIMIT_S} s after the start: a collective hung")
            time.sleep(0.5)
        ended = time.time()
    finally:
        for process in context.processes:
            if process.exitcode is None:
                process.kill()
            process.join()
    return survivor.exitcode, ended


def test_a_node_that_exits_fails_the_others_naming_it(tmp_path):
    code, _ = _run(tmp_path, "exit")
    assert code == 0
    error = torch.load(tmp_path / "survivor.pt", weights_only=True)["error"]
    assert error is not None and "rank 1 (node " in error and "exited or stopped" in error, error


def test_a_node_that_freezes_ends_the_others_within_the_stall_timeout(tmp_path):
    code, ended = _run(tmp_path, "freeze")
    assert code == 1, "the watch ended rank 0 with status 1"
    assert not (tmp_path / "survivor.pt").exists(), "rank 0 was inside a collective that could not finish"
    message = (tmp_path / "stderr0.txt").read_text()
    assert "rank 1 (node " in message and "no heartbeat for over 10 s" in message, message[-2000:]
    gone = float((tmp_path / "gone_at").read_text())
    # The watch reads every interval (a tenth of the timeout): it fires between the timeout and about one interval
    # later; the bound leaves room for a loaded 2-core machine.
    assert ended - gone < STALL_S + 30
