"""Regional compilation of the blocks (integrations/compile.py), fp32 on the CPU.

Backends: the equality tests compile with "aot_eager" through compile.BACKEND (Dynamo's capture and AOTAutograd's
forward / backward split, the parts that meet the window's hooks and checkpointing, without Inductor's code
generation, which takes most of a minute per model on 2 cores); `test_inductor_matches_eager` runs Inductor itself.

Tolerance: aot_eager runs the same aten ops as eager, decomposed in places, and Inductor reorders fp32 reductions
(fused norms, sums of gradients): results agree to rounding, and after a few AdamW steps at lr 1e-2 to the bar of
test_equivalence.py, 1e-5 whole-model relative.
"""
import copy
import functools
import logging

import pytest
import torch
import torch._dynamo.testing
import transformers
from torch import nn

import stronghold
from stronghold.config import parse_stronghold_section, resolve
from stronghold.integrations import compile as compile_module
from stronghold.integrations.compile import compile_wanted

from .helpers import (batches, checkpoint_outside_forward, ds_config, relative_error, run_steps, tiny_gpt2, tiny_llama,
                      train_stronghold)

pytestmark = pytest.mark.newest  # the HF models' own code: run on the newest transformers too

TOL = 1e-5


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    torch._dynamo.reset()  # each test compiles from scratch: its counts are its own
    yield
    torch._dynamo.reset()


def _model(arch: str, n_layer: int = 4, checkpointing=None):
    model = tiny_llama(n_layer) if arch == "llama" else tiny_gpt2(n_layer)
    model.config.use_cache = False  # training: no KV cache (calls carrying one run eager)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    return model


def _compare(model, data, check=None, **config):
    """Train with "compile" true and false from the same init; the compiled engine's report. `check(engine)`: more
    assertions on the compiled engine before it is destroyed."""
    eager, eager_losses = train_stronghold(model, data, ds_config(compile=False, **config))
    compiled, losses = train_stronghold(model, data, ds_config(compile=True, **config))
    report = compiled.stronghold_report()["compile"]
    assert "compile" not in eager.stronghold_report()
    assert relative_error(compiled.module, eager.module) <= TOL
    assert losses == pytest.approx(eager_losses, rel=TOL)
    if check is not None:
        check(compiled)
    compiled.destroy()
    eager.destroy()
    return report


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_streamed_blocks_with_accumulation_and_clipping_match_eager(arch):
    """Three of four blocks streamed through a window of 2 (their weights in a different slot from one call to the
    next), accumulation 2, clipping that triggers at lr 1e-2."""
    report = _compare(_model(arch), batches(4), window=2, resident=1, gas=2, clip=0.05)
    assert report["enabled"] and report["fallback"] is None and report["graphs"] >= 1 and report["compile_s"] > 0
    _check_parts(report)


def _check_parts(report: dict) -> None:
    """The compile's parts are regions timed during the compiling calls: some, and Dynamo's compile of the frame (on
    the calling thread) within the compile's seconds. Other regions may run on Inductor's compile threads at once, so
    their sums can pass the wall time."""
    parts = report["parts_s"]
    frame = [seconds for name, seconds in parts.items() if "compile_inner" in name or "entire_frame_compile" in name]
    assert parts and all(seconds > 0 for seconds in parts.values()), parts
    assert frame and max(frame) <= report["compile_s"], parts


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_checkpointing_matches_eager(reentrant):
    """HF's checkpointing wraps each block's __call__, so the compiled forward runs in the forward and again in the
    recompute. Either way the compiled blocks checkpoint reentrantly (HF's default non-reentrant one is replaced,
    reentrant.py): the forward under no_grad, the recompute in backward with grad on (one graph each on the pinned
    transformers; the newest's layers share one), against the eager engine's own (non-reentrant) checkpoint."""
    report = _compare(_model("llama", checkpointing=reentrant), batches(3), window=2, resident=1)
    assert report["enabled"] and report["graphs"] in (1, 2)
    # Replaced only where the model's own is the non-reentrant one: 4 blocks, 3 forwards, less the class's first call
    # (the model's own checkpoint, whose output shows that a reentrant one carries its gradient); none where the
    # checkpoint runs inside the compiled forward (the newest transformers).
    assert report["reentrant_calls"] == (0 if reentrant or not checkpoint_outside_forward() else 4 * 3 - 1)


