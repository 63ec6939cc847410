"""Activation offload (activations.py), fp32 on the CPU: same gradients and the same training as without it.

Tolerances: against torch AdamW the bar of test_equivalence.py (1e-5 whole-model relative: rounding
noise of a different summation order in the CPU AdamW and the clipping, amplified by Adam). Against
stronghold with offload off: bit-identical, because offload only moves bytes: the copy that comes
back holds the same values with the same strides, so backward runs the same kernels on the same inputs.
"""
import copy
import warnings

import pytest
import torch

import stronghold
from stronghold.memory.activations import ActivationOffload
from stronghold.config import parse_stronghold_section
from stronghold.streaming.schedule import Phase
from stronghold.streaming.streams import Transfers

from .helpers import BATCH, SEQ, batches, ds_config, relative_error, tiny_llama, train_reference, train_stronghold

TOL = 1e-5
LR = 3e-3
CHECKPOINTING = {"off": None, "reentrant": True, "non_reentrant": False}


def _model(checkpointing: str, n_layer: int = 4):
    model = tiny_llama(n_layer)
    if CHECKPOINTING[checkpointing] is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": CHECKPOINTING[checkpointing]})
    return model


def _identical(a, b) -> bool:
    return all(torch.equal(p.detach(), q.detach()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
@pytest.mark.parametrize("window,resident,offloaded", [(2, 1, 3), (3, 0, True), (2, 4, 2)])
def test_matches_adamw_and_is_bit_identical_to_offload_off(checkpointing, window, resident, offloaded):
    model, data = _model(checkpointing), batches(3)
    reference, ref_losses = train_reference(model, data, lr=LR)
    plain, plain_losses = train_stronghold(model, data, ds_config(window=window, resident=resident, lr=LR))
    engine, losses = train_stronghold(model, data, ds_config(window=window, resident=resident, lr=LR,
                                                             offload_activations=offloaded))
    report = engine.stronghold_report()["activations"]
    assert report["blocks"] == ([0, 1, 2] if offloaded is True else list(range(offloaded)))
    assert report["d2h_bytes_per_step"] > 0 and report["h2d_bytes_per_step"] == report["d2h_bytes_per_step"]
    assert losses == plain_losses and _identical(engine.module, plain.module)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert relative_error(engine.module, reference) <= TOL


def test_gradient_accumulation_and_clipping():
    model, data = _model("non_reentrant"), batches(4)
    reference, _ = train_reference(model, data, lr=LR, gas=2, clip=0.1)
    plain, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=LR, gas=2, clip=0.1))
    engine, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=LR, gas=2, clip=0.1,
                                                        offload_activations=True))
    assert engine.global_steps == 2
    assert _identical(engine.module, plain.module)
    assert relative_error(engine.module, reference) <= TOL


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
def test_gradients_are_bit_identical_without_the_engine(checkpointing):
    """The offload alone, on a plain model under its saved-tensor hooks: every .grad equals the plain one."""
    model, batch = _model(checkpointing), batches(1)[0]
    plain = copy.deepcopy(model)
    plain(**batch).loss.backward()
    offload = ActivationOffload(dict(enumerate(model.model.layers)), Transfers(torch.device("cpu")), pin=False,
                                chosen=3)
    offload.attach()
    offload.begin(Phase.FORWARD)
    with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
        loss = model(**batch).loss
    offload.begin(Phase.BACKWARD)
    loss.backward()
    offload.detach()
    assert offload.stats["offloaded_tensors"] >= 3
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
def test_backward_reads_the_host_copy_not_the_device_tensor(checkpointing):
    """Poison the offloaded blocks' device inputs between forward and backward (as the slot test does
    for weights): backward must read the host copy. Without offload the same poison reaches the
    gradients, which shows that the test would catch an unpack that used the device memory."""
    def run(offloaded):
        model, data = _model(checkpointing), batches(2)
        engine, _, _, _ = stronghold.initialize(
            model=model, config=ds_config(window=2, resident=1, lr=LR, offload_activations=offloaded))
        inputs = []
        handles = [engine.module.model.layers[i].register_forward_pre_hook(
            lambda module, args: inputs.append(args[0])) for i in range(3)]
        for batch in data:
            inputs.clear()
            loss = engine(**batch).loss
            for tensor in inputs:
                tensor.data.fill_(float("nan"))  # .data: the storage, without bumping autograd's version
            engine.backward(loss)
            engine.step()
        for handle in handles:
            handle.remove()
        engine.synchronize_host()
        return engine

    reference, _ = train_reference(_model(checkpointing), batches(2), lr=LR)
    offloaded = run(3)
    assert offloaded.stronghold_runtime.skipped_steps == 0
    assert relative_error(offloaded.module, reference) <= TOL
    # NaN gradients: the engine skips each step (runtime.step), which is how the poison shows.
    assert run(0).stronghold_runtime.skipped_steps == 2


