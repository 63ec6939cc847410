"""Ctrl-C (SIGINT) at pseudo-random points of training: each time the training loop gets its KeyboardInterrupt, the
engine shuts down without waiting out the CPU worker's join timeout, and the process ends as an unhandled Ctrl-C ends
it.

A process cannot take a hundred SIGINTs and exit each time, and a hundred DeepSpeed start-ups are too slow for CI. So
one child process trains in rounds: each round builds an engine and trains until the parent's SIGINT arrives, catches
the KeyboardInterrupt and destroys the engine (what the exit handler does: drain and join the worker, with a warning
if it does not stop within its join timeout); the last round lets the KeyboardInterrupt end the process, so the exit
handler itself joins the worker. The parent waits a seeded random time after each round starts, so the signals land
all over forward, backward, the hand-off to the CPU and step(). The defect this guards against (an interrupted
`notify` that left a stale waiter, so close() waited 60 s) needed the signal to land on a few bytecodes; random
signals find it only now and then, and tests/engine/test_cpu_worker.py puts an interrupt on every line of the submit
path instead. The verdicts: every round ends, no join-timeout warning, the exit status of a Ctrl-C. The waits on the
child (60 s, 600 s for its start-up on a loaded machine) are hang guards, not a measure of speed.
"""
import pathlib
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

CHILD = textwrap.dedent("""
    import copy, os, sys
    sys.path.insert(0, {root!r})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # a free port of its own, not the test process's
    from stronghold.engine.launch import single_process_env
    single_process_env()
    from tests.engine.helpers import batches, ds_config, tiny_llama
    import stronghold

    rounds = int(sys.argv[1])
    model, data = tiny_llama(4), batches(4)
    config = ds_config(window=2, resident=1, gas=2, clip=1.0)
    for r in range(rounds):
        engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=config)
        try:
            print("READY", r, flush=True)
            while True:
                for batch in data:
                    engine.backward(engine(**batch).loss)
                    engine.step()
        except KeyboardInterrupt:
            if r == rounds - 1:
                raise
            engine.destroy()
            print("INTERRUPTED", r, flush=True)
""")


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line.strip())
    into.put(None)


def _expect(lines: queue.Queue, wanted: str, timeout_s: float, stderr: list) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {wanted!r} within {timeout_s:g} s; stderr: {''.join(stderr)[-3000:]}") from None
        assert line is not None, f"the child ended before {wanted!r}; stderr: {''.join(stderr)[-3000:]}"
        if line == wanted:
            return


def _interrupt_rounds(tmp_path, rounds: int, seed: int) -> None:
    root = str(pathlib.Path(__file__).resolve().parents[2])
    script = tmp_path / "train_until_ctrl_c.py"
    script.write_text(CHILD.format(root=root))
    rng = random.Random(seed)
    child = subprocess.Popen([sys.executable, str(script), str(rounds)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lines, stderr = queue.Queue(), []
    threading.Thread(target=_lines, args=(child.stdout, lines), daemon=True).start()
    errors = threading.Thread(target=lambda: stderr.extend(child.stderr), daemon=True)
    errors.start()
    try:
        for r in range(rounds):
            _expect(lines, f"READY {r}", 600 if r == 0 else 60, stderr)
            time.sleep(rng.uniform(0.0, 1.5))  # where in training the signal lands; no verdict depends on it
            child.send_signal(signal.SIGINT)
            if r < rounds - 1:
                _expect(lines, f"INTERRUPTED {r}", 60, stderr)
        returncode = child.wait(timeout=60)
    finally:
        child.kill()
    errors.join(timeout=60)
    text = "".join(stderr)
    assert "did not finish its queued updates" not in text, text[-3000:]
    assert returncode == -signal.SIGINT and "KeyboardInterrupt" in text, (returncode, text[-3000:])


def test_ctrl_c_during_training_ends_promptly(tmp_path):
    _interrupt_rounds(tmp_path, rounds=6, seed=33)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_a_hundred_ctrl_c_during_training(tmp_path, seed):
    """100 SIGINTs over 4 processes of 25 rounds."""
    _interrupt_rounds(tmp_path, rounds=25, seed=100 + seed)
