"""Results on disk: JSON lines under results/bench/, one file per figure, and their provenance.

A record is one run of one point (see SCHEMA.md). Sweeps look a point up before running it: a
record with the same point key and commit answers it, so a sweep cut short by its time budget
picks up where it stopped. Files are only ever appended to; a line cut off by a kill is skipped.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.provenance import commit_from_env

from .flops import param_count
from .point import Point

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS_DIR = REPO_ROOT / "results" / "bench"
# The code a measurement depends on, hashed when git cannot name the commit (e.g. a copied tree).
CODE_DIRS = ("stronghold", "stronghold_ops", "examples/bench")
CAPACITY_ERRORS = ("oom_gpu", "oom_host", "timeout")


@dataclass(frozen=True, kw_only=True)
class Provenance:
    commit: str
    """`git rev-parse HEAD`, $BENCH_COMMIT / $STRONGHOLD_COMMIT, or `tree-<hash of CODE_DIRS>` without git."""
    dirty: bool | None
    """Tracked files differ from the commit (results/ aside); None when unknown."""


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_hash(root: Path = REPO_ROOT) -> str:
    digest = hashlib.sha256()
    for directory in CODE_DIRS:
        for path in sorted((root / directory).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def current_provenance() -> Provenance:
    """Which code is measured. $BENCH_COMMIT (or $STRONGHOLD_COMMIT: examples/provenance.py) and $BENCH_DIRTY
    name it where the tree has no .git (the GPU machine gets a copy of the working tree)."""
    named = commit_from_env()
    if named:
        dirty = os.environ.get("BENCH_DIRTY")
        return Provenance(commit=named, dirty=None if dirty is None else dirty == "1")
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return Provenance(commit=f"tree-{code_hash()}", dirty=None)
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    return Provenance(commit=commit, dirty=None if status is None else bool(status))


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of one JSONL file, in order (none if it is missing); unparsable lines are skipped
    with a note."""
    records = []
    if not Path(path).exists():
        return records
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            print(f"note: {path}:{number} is not JSON (cut off by a kill?); skipped", file=sys.stderr)
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every point record in directory/*.jsonl, in file order."""
    return [r for path in sorted(Path(directory).glob("*.jsonl")) for r in read_jsonl(path) if "key" in r]


def satisfies(record: dict[str, Any], point: Point, timeout_s: float) -> bool:
    """Does `record` (same key) answer a request for `point` run under `timeout_s`?

    A success needs as many timed steps; a timeout counts only if it had at least as long; an
    OOM answers any request (more steps or time would not make memory fit); other errors too,
    since at the same commit they would recur (rerun them with --retry-errors)."""
    error = record.get("error")
    if error is None:
        return record.get("timed_steps", 0) >= point.timed_steps
    if error == "timeout":
        return record.get("timeout_s", 0) >= timeout_s
    return True


class ResultStore:
    """Records of one results directory, with lookups by point and commit."""

    def __init__(self, directory: Path, provenance: Provenance, *, any_commit: bool = False,
                 retry_errors: bool = False) -> None:
        self.directory = Path(directory)
        self.provenance = provenance
        self.any_commit = any_commit
        self.retry_errors = retry_errors
        self.records = read_records(self.directory)

    def lookup(self, point: Point, timeout_s: float) -> dict[str, Any] | None:
        """The newest record that answers `point` at this commit (any commit with any_commit)."""
        key = point.key()
        for record in reversed(self.records):
            if record["key"] != key:
                continue
            if not self.any_commit and record.get("commit") != self.provenance.commit:
                continue
            if self.retry_errors and record.get("error") == "error":
                continue
            if satisfies(record, point, timeout_s):
                return record
        return None

    def append(self, figure: str, record: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, sort_keys=True)
        with open(self.directory / f"{figure}.jsonl", "a") as f:
            f.write(line + "\n")
        self.records.append(record)


def point_fields(point: Point) -> dict[str, Any]:
    """The point as record fields (`stronghold_knobs`: the "stronghold" field holds the engine's report)."""
    return {
        "key": point.key(), "system": point.system, "hidden": point.hidden, "layers": point.layers,
        "heads": point.heads, "seq": point.seq, "batch": point.batch, "vocab": point.vocab,
        "arch": point.arch, "intermediate": point.intermediate_size, "kv_heads": point.num_kv_heads,
        "accumulation": point.accumulation,
        "gpu_cap_GB": point.gpu_cap_GB, "checkpointing": point.checkpointing,
        "stronghold_knobs": dict(point.stronghold), "cpu_checkpointing": point.cpu_checkpointing,
        "repeat": point.repeat, "clipping": point.clipping, "warmup_steps": point.warmup_steps,
        "timed_steps": point.timed_steps, "dtype": "bf16", "params_B": param_count(point) / 1e9,
    }
