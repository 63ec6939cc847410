"""Every rank's heartbeat, so that a rank or a whole node that dies or freezes takes the job down with an error
naming it within the stall timeout, instead of leaving the others in a collective that never ends.

Each rank's thread adds 1 to its counter in the launcher's rendezvous store (its own client of the store at
MASTER_ADDR:MASTER_PORT, which torchrun's agent or DeepSpeed's rank 0 serves) every `interval_s`, and reads
every other rank's. A counter that has not moved for `timeout_s` (the config's `stall_timeout_s`) belongs to a
rank that is gone or frozen (a host that died, a cut network, a stopped process): the thread logs an error naming
the rank and its node and ends this process with status 1, because the main thread may be inside a collective
(NCCL, or gloo towards a host that vanished without closing its sockets) that no Python code can interrupt; the
launcher then takes the job down. A store that stops answering for `timeout_s` names the node that serves it.
A rank that closes its engine, or leaves through Python's exit, says so first and is no longer waited for.

`stopped()` says promptly which ranks stopped beating (two reads `interval_s` apart), so that a collective that
fails at once (gloo reports a peer's closed socket) names them in its error.

The counters are keyed by a generation every rank agrees on (each engine built in the process is the next one, on
every rank in the same order), so engines built one after another in one process do not see each other's flags.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

logger = logging.getLogger(__name__)

_GENERATION = itertools.count()
"""Engines built in this process so far (every rank builds them in the same order)."""


class Liveness:
    def __init__(self, rank: int, nodes: Sequence[str], timeout_s: float, host: str, port: int,
                 interval_s: Optional[float] = None):
        """`nodes`: every rank's node (nodes.node_identity), indexed by rank. Call on every rank; `start` after
        every rank has made its own (a barrier in between), so every counter exists before anyone reads it."""
        self.rank, self.nodes, self.timeout_s = rank, list(nodes), timeout_s
        self.interval_s = interval_s or min(5.0, timeout_s / 10)
        self.where = f"{host}:{port}"
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(10.0, timeout_s)),
                                   wait_for_workers=False)
        # torchrun's agent keeps its store across restarts of the workers: a restart's keys are its own.
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"stronghold/liveness/{restart}/{next(_GENERATION)}/"
        self._lock = threading.Lock()
        """One request at a time on this client (the heartbeat thread and `stopped` share it)."""
        self._add(self._key(rank), 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stronghold-liveness", daemon=True)
        self._exit_hook = self.close
        atexit.register(self._exit_hook)

    def _key(self, rank: int, done: bool = False) -> str:
        return f"{self.prefix}{rank}{'/done' if done else ''}"

    def start(self) -> None:
        self._thread.start()

    def _add(self, key: str, amount: int) -> int:
        """The counter after adding `amount` (0 reads it; a missing key counts as 0, without waiting)."""
        with self._lock:
            return self.store.add(key, amount)

    def _read(self) -> list[int]:
        return [self._add(self._key(r), 0) for r in range(len(self.nodes))]

    def _done(self, rank: int) -> bool:
        return self._add(self._key(rank, done=True), 0) > 0

    def name(self, rank: int) -> str:
        return f"rank {rank} (node {self.nodes[rank]})"

    def _run(self) -> None:
        now = time.monotonic()
        seen = {r: (0, now) for r in range(len(self.nodes)) if r != self.rank}
        answered = now
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._add(self._key(self.rank), 1)
                values = self._read()
                late = [r for r, (value, since) in seen.items()
                        if values[r] == value and now - since > self.timeout_s and not self._done(r)]
            except Exception as err:  # noqa: BLE001 - the store itself is gone
                if now - answered > self.timeout_s and not self._stop.is_set():
                    self._fail(f"the launcher's rendezvous store at {self.where} stopped answering "
                               f"{now - answered:.0f} s ago ({type(err).__name__}: {err}); it is served by rank 0's "
                               f"node ({self.nodes[0]}), which is down or unreachable")
                continue
            answered = now
            for r, (value, since) in seen.items():
                if values[r] != value:
                    seen[r] = (values[r], now)
            if late and not self._stop.is_set():
                self._fail(f"{', '.join(self.name(r) for r in late)} stopped: no heartbeat for over "
                           f"{self.timeout_s:.0f} s (stall_timeout_s); the rank died, froze or lost the network, so the "
                           "collectives this rank is in can never finish")

    def _fail(self, message: str) -> None:
        logger.critical(f"{message}. Ending this rank (exit status 1) so that the launcher stops the job.")
        logging.shutdown()
        os._exit(1)

    def stopped(self) -> list[str]:
        """The ranks whose heartbeat does not move over one interval (and did not close), named with their node;
        empty where the store cannot tell."""
        try:
            first = self._read()
            time.sleep(1.5 * self.interval_s)
            second = self._read()
            return [self.name(r) for r, (a, b) in enumerate(zip(first, second))
                    if r != self.rank and a == b and not self._done(r)]
        except Exception:  # noqa: BLE001 - only a better message was at stake
            return []

    def close(self) -> None:
        """Stop beating and tell the others not to wait for this rank."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self._exit_hook)
        try:
            self._add(self._key(self.rank, done=True), 1)
        except Exception:  # noqa: BLE001 - the store may be gone at exit
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s)


def liveness_for(rank: int, nodes: Sequence[str], timeout_s: float) -> Optional[Liveness]:
    """The heartbeat where the launcher's store is known (MASTER_ADDR / MASTER_PORT), else None."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        logger.info("no MASTER_ADDR/MASTER_PORT: ranks are not watched for a peer that freezes")
        return None
    return Liveness(rank, nodes, timeout_s, host, int(port))
