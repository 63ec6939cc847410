"""The blocks compiled on a thread while the first steps run eager (integrations/compile_thread.py), fp32 on the CPU.

compile.BACKGROUND forces the thread on (a GPU's default); the backend is aot_eager behind a wrapper that counts the
compiled graph's runs and names the thread that compiled it. Each test waits for the compile (`wait_compiled`) at a
chosen point, so the step where the compiled forward takes over is known, never left to timing.

Tolerance: as test_compile.py, 1e-5 whole-model relative against the eager engine (aot_eager runs the same aten
ops, decomposed in places).
"""
import copy
import logging
import threading

import pytest
import torch
import torch._dynamo
from torch import nn

import stronghold
from stronghold.integrations import compile as compile_module
from stronghold.integrations.compile_thread import draws_random, shadow

from .helpers import batches, ds_config, relative_error, tiny_gpt2, tiny_llama, train_stronghold

pytestmark = pytest.mark.newest

TOL = 1e-5


class _CountingBackend:
    """aot_eager, counting the compiled graphs' runs and recording which thread compiled each graph."""

    def __init__(self, fail: bool = False):
        self.fail, self.runs, self.threads = fail, 0, []
        self.release = threading.Event()
        """Compiling waits for it: the test decides when the thread can finish."""

    def __call__(self, graph, example_inputs):
        self.threads.append(threading.current_thread().name)
        assert self.release.wait(timeout=600), "the test never released the compile"
        if self.fail:
            raise RuntimeError("this backend cannot compile")
        inner = torch._dynamo.backends.registry.lookup_backend("aot_eager")(graph, example_inputs)

        def run(*args):
            self.runs += 1
            return inner(*args)
        return run


@pytest.fixture
def backend(monkeypatch):
    counting = _CountingBackend()
    monkeypatch.setattr(compile_module, "BACKEND", counting)
    monkeypatch.setattr(compile_module, "BACKGROUND", True)
    torch._dynamo.reset()
    yield counting
    torch._dynamo.reset()


def _model(arch: str = "llama", checkpointing=None):
    model = tiny_llama(4) if arch == "llama" else tiny_gpt2(4)
    model.config.use_cache = False
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    return model


def _train(model, data, config, wait_after: int):
    """stronghold's loop (helpers.train_stronghold), the compile held back until step `wait_after` ends, then waited for; the
    compiled graph's runs counted at the end of each step (after that wait)."""
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=config)
    runs, losses = [], []
    for i, batch in enumerate(data, start=1):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if i == wait_after:
            compile_module.BACKEND.release.set()
            engine.stronghold_runtime.compiled.wait_compiled()
        runs.append(compile_module.BACKEND.runs)
    engine.synchronize_host()
    return engine, losses, runs


@pytest.mark.parametrize("checkpointing", [None, False, True])
def test_eager_until_the_step_after_the_compile_then_compiled(backend, checkpointing):
    """Steps 1 and 2 run eager (the thread's one probe run a grad mode is the only compiled run), the thread
    finishes after step 2, and from step 3 on every block call runs the compiled graph: 4 blocks a forward, and each checkpointed
    block again in its recompute. Training equals the eager engine throughout."""
    model, data = _model(checkpointing=checkpointing), batches(4)
    config = dict(window=2, resident=1, clip=0.05)
    eager, eager_losses = train_stronghold(model, data, ds_config(compile=False, **config))
    engine, losses, runs = _train(model, data, ds_config(compile=True, **config), wait_after=2)
    modes = 2 if checkpointing else 1  # reentrant: a no-grad forward and a grad recompute; non-reentrant: one graph
    assert runs[0] <= runs[1] == modes  # the thread's probe runs, one a grad mode; steps 1 and 2 eager
    assert len(backend.threads) >= 1
    assert all(name.startswith("stronghold-compile") for name in backend.threads)
    calls = 4 * (2 if checkpointing is not None else 1)
    assert runs[2] - runs[1] == calls and runs[3] - runs[2] == calls
    report = engine.stronghold_report()["compile"]
    assert report["background"] and report["switched"] and report["enabled"] and report["compile_s"] > 0
    assert relative_error(engine.module, eager.module) <= TOL
    assert losses == pytest.approx(eager_losses, rel=TOL)
    engine.destroy()
    eager.destroy()


