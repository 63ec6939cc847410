"""Test environment: CPU DeepSpeed and interpreted Triton where there is no GPU.

The variables must be set before deepspeed or triton is imported, which is why they live here.
"""
import os

import pytest
import torch

from stronghold.launch import single_process_env

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Single-process DeepSpeed without the launcher (and its CPU accelerator where there is no GPU).
single_process_env()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
