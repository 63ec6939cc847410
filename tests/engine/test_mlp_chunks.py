"""Chunked MLPs for long sequences (mlp_chunks.py), fp32 on the CPU.

Tolerances: the MLP is computed per token, so a chunk's outputs and input gradients are the unchunked
ones up to the matmul kernel's blocking (seen: equal, or 1 ulp); the parameter gradients are sums over
chunks in a different order, ~1e-7 relative in fp32: 1e-6 bounds both. Training against torch AdamW:
the bar of test_equivalence.py (1e-5 whole-model relative).
"""
import copy

import pytest
import torch

from stronghold.memory import mlp_chunks
from stronghold.config import parse_stronghold_section, resolve
from stronghold.memory.mlp_chunks import ChunkedMLP, MlpChunks, chunk_tokens_of

from .helpers import batches, ds_config, relative_error, tiny_gpt2, tiny_llama, train_reference, train_stronghold

pytestmark = pytest.mark.newest  # the HF models' own code: run on the newest transformers too


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()

TOL = 1e-6
LR = 3e-3


def _mlp(arch: str):
    model = tiny_llama(1) if arch == "llama" else tiny_gpt2(1)
    return (model.model.layers[0] if arch == "llama" else model.transformer.h[0]).mlp


def _run(mlp, x, chunk_rows=None):
    x = x.detach().clone().requires_grad_(True)
    mlp.zero_grad()
    if chunk_rows is None:
        out = mlp(x)
    else:
        out = ChunkedMLP.apply(mlp.forward, chunk_rows, x, *[p for p in mlp.parameters() if p.requires_grad])
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 64])
def test_chunked_mlp_matches_the_mlp(arch, chunk_rows):
    torch.manual_seed(0)
    mlp = _mlp(arch)
    x = torch.randn(3, 21, 32)  # 63 tokens: chunks that do not divide them, and one larger than all
    out, x_grad, grads = _run(mlp, x)
    c_out, c_x_grad, c_grads = _run(mlp, x, chunk_rows)
    assert rel(c_out, out) <= TOL and rel(c_x_grad, x_grad) <= TOL
    assert grads.keys() == c_grads.keys()
    assert max(rel(c_grads[n], grads[n]) for n in grads) <= TOL


def test_each_parameter_gets_one_gradient_per_backward():
    """The engine counts a streamed block's gradients by its per-parameter hooks: a parameter whose
    gradient were accumulated once per chunk (a nested backward per chunk) would be counted each time."""
    mlp = _mlp("llama")
    calls = {n: 0 for n, _ in mlp.named_parameters()}
    for name, param in mlp.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls[name] + 1))
    _run(mlp, torch.randn(2, 40, 32), chunk_rows=7)
    assert calls == {n: 1 for n in calls}


def test_forward_saves_only_the_input():
    """The point of it: the whole-sequence intermediates are not kept for backward, only the MLP's input."""
    mlp, x = _mlp("llama"), torch.randn(2, 64, 32, requires_grad=True)

    def saved_bytes(run) -> int:
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size() if t.requires_grad or not t.is_leaf else 0)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return sum(total)

    x_bytes = x.numel() * x.element_size()
    plain = saved_bytes(lambda: mlp(x))
    chunked = saved_bytes(lambda: ChunkedMLP.apply(mlp.forward, 16, x, *mlp.parameters()))
    assert chunked == x_bytes
    assert plain >= 4 * x_bytes, "gate, up, their product: each twice the input's width here (64 vs 32)"


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_installed_forward_chunks_long_calls_only_and_detaches():
    model = tiny_llama(2)
    plain = copy.deepcopy(model)
    blocks = dict(enumerate(model.model.layers))
    chunks = MlpChunks(blocks, chunk_tokens=8)
    chunks.attach()
    mlp = blocks[0].mlp
    mlp(torch.randn(1, 8, 32))
    assert chunks.chunked_calls == 0, "8 tokens: not longer than a chunk"
    batch = batches(1)[0]  # 2 x 16 tokens
    copied = copy.deepcopy(model)  # made while chunked
    loss = model(**batch).loss
    loss.backward()
    assert chunks.chunked_calls == 2, "one call per block"
    plain_loss = plain(**batch).loss
    plain_loss.backward()
    assert rel(loss.detach(), plain_loss.detach()) <= TOL
    assert relative_error(_grads(model), _grads(plain)) <= TOL
    # The copy chunks too, with its own weights: its gradients land in it, none in the original.
    before = _grads(model)
    copied(**batch).loss.backward()
    assert chunks.chunked_calls == 4
    assert relative_error(_grads(copied), _grads(plain)) <= TOL
    assert all(torch.equal(g, before[n]) for n, g in _grads(model).items())
    chunks.detach()
    assert "forward" not in mlp.__dict__ and mlp_chunks.FORWARD not in mlp.__dict__


