"""Shared fixtures for the stronghold_ops tests: poisoned outputs, devices, error measures."""
import os

import pytest
import torch

from stronghold_ops import _runtime

# CPU runs the kernels through Triton's interpreter, which tests/conftest.py switches on where there is
# no CUDA. On a GPU machine the interpreter is off, so the CPU cases skip and the CUDA ones run.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every output the kernels allocate starts as NaN, so an element they fail to write shows up."""
    monkeypatch.setattr(_runtime, "POISON_OUTPUTS", True)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if actual.shape != expected.shape or not torch.isfinite(actual).all():
        return float("inf")
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


@pytest.fixture
def rel_err():
    """||actual - expected|| / ||expected|| in float64; inf for a NaN/inf in `actual` or a shape mismatch."""
    return _rel_err
