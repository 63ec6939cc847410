"""The compiler's process-wide set-up on a thread (integrations/compiler_setup.py): what it leaves done, who waits for
it, that the engine's compiled blocks start it for Inductor only, and that a failure in it changes nothing but its
report. No verdict from a timing: each check is an order of events."""
import sys
import threading

import pytest
import torch

from stronghold.integrations import compile as compile_module
from stronghold.integrations import compile_rehearsal, compiler_setup
from stronghold.integrations.compiler_setup import MODULES, CompilerSetUp

from .helpers import engine_for, tiny_gpt2

pytestmark = pytest.mark.newest  # torch's private compiler modules: run on the newest releases too


@pytest.fixture(autouse=True)
def no_early_set_up(monkeypatch):
    """Each test starts with no set-up waiting to be taken over (an engine that failed to build leaves its own)."""
    monkeypatch.setattr(compiler_setup, "_early", {})


def test_it_imports_the_compiler_and_caches_its_key():
    set_up = CompilerSetUp(torch.device("cpu"))
    set_up.wait()
    report = set_up.report()
    assert report["set_up_s"] is not None and "set_up_error" not in report, report
    assert all(name in sys.modules for name in MODULES)
    codecache = sys.modules["torch._inductor.codecache"]
    assert codecache.torch_key() is codecache.torch_key()  # computed once for the process


def _held(monkeypatch, events: list) -> threading.Event:
    """Set-ups whose work waits for the returned event, which their `wait` sets: `events` gets "wait" when a caller
    waits and "done" once the work ran, in that order only if the caller really waited for it."""
    release = threading.Event()

    def run(self):
        release.wait()
        events.append("done")
        with compiler_setup._lock:
            compiler_setup._running.discard(self)

    original = CompilerSetUp.wait

    def wait(self, timeout_s=compiler_setup.FIRST_CALL_WAIT_S):
        events.append(("wait", timeout_s))
        release.set()
        original(self, timeout_s)

    monkeypatch.setattr(CompilerSetUp, "_run", run)
    monkeypatch.setattr(CompilerSetUp, "wait", wait)
    return release


def test_a_fork_waits_for_it(monkeypatch):
    events = []
    _held(monkeypatch, events)
    set_up = CompilerSetUp(torch.device("cpu"))
    assert set_up in compiler_setup._running
    compiler_setup._wait_all_before_fork()  # what os.register_at_fork runs before a fork
    assert events == [("wait", compiler_setup.FORK_WAIT_S), "done"]
    assert set_up not in compiler_setup._running


def test_the_first_compiled_call_waits_for_it_before_compiling(monkeypatch):
    events = []
    _held(monkeypatch, events)
    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    model = tiny_gpt2(2)
    model.config.use_cache = False  # calls with a KV cache run eager
    blocks = compile_module.compile_blocks(list(model.transformer.h), True, torch.device("cpu"))
    assert blocks.set_up is not None

    def backend(graph, inputs):  # Dynamo's capture without Inductor's code generation, each compile recorded
        events.append("compile")
        return graph.forward

    blocks.backend = backend
    torch._dynamo.reset()
    try:
        model(torch.zeros(1, 4, dtype=torch.long))
    finally:
        blocks.detach()
        torch._dynamo.reset()
    assert events[:3] == [("wait", compiler_setup.FIRST_CALL_WAIT_S), "done", "compile"]
    assert events.count(("wait", compiler_setup.FIRST_CALL_WAIT_S)) == 1  # the first call only


def test_a_failing_set_up_is_reported_and_waited_for_no_longer(monkeypatch):
    def fails(name):
        raise ImportError(f"no module named {name}")

    monkeypatch.setattr(compiler_setup.importlib, "import_module", fails)
    set_up = CompilerSetUp(torch.device("cpu"))
    set_up.wait()
    assert set_up.report()["set_up_error"].startswith("ImportError: no module named torch._inductor")
    assert set_up not in compiler_setup._running


def test_no_set_up_for_another_backend(monkeypatch):
    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    blocks = compile_module.compile_blocks(list(tiny_gpt2(2).transformer.h), True, torch.device("cpu"))
    try:
        assert blocks.set_up is None and "set_up_s" not in blocks.report()
    finally:
        blocks.detach()


