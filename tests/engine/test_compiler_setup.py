"""The compiler's process-wide set-up at construction (integrations/compiler_setup.py): what it leaves done, that the
engine's compiled blocks get it for Inductor only, and that a failure in it changes nothing but its report."""
import sys

import pytest
import torch

from stronghold.integrations import compile as compile_module
from stronghold.integrations import compiler_setup
from stronghold.integrations.compiler_setup import MODULES, prepare_compiler

from .helpers import tiny_gpt2

pytestmark = pytest.mark.newest  # torch's private compiler modules: run on the newest releases too


def test_it_imports_the_compiler_and_caches_its_key():
    report = prepare_compiler(torch.device("cpu"))
    assert report["set_up_s"] >= 0 and "set_up_error" not in report, report
    assert all(name in sys.modules for name in MODULES)
    codecache = sys.modules["torch._inductor.codecache"]
    assert codecache.torch_key() is codecache.torch_key()  # computed once for the process


def test_a_failing_part_is_reported_not_raised(monkeypatch):
    def fails(name):
        raise ImportError(f"no module named {name}")

    monkeypatch.setattr(compiler_setup.importlib, "import_module", fails)
    report = prepare_compiler(torch.device("cpu"))
    assert report["set_up_error"].startswith("ImportError: no module named torch._inductor"), report


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_blocks_set_up_the_compiler_for_inductor_only(monkeypatch, backend):
    calls = []
    monkeypatch.setattr(compile_module, "BACKEND", backend)
    monkeypatch.setattr(compile_module, "prepare_compiler", lambda device: calls.append(device) or {"set_up_s": 0.5})
    model = tiny_gpt2(2)
    blocks = compile_module.compile_blocks(list(model.transformer.h), True, torch.device("cpu"))
    try:
        report = blocks.report()
    finally:
        blocks.detach()
    if backend == "inductor":
        assert calls == [torch.device("cpu")] and report["set_up_s"] == 0.5
    else:
        assert calls == [] and "set_up_s" not in report


@pytest.mark.gpu
@pytest.mark.parametrize("indexed", [True, False])
def test_on_a_gpu_it_runs_on_the_engines_device(indexed):
    """An indexed device or an unindexed one (the caller's current device): no part fails."""
    device = torch.device("cuda", torch.cuda.device_count() - 1) if indexed else torch.device("cuda")
    report = prepare_compiler(device)
    assert "set_up_error" not in report, report
