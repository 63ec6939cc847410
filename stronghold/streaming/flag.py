"""`Flag`: `threading.Event`'s interface (set, clear, is_set, wait), safe against a Ctrl-C on the calling thread.

Why not `threading.Event`: its methods run `with self._cond:`, and `Condition.__enter__` / `__exit__` are Python
functions around the lock's C methods. A KeyboardInterrupt is raised between bytecodes where the interpreter checks
for signals, which includes the start of a Python function and the return of a call: inside `__enter__` right after
the lock was taken, or inside `__exit__` before it is released. Either way the exception leaves the condition's lock
held, and the next `set()` of that event (the abort path of an interrupted backward gives every gradient buffer back
that way) blocks forever on it.

A `Flag` takes only a C lock, with `with`: the lock's own `__enter__` either fails without taking it (an interrupted
acquire) or returns into the protected block, and its `__exit__` is one C call. A waiter blocks on a lock of its own
that `set()` releases; an interrupt between the two (a wake-up lost, a waiter left registered) costs at most
`POLL_S`, since every wait also looks at the flag that often, and a stale registration goes at the next set().
"""
from __future__ import annotations

import _thread
import time
from typing import Optional

POLL_S = 0.05
"""Longest a waiter sleeps before it looks at the flag again (a wake-up lost to an interrupt costs no more)."""


class Flag:
    __slots__ = ("_lock", "_set", "_waiters")

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._set = False
        self._waiters: list = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            self._set = True
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if waiter.locked():
                    waiter.release()

    def clear(self) -> None:
        with self._lock:
            self._set = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once the flag is set; False if `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            waiter = _thread.allocate_lock()
            waiter.acquire()
            with self._lock:
                if self._set:
                    return True
                self._waiters.append(waiter)
            if waiter.acquire(timeout=left):
                return True
            with self._lock:  # timed out: not released by a set(), so still registered unless one came just now
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return True