def test_reentrant_checkpoints_only_where_they_give_the_same_gradients():
    """With the input embedding frozen and HF's hook that makes the embedding's output require grad removed, the
    first block's input does not require grad, where a reentrant checkpoint would compute no gradient for that
    block's parameters: its calls keep HF's non-reentrant one (the later blocks' inputs require grad through it), and
    training equals eager still."""
    model = _model("llama", checkpointing=False)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.disable_input_require_grads()
    report = _compare(model, batches(3), window=2, resident=1)
    # 3 forwards, the 3 later blocks, less one (none where the checkpoint is inside the compiled forward)
    assert report["enabled"] and report["reentrant_calls"] == (3 * 3 - 1 if checkpoint_outside_forward() else 0)


def test_checkpointing_turned_on_after_set_up_is_made_reentrant_and_put_back_at_destroy():
    """Trainer turns HF's checkpointing on in train(), after the one line built the engine: the next training forward
    installs the reentrant one; destroy puts back HF's function. A checkpoint function other than HF's plain one
    (here selective checkpointing's context_fn) is left as the model set it."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from stronghold.integrations.reentrant import ATTRIBUTE

    model = _model("llama")
    engine = stronghold.initialize(model=model, config=ds_config(compile=True, window=2, resident=1))[0]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = list(model.model.layers)
    own = [layer.__dict__[ATTRIBUTE] for layer in layers]
    run_steps(engine, batches(1))
    assert all(layer.__dict__[ATTRIBUTE] is not fn for layer, fn in zip(layers, own))
    assert engine.stronghold_report()["compile"]["reentrant_calls"] == (
        len(layers) - 1 if checkpoint_outside_forward() else 0)
    engine.destroy()
    assert all(layer.__dict__[ATTRIBUTE] is fn for layer, fn in zip(layers, own))

    model = _model("llama")
    selective = functools.partial(lambda: create_selective_checkpoint_contexts([torch.ops.aten.mm.default]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": selective})
    engine = stronghold.initialize(model=model, config=ds_config(compile=True, window=2, resident=1))[0]
    own = [layer.__dict__[ATTRIBUTE] for layer in model.model.layers]
    run_steps(engine, batches(1))
    assert [layer.__dict__[ATTRIBUTE] for layer in model.model.layers] == own
    assert engine.stronghold_report()["compile"]["reentrant_calls"] == 0
    engine.destroy()


def test_activation_offload_and_mlp_chunks_match_eager():
    """The blocks' saved activations go to host buffers (activations.py, through the saved-tensor hooks, which see
    what the compiled function saves) and each MLP runs in chunks of 8 tokens (mlp_chunks.py, eager inside the
    compiled block: a graph break around the chunked Function)."""
    def check(engine):
        runtime = engine.stronghold_runtime
        assert runtime.mlp_chunks.chunked_calls > 0
        assert engine.stronghold_report()["activations"]["d2h_bytes_per_step"] > 0

    model = _model("llama", checkpointing=False)
    report = _compare(model, batches(3), check, window=2, resident=1, offload_activations=2, mlp_chunk_tokens=8)
    assert report["enabled"]
    if int(transformers.__version__.split(".")[0]) < 5:
        assert report["graphs"] == 2  # the block's compute before the chunked MLP, and after it
    # transformers 5's Llama layer, with the MLP chunked, runs its forward eager under Dynamo (no graph): equal to
    # eager still (above), but not compiled.


def test_one_compile_serves_every_block_and_step():
    """Four blocks (one resident, three streamed through two slots), three steps: Dynamo compiles the block's forward
    once; a recompile per block or per step (a guard on a parameter's storage, or on the block's identity) would
    count more frames."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compile_module.BACKEND = counter
    engine, _ = train_stronghold(_model("gpt2"), batches(3), ds_config(compile=True, window=2, resident=1))
    assert counter.frame_count == 1
    assert engine.stronghold_report()["compile"]["graphs"] == 1
    engine.destroy()


