"""streaming/flag.py's `Flag`: threading.Event's behaviour, and a KeyboardInterrupt at any line of its methods leaves
its lock free and the flag usable (a threading.Event can keep its condition's lock, and the next set() then blocks
for good).

The interrupts come from tests/engine/interrupts.py's `InterruptAt` at every line of each method in turn, a superset
of the points a real signal can reach. Threads here wait on the flag; the verdicts are what they saw, never a time.
"""
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


def _lines(call, flag: Flag) -> int:
    with InterruptAt([Flag.set, Flag.clear, Flag.wait], n=10 ** 9) as probe:
        call(flag)
    return probe.lines


CALLS = {"set": lambda flag: flag.set(), "clear": lambda flag: flag.clear(), "wait": lambda flag: flag.wait(0.02),
         "wait_set": lambda flag: flag.wait()}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_interrupt_at_any_line_leaves_the_flag_usable(name):
    def fresh():
        flag = Flag()
        if name == "wait_set":
            flag.set()
        return flag

    lines = _lines(CALLS[name], fresh())
    assert lines >= 1
    for n in range(1, lines + 1):
        flag = fresh()
        with pytest.raises(KeyboardInterrupt), InterruptAt([Flag.set, Flag.clear, Flag.wait], n=n):
            CALLS[name](flag)
        assert not flag._lock.locked(), f"{name}: an interrupt at line {n} left the lock held"
        flag.clear()
        woke = []
        waiter = threading.Thread(target=lambda: woke.append(flag.wait()))
        waiter.start()
        flag.set()
        waiter.join(timeout=60)  # a hang guard
        assert woke == [True] and flag.is_set()