def test_the_switch_waits_for_a_whole_accumulation_window(backend):
    """With accumulation 2 the compile finishes after the window's first micro-step: its second still runs eager, and
    the next window's first forward switches."""
    model, data = _model(), batches(4)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(compile=True, gas=2))
    runs = []
    for i, batch in enumerate(data, start=1):
        engine.backward(engine(**batch).loss)
        engine.step()
        if i == 1:
            backend.release.set()
            engine.stronghold_runtime.compiled.wait_compiled()
        runs.append(backend.runs)
    assert runs[1] == runs[0] == 1 and runs[2] - runs[1] == 4 and runs[3] - runs[2] == 4
    engine.destroy()


def test_a_failing_background_compile_leaves_every_block_eager_with_one_warning(backend, caplog):
    backend.fail = True
    backend.release.set()
    model, data = _model(), batches(3)
    eager, _ = train_stronghold(model, data, ds_config(compile=False))
    with caplog.at_level(logging.WARNING, logger=compile_module.__name__):
        engine, _, _ = _train(model, data, ds_config(compile=True), wait_after=1)
    for (name, a), (_, b) in zip(engine.module.named_parameters(), eager.module.named_parameters()):
        assert torch.equal(a, b), name  # eager throughout, and the probe changed nothing
    warnings = [r for r in caplog.records if r.name == compile_module.__name__]
    assert len(warnings) == 1 and "this backend cannot compile" in warnings[0].getMessage()
    report = engine.stronghold_report()["compile"]
    assert not report["enabled"] and not report["switched"] and "this backend cannot compile" in report["fallback"]
    engine.destroy()
    eager.destroy()


def test_destroy_before_the_switch_restores_the_blocks(backend):
    backend.release.set()
    model = _model()
    engine, _, _, _ = stronghold.initialize(model=model, config=ds_config(compile=True))
    engine.backward(engine(**batches(1)[0]).loss)
    engine.destroy()
    assert not any("forward" in block.__dict__ for block in model.model.layers)


def test_blocks_that_draw_random_numbers_compile_on_the_training_thread(backend):
    """Dropout draws from the global generator: a probe on another thread would move the training's draws by an amount
    that depends on timing, so such blocks compile synchronously."""
    dropout = tiny_gpt2(2)
    dropout.config.use_cache = False
    for module in dropout.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.1
    assert draws_random(dropout.transformer.h[0])
    assert not draws_random(_model("gpt2").transformer.h[0]) and not draws_random(_model().model.layers[0])
    llama = _model()
    llama.model.layers[0].self_attn.attention_dropout = 0.1
    assert draws_random(llama.model.layers[0])
    backend.release.set()
    engine, _, _, _ = stronghold.initialize(model=dropout, config=ds_config(compile=True))
    engine.backward(engine(**batches(1)[0]).loss)
    report = engine.stronghold_report()["compile"]
    assert not report["background"] and report["graphs"] == 1
    assert backend.threads == [threading.current_thread().name]
    engine.step()
    engine.destroy()


def test_the_shadow_aliases_the_blocks_tensors_and_rebinds_its_forwards():
    block = _model().model.layers[0]
    block.mlp.forward = block.mlp.forward  # an instance forward bound to the module (as forwards.install leaves one)
    twin = shadow(block)
    for (name, p), (_, q) in zip(block.named_parameters(), twin.named_parameters()):
        assert q is not p and q.data_ptr() == p.data_ptr() and q.requires_grad == p.requires_grad, name
    assert twin.mlp is not block.mlp and twin.mlp.forward.__self__ is twin.mlp
    assert twin.self_attn.config is block.self_attn.config  # what is not a module, parameter or buffer: shared
    x = torch.randn(2, 16, 32)
    assert torch.equal(twin.mlp(x), block.mlp(x))


@pytest.mark.slow
def test_inductor_on_the_thread_matches_eager(monkeypatch):
    """Inductor's generated code, compiled on the thread with the backward lowered at the forward's compile (C++ on
    the CPU, about 30 s on 2 cores with a cold cache): from the step after the compile, training runs compiled and
    equals eager."""
    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    monkeypatch.setattr(compile_module, "BACKGROUND", True)
    torch._dynamo.reset()
    model, data = _model("gpt2"), batches(3)
    eager, eager_losses = train_stronghold(model, data, ds_config(compile=False, window=2, resident=0))
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model),
                                            config=ds_config(compile=True, window=2, resident=0))
    losses = []
    for i, batch in enumerate(data):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if i == 0:
            engine.stronghold_runtime.compiled.wait_compiled()
    engine.synchronize_host()
    report = engine.stronghold_report()["compile"]
    assert report["switched"] and report["graphs"] == 1, report
    assert relative_error(engine.module, eager.module) <= TOL
    assert losses == pytest.approx(eager_losses, rel=TOL)
    engine.destroy()
    eager.destroy()
    torch._dynamo.reset()
