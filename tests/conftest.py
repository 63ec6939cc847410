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
def nvme_path_anywhere(monkeypatch):
    """The NVMe tier refuses a directory on tmpfs (streaming/nvme_path.py); the tests' temporary directories may be
    on one, and what they test is the tier's arithmetic and I/O, not the drive: no mount table for them (the refusal
    has its own test, with a table of its own)."""
    from stronghold.streaming import nvme_path

    monkeypatch.setattr(nvme_path, "MOUNTS", "/nonexistent/mounts")