@pytest.mark.gpu
@pytest.mark.parametrize("indexed", [True, False])
def test_on_a_gpu_it_runs_for_the_engines_device(indexed):
    """An indexed device or an unindexed one (the caller's current device): the thread names it, no part fails."""
    device = torch.device("cuda", torch.cuda.device_count() - 1) if indexed else torch.device("cuda")
    set_up = CompilerSetUp(device)
    set_up.wait()
    assert set_up.device.index is not None and "set_up_error" not in set_up.report(), set_up.report()


def _graph_counting_backend(graphs: list):
    def backend(graph, inputs):  # Dynamo's capture without Inductor's code generation
        graphs.append(torch.is_grad_enabled())
        return graph.forward
    return backend


def test_the_rehearsal_compiles_a_training_and_an_inference_graph_and_draws_no_random_number():
    graphs = []
    torch._dynamo.reset()
    torch.manual_seed(0)
    state = torch.get_rng_state()
    try:
        compile_rehearsal.rehearse(torch.device("cpu"), _graph_counting_backend(graphs))
    finally:
        torch._dynamo.reset()
    assert graphs == [True, False]  # the block's two graphs, grad on then no_grad, as a checkpointed block compiles
    assert torch.equal(torch.get_rng_state(), state)
    one, two = (compile_rehearsal.MiniatureBlock(torch.device("cpu"), torch.bfloat16) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values()))


def test_the_thread_rehearses_where_asked_and_a_failing_rehearsal_is_reported_only():
    graphs = []
    torch._dynamo.reset()
    try:
        rehearsed = CompilerSetUp(torch.device("cpu"), _graph_counting_backend(graphs), rehearse=True)
        rehearsed.wait()
        assert graphs == [True, False]
        report = rehearsed.report()
        assert report["set_up_rehearsal_s"] is not None and "set_up_rehearsal_error" not in report, report

        def fails(graph, inputs):
            raise RuntimeError("no compiler here")

        torch._dynamo.reset()
        failed = CompilerSetUp(torch.device("cpu"), fails, rehearse=True)
        failed.wait()
        assert "no compiler here" in failed.report()["set_up_rehearsal_error"]
        assert failed not in compiler_setup._running
    finally:
        torch._dynamo.reset()
    assert "set_up_rehearsal_s" not in CompilerSetUp(torch.device("cpu")).report()  # by default on a GPU only


def test_the_engine_takes_over_a_set_up_started_early_once(monkeypatch):
    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    early = compiler_setup.start_early(torch.device("cpu"))
    assert compiler_setup.start_early(torch.device("cpu")) is early  # one per device until taken
    first = compile_module.compile_blocks(list(tiny_gpt2(2).transformer.h), True, torch.device("cpu"))
    second = compile_module.compile_blocks(list(tiny_gpt2(2).transformer.h), True, torch.device("cpu"))
    try:
        assert first.set_up is early and second.set_up is not early and second.set_up is not None
        assert compiler_setup.take_early(torch.device("cpu")) is None
    finally:
        first.detach()
        second.detach()


def test_a_training_call_waits_for_it(monkeypatch):
    events = []
    _held(monkeypatch, events)
    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    model = tiny_gpt2(2)
    blocks = compile_module.compile_blocks(list(model.transformer.h), True, torch.device("cpu"))
    try:
        blocks.training_call(model, {})
    finally:
        blocks.detach()
    assert events == [("wait", compiler_setup.FIRST_CALL_WAIT_S), "done"]


def test_the_engine_starts_it_before_its_host_buffers_and_takes_it_over(monkeypatch):
    """The runtime's construction starts the set-up at its beginning (compile.start_set_up), and its compiled
    blocks take that one over: its imports run beside the host buffers instead of after the CPU probe."""
    from stronghold.engine import runtime as runtime_module

    order = []
    original_start, original_place = compiler_setup.start_early, runtime_module.place_resident

    def start(*args):
        order.append("set-up")
        return original_start(*args)

    def place(*args, **kwargs):
        order.append("host")
        return original_place(*args, **kwargs)

    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    monkeypatch.setattr(compiler_setup, "start_early", start)
    monkeypatch.setattr(runtime_module, "place_resident", place)
    engine = engine_for(tiny_gpt2(2), compile=True)
    blocks = engine._sh_runtime.compiled
    try:
        assert order == ["set-up", "host"]
        assert blocks.set_up is not None and compiler_setup.take_early(torch.device("cpu")) is None
    finally:
        blocks.detach()
