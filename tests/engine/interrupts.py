"""A Ctrl-C at a chosen point, deterministically.

A SIGINT's KeyboardInterrupt surfaces on the main thread between two of its bytecodes, wherever it happens to be.
`InterruptAt` raises it (or any exception) on the calling thread at the n-th line that runs inside a call of chosen
functions (and whatever they call), through a trace function (`sys.settrace`, this thread only): stepping n over every line of a call puts the interrupt
at each of its points in turn, where a test with real signals would hit them by chance.

A `with` statement's line is skipped: its line event also comes as the block ends, before `__exit__` is called and
outside the block's protection, so an exception raised there would leave the lock held, which a signal cannot do (it
is raised after a call returns, inside the block).
"""
from __future__ import annotations

import linecache
import sys
import time
from typing import Callable, Iterable, Optional


class InterruptAt:
    """Raise `exc` at the `n`-th line event (counted from 1) that runs in a call of one of `functions` or in anything
    such a call calls, on this thread, once; a context manager. `fired_at` is then (qualified name, line number) of
    that point; None if fewer lines ran."""

    def __init__(self, functions: Iterable[Callable], n: int, exc: type[BaseException] = KeyboardInterrupt):
        self.codes = {f.__code__ for f in functions}
        self.n, self.exc = n, exc
        self.lines = 0
        self.fired_at: Optional[tuple[str, int]] = None
        self._depth = 0
        """Frames open inside a call of `functions` (0: outside every one)."""

    def __enter__(self) -> "InterruptAt":
        self._previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc_info) -> bool:
        sys.settrace(self._previous)
        return False

    def _call(self, frame, event, arg):
        if self.fired_at is None and (self._depth or frame.f_code in self.codes):
            self._depth += 1
            return self._line
        return None

    def _line(self, frame, event, arg):
        if event == "return":  # also when an exception leaves the frame
            self._depth -= 1
        elif event == "line" and self.fired_at is None and not _is_with(frame):
            self.lines += 1
            if self.lines == self.n:
                self.fired_at = (frame.f_code.co_qualname, frame.f_lineno)
                # Raised from the trace function, it surfaces in `frame` at this line (and tracing stops).
                raise self.exc(f"injected at {self.fired_at[0]} line {self.fired_at[1]}")
        return self._line


def _is_with(frame) -> bool:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip().startswith("with ")


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds; a hang guard (AssertionError naming `what`), never a verdict on speed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.001)
