"""Test environment: CPU DeepSpeed and interpreted Triton where there is no GPU.

The variables must be set before deepspeed or triton is imported, which is why they live here.
"""
import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from stronghold.engine.launch import single_process_env

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # cuBLAS is deterministic only with a fixed workspace per stream; torch checks the variable on each call under
    # deterministic algorithms (the `deterministic_kernels` fixture below).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# Single-process DeepSpeed without the launcher (and its CPU accelerator where there is no GPU).
single_process_env()


NEWEST_DIRS = ("ops", "hf")
"""Every test there exercises Triton or transformers: all of them carry the `newest` marker (pytest.ini)."""


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    for item in items:
        if Path(item.fspath).resolve().relative_to(tests).parts[0] in NEWEST_DIRS:
            item.add_marker(pytest.mark.newest)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeded(request):
    """Every test draws the same random inputs on every run and machine: a seed from its own id.

    Unseeded, a tolerance is checked against fresh inputs each run, and a rare draw fails CI at random.
    """
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def deterministic_kernels():
    """On a GPU every test runs torch's deterministic kernels (warn_only: an op without one runs as it is).

    Some CUDA kernels sum with atomics (torch.use_deterministic_algorithms lists them), in an order that can change
    from one run to the next: two trainings of one model then end a few ulps apart, and a test that compares
    two arrangements of the same arithmetic bit for bit (blockwise against host accumulation, the table's rows against
    the whole table) fails at random. On the CPU those kernels are deterministic already."""
    if not HAS_CUDA:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture(autouse=True)
def nvme_path_anywhere(monkeypatch):
    """The NVMe tier refuses a directory on tmpfs (streaming/nvme_path.py); the tests' temporary directories may be
    on one, and what they test is the tier's arithmetic and I/O, not the drive: no mount table for them (the refusal
    has its own test, with a table of its own)."""
    from stronghold.streaming import nvme_path

    monkeypatch.setattr(nvme_path, "MOUNTS", "/nonexistent/mounts")