def test_host_buffers_are_reused_across_steps_and_the_report_counts_tokens():
    model = _model("reentrant")
    engine, _ = train_stronghold(model, batches(1), ds_config(window=2, resident=1, lr=LR, offload_activations=3))
    activations = engine.stronghold_runtime.activations
    after_one = activations.pool.bytes
    engine.stronghold_report(reset=True)
    from .helpers import run_steps
    run_steps(engine, batches(3))
    report = engine.stronghold_report()["activations"]
    assert activations.pool.bytes == after_one, "the pool must not grow once its sizes are known"
    tokens = BATCH * SEQ
    hidden_bytes = 32 * 4  # hidden size 32, fp32
    assert report["tokens_per_step"] == tokens and report["block_input_bytes_per_token"] == hidden_bytes
    # Reentrant checkpointing saves exactly the input of each of the 3 offloaded blocks.
    assert report["d2h_bytes_per_step"] == 3 * tokens * hidden_bytes
    assert report["d2h_bytes_per_token"] == 3 * hidden_bytes


def test_evaluation_forward_with_offload_on():
    model, data = _model("non_reentrant"), batches(3)
    engine, _ = train_stronghold(model, data[:2], ds_config(window=2, resident=1, lr=LR, offload_activations=3))
    reference, _ = train_reference(model, data[:2], lr=LR)
    engine.eval()
    reference.eval()
    with torch.no_grad():
        assert engine(**data[2]).loss.item() == pytest.approx(reference(**data[2]).loss.item(), rel=1e-5)


def test_default_keeps_offload_off_on_the_cpu():
    engine, _ = train_stronghold(tiny_llama(4), batches(1), ds_config(window=2, resident=1, lr=LR))
    assert engine.stronghold_runtime.activations is None
    assert "activations" not in engine.stronghold_report()


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (3, 3), (0, 0), ("auto", "auto")])
def test_config_values(value, expected):
    cfg = parse_stronghold_section({"stronghold": {"offload_activations": value}})
    assert cfg.offload_activations == expected and type(cfg.offload_activations) is type(expected)


@pytest.mark.parametrize("value", ["yes", -1, 1.5, "all", None])
def test_bad_config_values_name_the_key(value):
    with pytest.raises(ValueError, match=r"stronghold\.offload_activations"):
        parse_stronghold_section({"stronghold": {"offload_activations": value}})


def test_a_block_called_without_a_positional_tensor_is_named_once():
    """A custom block that takes its hidden state as a keyword cannot be recognised: warned once per block,
    and training is unaffected (nothing is offloaded for it)."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, *, x):
            return torch.tanh(self.linear(x))

    blocks = torch.nn.ModuleList([Block(), Block()])
    offload = ActivationOffload(dict(enumerate(blocks)), Transfers(torch.device("cpu")), pin=False, chosen=1)
    offload.attach()
    x = torch.randn(2, 8, requires_grad=True)

    def step():
        offload.begin(Phase.FORWARD)
        with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
            y = blocks[1](x=blocks[0](x=x))
        offload.begin(Phase.BACKWARD)
        y.sum().backward()

    with pytest.warns(UserWarning, match="block 0 was called without a tensor"):
        step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per block, not every step
        step()
    offload.detach()
    assert offload.stats["offloaded_tensors"] == 0
