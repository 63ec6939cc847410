"""The compiler warm-up thread (integrations/compiler_warmup.py): what it leaves done, who waits for it, and that a
failure in it changes nothing but its report. No verdict from a timing: each check is an order of events."""
import sys
import threading

import pytest
import torch

from stronghold.integrations import compile as compile_module
from stronghold.integrations import compiler_warmup
from stronghold.integrations.compiler_warmup import MODULES, CompilerWarmUp

from .helpers import tiny_gpt2

pytestmark = pytest.mark.newest  # torch's private compiler modules: run on the newest releases too


def test_the_warm_up_imports_the_compiler_and_caches_its_keys():
    warm_up = CompilerWarmUp(torch.device("cpu"))
    warm_up.wait()
    report = warm_up.report()
    assert report["warm_up_s"] is not None and "warm_up_error" not in report, report
    assert all(name in sys.modules for name in MODULES)
    codecache = sys.modules["torch._inductor.codecache"]
    assert codecache.CacheBase.get_system() is codecache.CacheBase.get_system()  # computed once for the process


def _held(monkeypatch, events: list) -> threading.Event:
    """Warm-ups whose work waits for the returned event, which their `wait` sets: `events` gets "wait" when a caller
    waits and "done" once the work ran, in that order only if the caller really waited for it."""
    release = threading.Event()

    def run(self):
        release.wait()
        events.append("done")
        with compiler_warmup._lock:
            compiler_warmup._running.discard(self)

    original = CompilerWarmUp.wait

    def wait(self, timeout_s=compiler_warmup.FIRST_CALL_WAIT_S):
        events.append(("wait", timeout_s))
        release.set()
        original(self, timeout_s)

    monkeypatch.setattr(CompilerWarmUp, "_run", run)
    monkeypatch.setattr(CompilerWarmUp, "wait", wait)
    return release


def test_a_fork_waits_for_it(monkeypatch):
    events = []
    _held(monkeypatch, events)
    warm_up = CompilerWarmUp(torch.device("cpu"))
    assert warm_up in compiler_warmup._running
    compiler_warmup._wait_all_before_fork()  # what os.register_at_fork runs before a fork
    assert events == [("wait", compiler_warmup.FORK_WAIT_S), "done"]
    assert warm_up not in compiler_warmup._running


def test_the_first_compiled_call_waits_for_it_before_compiling(monkeypatch):
    events = []
    _held(monkeypatch, events)
    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    model = tiny_gpt2(2)
    model.config.use_cache = False  # calls with a KV cache run eager
    blocks = compile_module.CompiledBlocks(list(model.transformer.h), device=torch.device("cpu"))
    assert blocks.warm_up is not None

    def backend(graph, inputs):  # Dynamo's capture without Inductor's code generation, each compile recorded
        events.append("compile")
        return graph.forward

    blocks.backend = backend
    torch._dynamo.reset()
    blocks.attach()
    try:
        model(torch.zeros(1, 4, dtype=torch.long))
    finally:
        blocks.detach()
        torch._dynamo.reset()
    assert events[:3] == [("wait", compiler_warmup.FIRST_CALL_WAIT_S), "done", "compile"]
    assert events.count(("wait", compiler_warmup.FIRST_CALL_WAIT_S)) == 1  # the first call only


def test_a_failing_warm_up_is_reported_and_waited_for_no_longer(monkeypatch):
    def fails(name):
        raise ImportError(f"no module named {name}")

    monkeypatch.setattr(compiler_warmup.importlib, "import_module", fails)
    warm_up = CompilerWarmUp(torch.device("cpu"))
    warm_up.wait()
    assert warm_up.report()["warm_up_error"].startswith("ImportError: no module named torch._inductor")
    assert warm_up not in compiler_warmup._running


def test_no_warm_up_for_another_backend(monkeypatch):
    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    blocks = compile_module.CompiledBlocks(list(tiny_gpt2(2).transformer.h), device=torch.device("cpu"))
    assert blocks.warm_up is None and "warm_up_s" not in blocks.report()


@pytest.mark.gpu
def test_on_a_gpu_it_keys_the_cache_with_this_process_s_device():
    """On a GPU the key holds the device's name: the thread reads it from the engine's device, not its own GPU 0."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    warm_up = CompilerWarmUp(device)
    warm_up.wait()
    assert warm_up.device == device and "warm_up_error" not in warm_up.report(), warm_up.report()
    system = sys.modules["torch._inductor.codecache"].CacheBase.get_system()
    assert system["device"]["name"] == torch.cuda.get_device_properties(device).name