def _failing_backend(graph, example_inputs):
    raise RuntimeError("this backend cannot compile")


def test_a_failing_compile_falls_back_to_eager_with_one_warning(caplog):
    compile_module.BACKEND = _failing_backend
    model, data = _model("gpt2"), batches(3)
    with caplog.at_level(logging.WARNING, logger=compile_module.__name__):
        report = _compare_fallback(model, data)
    warnings = [r for r in caplog.records if r.name == compile_module.__name__]
    assert len(warnings) == 1 and "this backend cannot compile" in warnings[0].getMessage()
    assert "this backend cannot compile" in report["fallback"] and not report["enabled"]


def _compare_fallback(model, data):
    eager, _ = train_stronghold(model, data, ds_config(compile=False, window=2, resident=1, gas=1))
    fallen, _ = train_stronghold(model, data, ds_config(compile=True, window=2, resident=1, gas=1))
    # Eager from the first call on, and the probe changed nothing: bit-identical to the run without the key.
    for (name, a), (_, b) in zip(fallen.module.named_parameters(), eager.module.named_parameters()):
        assert torch.equal(a, b), name
    report = fallen.stronghold_report()["compile"]
    fallen.destroy()
    eager.destroy()
    return report


class _FailsAfterFirst:
    """aot_eager for the first graph, an error for any later one (a recompile for a new input shape)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        if self.graphs > 1:
            raise RuntimeError("the recompile failed")
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(graph, example_inputs)


def test_a_failing_recompile_falls_back_to_eager_mid_training():
    """Two steps at micro-batch 2, then two at 1: the new shape recompiles, the backend raises before the graph runs,
    and that call and every later one run eager; training equals eager throughout."""
    compile_module.BACKEND = _FailsAfterFirst()
    data = batches(2) + batches(2, seed=2, batch=1)
    report = _compare(_model("gpt2"), data, window=2, resident=1)
    assert not report["enabled"] and "the recompile failed" in report["fallback"]
    assert compile_module.BACKEND.graphs == 2


def test_training_calls_leave_the_kv_cache_out_so_the_blocks_run_compiled(caplog):
    """GPT-2 keeps `use_cache` on by default, which hands each block a cache it updates (compiled, every layer would be
    its own graph): training calls get use_cache=False, the blocks run compiled, no warning, and training matches."""
    model = tiny_gpt2(4)
    assert model.config.use_cache
    with caplog.at_level(logging.WARNING, logger=compile_module.__name__):
        report = _compare(model, batches(2), window=2, resident=1)
    assert report["enabled"] and report["eager_cache_calls"] == 0 and report["graphs"] == 1
    assert not [r for r in caplog.records if r.name == compile_module.__name__]


def test_calls_that_ask_for_a_kv_cache_run_eager(caplog):
    """A caller's own use_cache=True is kept: those calls run eager (one warning says how to train compiled), and
    their loss is eager's."""
    model = tiny_gpt2(2)
    batch = batches(1)[0]
    reference = copy.deepcopy(model)(**batch).loss
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model),
                                            config=ds_config(compile=True, window=2, resident=0))
    with caplog.at_level(logging.WARNING, logger=compile_module.__name__):
        loss = engine(**batch, use_cache=True).loss
    report = engine.stronghold_report()["compile"]
    assert report["eager_cache_calls"] == 2 and report["graphs"] == 0
    assert loss.item() == pytest.approx(reference.item(), rel=TOL)
    warnings = [r.getMessage() for r in caplog.records if r.name == compile_module.__name__]
    assert len(warnings) == 1 and "use_cache" in warnings[0]
    engine.backward(loss)
    engine.step()
    engine.destroy()


def test_destroy_restores_the_blocks_forward():
    model = _model("gpt2", n_layer=2)
    engine, _, _, _ = stronghold.initialize(model=model, config=ds_config(compile=True, window=2, resident=0))
    blocks = model.transformer.h
    assert all("forward" in block.__dict__ for block in blocks)
    engine.destroy()
    assert not any("forward" in block.__dict__ for block in blocks)


