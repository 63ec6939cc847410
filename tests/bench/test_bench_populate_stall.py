"""examples/bench/probes/populate_stall.py on the CPU: one small round, its record's shape (no verdict from the
latencies: they are timings)."""
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from stronghold.optim.cpu_adam import NativeAdamW, load_kernel
from stronghold.streaming import prefault
from stronghold.streaming.pinned import pageable_empty

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_records_each_way_of_faulting_and_the_loop_alone(tmp_path):
    if not sys.platform.startswith("linux") or not isinstance(load_kernel(1), NativeAdamW):
        pytest.skip("needs Linux and the native CPU AdamW kernel")
    probe = pageable_empty(1 << 20, torch.uint8)
    if not prefault.populate(probe.data_ptr(), 1 << 20):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    out = tmp_path / "stall.jsonl"
    run = subprocess.run([sys.executable, "-m", "examples.bench.probes.populate_stall", "--buffers", "2",
                          "--buffer-mib", "4", "--rounds", "1", "--json", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["probe"] == "populate_stall" and record["chunk_bytes"] == prefault.CHUNK_BYTES
    (row,) = record["rounds"]
    assert set(row) == {"whole", "chunked", "fault_in", "alone_after_whole", "alone_after_chunked",
                        "alone_after_fault_in"}
    for name in ("whole", "chunked", "fault_in"):
        assert row[name]["populate_s"] > 0 and row[name]["map_calls"]["calls"] >= 1
        assert row[f"alone_after_{name}"]["map_calls"]["calls"] >= 1


def test_the_map_loop_makes_a_call_when_the_populate_is_already_over():
    """A populate that ends before the main thread's loop starts (small buffers, a busy host) left no call, and the
    summary's median failed on an empty list."""
    from examples.bench.probes.populate_stall import _map_loop
    over = threading.Event()
    over.set()
    assert len(_map_loop(over)) == 1
