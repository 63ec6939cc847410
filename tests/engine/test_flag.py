"""streaming/flag.py's `Flag`: threading.Event's behaviour, and a KeyboardInterrupt at any line of its methods leaves
its lock free and the flag usable (a threading.Event can keep its condition's lock, and the next set() then blocks
for good).

The interrupts come from tests/engine/interrupts.py's `InterruptAt` at every line of each method in turn, a superset
of the points a real signal can reach. Threads here wait on the flag; the verdicts are what they saw, never a time.
"""
import contextlib
import itertools
import threading

import pytest

from stronghold.streaming.flag import Flag

from .interrupts import InterruptAt


def test_behaves_as_an_event():
    flag = Flag()
    assert not flag.is_set() and flag.wait(0) is False and flag.wait(0.01) is False
    flag.set()
    assert flag.is_set() and flag.wait() is True and flag.wait(0) is True
    flag.clear()
    assert not flag.is_set()


def test_set_wakes_every_waiter():
    flag, woke = Flag(), []
    threads = [threading.Thread(target=lambda: woke.append(flag.wait())) for _ in range(4)]
    for thread in threads:
        thread.start()
    flag.set()
    for thread in threads:
        thread.join(timeout=60)  # a hang guard
    assert woke == [True] * 4


CALLS = {"set": lambda flag: flag.set(), "clear": lambda flag: flag.clear(), "wait": lambda flag: flag.wait(0.02),
         "wait_set": lambda flag: flag.wait()}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_interrupt_at_any_line_leaves_the_flag_usable(name):
    """Every line until a call ends before its interrupt (a timed wait's lines depend on the clock, so the count is
    not fixed in advance)."""
    def fresh():
        flag = Flag()
        if name == "wait_set":
            flag.set()
        return flag

    for n in itertools.count(1):
        flag = fresh()
        with InterruptAt([Flag.set, Flag.clear, Flag.wait], n=n) as trap:
            with contextlib.suppress(KeyboardInterrupt):
                CALLS[name](flag)
        assert not flag._lock.locked(), f"{name}: an interrupt at line {n} left the lock held"
        flag.clear()
        woke = []
        waiter = threading.Thread(target=lambda: woke.append(flag.wait()))
        waiter.start()
        flag.set()
        waiter.join(timeout=60)  # a hang guard
        assert woke == [True] and flag.is_set()
        if trap.fired_at is None:
            break
    assert n > 1, f"{name} has lines to interrupt"