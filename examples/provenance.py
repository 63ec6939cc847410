"""Which commit of this repository a script's numbers come from (the example scripts' records).

Import it as `examples.provenance`: every script puts the repository root on sys.path, whether it
runs as `python3 examples/x.py` or as a module. The benchmark package records more (dirty state, a
hash of the code without git): examples/bench/store.py.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


COMMIT_VARIABLES = ("STRONGHOLD_COMMIT", "BENCH_COMMIT")
"""Where a copy of the tree (the GPU machine's, whose .git, if any, is not the measured code) names its commit.
Either name works for every script and the benchmark; set both only to the same value."""


def commit_from_env() -> str | None:
    """The commit named by $STRONGHOLD_COMMIT or $BENCH_COMMIT; a ValueError when they name different ones."""
    named = {os.environ[name] for name in COMMIT_VARIABLES if os.environ.get(name)}
    if len(named) > 1:
        raise ValueError(f"STRONGHOLD_COMMIT and BENCH_COMMIT name different commits ({sorted(named)}); set one")
    return named.pop() if named else None


def git_commit(short: bool = False) -> str | None:
    """The commit from the environment (`commit_from_env`) if set, else `git rev-parse [--short] HEAD` of this
    repository; None when neither names one."""
    named = commit_from_env()
    if named:
        return named
    argv = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        found = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    except OSError:  # no git on this machine
        return None
    if found.returncode != 0:
        return None
    return found.stdout.strip() or None


def emit_record(record: dict, path: str | None) -> dict:
    """A probe's result line: `record` with the commit measured, printed, and appended to `path` (JSON lines) if
    given. Returns the record as written."""
    import json

    out = {"commit": git_commit(short=True), **record}
    print(json.dumps(out), flush=True)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(out) + "\n")
    return out
