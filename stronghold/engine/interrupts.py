"""`deferred_interrupt`: a Ctrl-C that arrives during a step's update is held until the update is complete.

Why: step() first waits (the CPU's gradient sums, the global norm: `StrongholdRuntime.prepare_step`), then updates
everything in one go: the CPU AdamW's jobs for the streamed blocks, the resident blocks on the GPU, the step counts,
DeepSpeed's own bookkeeping (its step count, the learning-rate scheduler). A KeyboardInterrupt between two of those
leaves some parts at the new step and others at the old one, and a script that catches it and trains on (or saves)
would go on from a model that no single step produced. So the update runs with SIGINT's handler replaced by one that
notes the signal, and the previous handler is called with it right after: Python's default raises KeyboardInterrupt
there, a script's own handler runs as it would have. The waits before it stay interruptible: a step that hangs can
still be stopped. Only the main thread can set a signal handler (and only it receives SIGINT's KeyboardInterrupt);
elsewhere this changes nothing.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous is None or previous is signal.SIG_IGN:  # not the main thread, a handler set outside Python, ignored
        yield
        return
    held: list[tuple] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(*held[0])
            else:  # SIG_DFL: the default action, now that the handler is back
                os.kill(os.getpid(), signal.SIGINT)