def test_active_dropout_is_left_unchunked():
    model = tiny_gpt2(1)
    model.transformer.h[0].mlp.dropout.p = 0.1
    chunks = MlpChunks({0: model.transformer.h[0]}, chunk_tokens=4)
    chunks.attach()
    model.train()(**batches(1)[0]).loss.backward()
    assert chunks.chunked_calls == 0
    model.eval()(**batches(1)[0])
    assert chunks.chunked_calls == 1, "dropout off in eval: chunked"


def test_auto_chunks_only_calls_whose_intermediate_exceeds_a_gib():
    chunks = MlpChunks({}, chunk_tokens=None)
    width = 6912  # Llama h2560's MLP, bf16: 13824 bytes per token for one intermediate
    per_row = width * 2
    at_limit = mlp_chunks.AUTO_MIN_BYTES // per_row
    short = torch.empty(1, at_limit, 2560, dtype=torch.bfloat16, device="meta")
    long = torch.empty(1, 163840, 2560, dtype=torch.bfloat16, device="meta")
    assert chunks.rows_per_chunk(short, width) is None
    assert chunks.rows_per_chunk(long, width) == mlp_chunks.AUTO_CHUNK_BYTES // per_row == 19418
    def setting(value):
        section = parse_stronghold_section({"stronghold": {"mlp_chunk_tokens": value}})
        return resolve(section, torch.device("cpu")).mlp_chunk_tokens

    assert chunk_tokens_of(setting("auto"), offloading=False) == "off"
    assert chunk_tokens_of(setting("auto"), offloading=True) is None
    assert chunk_tokens_of(setting(False), offloading=True) == "off"
    assert chunk_tokens_of(setting(4096), offloading=False) == 4096


def test_config_key():
    assert parse_stronghold_section({}).mlp_chunk_tokens == "auto"
    assert parse_stronghold_section({"stronghold": {"mlp_chunk_tokens": 4096}}).mlp_chunk_tokens == 4096
    for bad in (True, 0, "all"):
        with pytest.raises(ValueError, match="stronghold.mlp_chunk_tokens"):
            parse_stronghold_section({"stronghold": {"mlp_chunk_tokens": bad}})


@pytest.mark.parametrize("checkpointing", [None, True, False])
def test_engine_trains_like_adamw_with_chunks_and_offload(checkpointing):
    """Streamed blocks (window 2, 1 resident of 4), activations offloaded, every MLP call chunked by 5
    tokens, with HF checkpointing off, reentrant and non-reentrant; clipping and accumulation on."""
    model, data = tiny_llama(4), batches(4)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    reference, _ = train_reference(model, data, lr=LR, gas=2, clip=0.1)
    engine, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=LR, gas=2, clip=0.1,
                                                        offload_activations=True, mlp_chunk_tokens=5))
    assert engine.stronghold_runtime.mlp_chunks.chunked_calls > 0
    assert relative_error(engine.module, reference) <= 1e-5


def test_chunks_wrap_a_kernel_patched_forward_when_put_back_after_it():
    """long_context.py applies the kernels after the chunks were installed at construction: it takes the chunks
    off, lets stronghold_ops replace the MLP's forward, and puts them back, so they wrap the kernel's forward.
    (Triton's CPU interpreter runs the SwiGLU kernel here.)"""
    import stronghold_ops

    model = tiny_llama(1)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 16, 32)
    expected = mlp(x)
    chunks = MlpChunks({0: model.model.layers[0]}, chunk_tokens=8)
    chunks.attach()
    chunks.detach()
    assert stronghold_ops.apply(model, kernels=["swiglu"]).patched == {"swiglu": ["model.layers.0.mlp"]}
    patched = mlp.__dict__["forward"]
    chunks.attach()
    out = mlp(x)
    assert chunks.chunked_calls == 1 and mlp.__dict__[mlp_chunks.FORWARD] is patched
    assert rel(out, expected) <= 1e-5, "fp32 SwiGLU kernel against HF's MLP, chunked"
    chunks.detach()
    assert mlp.__dict__["forward"] is patched