@pytest.mark.gpu
def test_bf16_compiled_matches_the_mixed_precision_reference(monkeypatch):
    """Inductor on a GPU, bf16, with the window streaming five of six blocks: within the tolerance of test_gpu.py's
    eager check (3 x the distance between the reference with its AdamW on the GPU and on the CPU) of a reference whose
    blocks run the same compiled code (against the eager reference the fused kernels' rounding dominates)."""
    from .test_gpu import _bf16_reference, _distance
    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    torch.manual_seed(0)
    model, data = _model("llama", n_layer=6), batches(5)
    # Stronghold first: the references then reuse its graph (one compiled function), so it is stronghold's count.
    engine, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=1e-3, clip=0.5, bf16=True,
                                                        compile=True))
    report = engine.stronghold_report()["compile"]
    assert report["enabled"] and report["graphs"] == 1, report
    want = _bf16_reference(model, data, lr=1e-3, clip=0.5, optimizer_device="cuda", compiled=True)
    noise = _distance(_bf16_reference(model, data, lr=1e-3, clip=0.5, optimizer_device="cpu", compiled=True), want)
    masters = engine.stronghold_runtime.master_params()
    got = {n: masters[id(p)].float().cpu() for n, p in engine.module.named_parameters()}
    assert _distance(got, want) <= max(3 * noise, 1e-6), (_distance(got, want), noise)
    engine.destroy()


@pytest.mark.slow
def test_inductor_matches_eager(monkeypatch):
    """Inductor's generated code (C++ on the CPU), two blocks, both streamed (23 s on 2 cores with a cold
    TORCHINDUCTOR_CACHE_DIR)."""
    monkeypatch.setattr(compile_module, "BACKEND", "inductor")
    report = _compare(_model("gpt2", n_layer=2), batches(2), window=2, resident=0)
    assert report["enabled"] and report["backend"] == "inductor" and report["graphs"] == 1
    _check_parts(report)
    # The process's compiler set-up ran with these blocks, done before their first compiled call.
    assert report["set_up_s"] is not None and "set_up_error" not in report


@pytest.mark.slow
def test_stronghold_ops_kernels_inside_compiled_blocks_train_as_eager():
    """stronghold_ops' Triton kernels patched into the blocks (the "kernels" key does this on a GPU; here by hand,
    run by Triton's interpreter, 27 s on 2 cores): Dynamo traces them into the block's graph, or compiling fails and every block
    runs eager (under the interpreter Dynamo meets the interpreter's NumPy code and fails: the fallback); either way
    training equals the eager run with the same kernels."""
    import stronghold_ops
    model = _model("llama", n_layer=2)
    assert stronghold_ops.apply(model).patched
    report = _compare(model, batches(2), window=2, resident=0)
    assert report["enabled"] or report["fallback"]


def test_auto_is_on_for_cuda_only():
    class LlamaDecoderLayer(nn.Module):
        pass

    class GPT2Block(nn.Module):
        pass

    class OPTDecoderLayer(nn.Module):  # a family not measured compiled
        pass

    def wanted(setting, device, blocks=()):
        device = torch.device(device)
        resolved = resolve(parse_stronghold_section({"stronghold": {"compile": setting}}), device).compile
        return compile_wanted(resolved, device, blocks)

    llama, gpt2, opt = [LlamaDecoderLayer(), LlamaDecoderLayer()], [GPT2Block()], [OPTDecoderLayer()]
    assert not wanted("auto", "cpu", llama) and not wanted("auto", "cpu", gpt2)
    assert wanted("auto", "cuda", llama) and wanted("auto", "cuda", gpt2)
    assert not wanted("auto", "cuda", opt)
    assert not wanted("auto", "cuda", llama + opt)
    assert wanted(True, "cpu") and not wanted(False, "cuda")


@pytest.mark.parametrize("value", ["yes", 1, None, ["blocks"]])
def test_a_bad_value_names_the_key_and_the_choices(value):
    with pytest.raises(ValueError, match=r"stronghold\.compile: should be true, false or \"auto\""):
        parse_stronghold_section({"stronghold": {"compile": value}})
    assert parse_stronghold_section({}).compile == "auto"
