"""GPU previews (gpu_preview.py): every other streamed block's next weights computed by stronghold_ops' adamw_preview
kernel from its state copied up, beside the CPU's previews of the others. The kernel's weights are the CPU kernel's,
bit for bit (same operations, each rounded once), so a run with GPU previews is bit-identical to one without (masters
and module weights, torch.equal). On the CPU the same code runs the kernel in Triton's interpreter."""
import copy

import pytest
import torch

import stronghold
from stronghold.cpu_adam import AdamWCoeffs, load_kernel
from stronghold.gpu_preview import GpuPreviews
from stronghold.pinned import pageable_empty

from .helpers import batches, ds_config, run_steps, tiny_gpt2, tiny_llama
from .test_weights_first import _assert_identical, _train



@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step,scale", [(1, 1.0), (7, 0.37), (1000, 2.0 ** -12)])
def test_the_kernel_writes_the_cpu_kernels_weights_bit_for_bit(out_dtype, step, scale):
    import triton

    from stronghold_ops.kernels.adamw_preview import adamw_preview
    torch.manual_seed(step)
    n = 5000
    p, g = torch.randn(n), torch.randn(n) * 3e-2
    m = torch.zeros(n) if step == 1 else torch.randn(n) * 1e-2
    v = torch.zeros(n) if step == 1 else torch.rand(n) * 1e-4
    coeffs = AdamWCoeffs(3e-3, 0.9, 0.95, 1e-8, 0.1, step)
    c = coeffs.as_struct()
    cpu, gpu = torch.empty(n, dtype=out_dtype), torch.empty(n, dtype=out_dtype)
    load_kernel().preview(p, m, v, g, cpu, coeffs, scale)
    adamw_preview[(triton.cdiv(n, 1024),)](p, m, v, g, gpu, n, scale, c.decay, c.w1, c.beta2, c.omb2, c.neg_step_size,
                                           c.bc2_sqrt, c.eps, BLOCK=1024, enable_fp_fusion=False)
    assert torch.equal(cpu.view(torch.int16), gpu.view(torch.int16))


def _engine(model, **cfg):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        lr=3e-3, window=2, resident=1, bf16=True, clip=1e-4, weights_first=True, **cfg))
    return engine


@pytest.mark.parametrize("make,gpu_accumulation", [(tiny_llama, False), (tiny_gpt2, False), (tiny_llama, True)])
def test_a_run_with_gpu_previews_is_bit_identical_to_one_without(make, gpu_accumulation):
    model, data = make(5), batches(8)
    runs = [_engine(model, gas=2, gpu_previews=on, gpu_accumulation=gpu_accumulation) for on in (True, False)]
    for engine in runs:
        _train(engine, data)
    _assert_identical(*runs)
    on, off = (engine.stronghold_runtime.cpu.stats for engine in runs)
    # 4 streamed blocks, 4 steps: the 2nd and 4th go to the GPU (on the CPU from the first step: nothing to lock).
    assert on.gpu_preview_blocks == 2 * 4 and on.weights_first_blocks == off.weights_first_blocks > on.gpu_preview_blocks
    assert off.gpu_preview_blocks == 0 and runs[1].stronghold_runtime.cpu.gpu_previews is None
    assert runs[0].stronghold_report()["overlap"]["gpu_preview_blocks_per_step"] > 0
    for engine in runs:
        engine.destroy()


def test_gpu_previews_need_a_working_copy():
    with pytest.raises(ValueError, match=r"gpu_previews.*bf16 or fp16.*\"auto\" or false"):
        stronghold.initialize(model=tiny_llama(3), config=ds_config(lr=1e-3, window=2, resident=1, gpu_previews=True))


def test_auto_is_off_on_the_cpu():
    engine, _, _, _ = stronghold.initialize(model=tiny_llama(3), config=ds_config(lr=1e-3, window=2, resident=1,
                                                                                   bf16=True))
    assert engine.stronghold_runtime.cpu.gpu_previews is None
    engine.destroy()


class _FakeStore:
    def __init__(self, index, numel=2 ** 20):
        self.index, self.lean, self.sharded, self.trainable_numel = index, False, False, numel
        self.master, self.exp_avg, self.exp_avg_sq = (pageable_empty(numel, torch.float32) for _ in range(3))
        self.working = torch.empty(numel, dtype=torch.bfloat16)
        self.accum, self.grad = None, torch.empty(numel)


def test_page_locking_pairs_every_register_with_an_unregister():
    """On a GPU the chosen blocks' state is registered in place; a failed registration leaves the block with the CPU
    and unregisters what it had registered; release unregisters all three."""
    calls = []
    fail_at = {"n": None}

    def register(ptr, nbytes):
        calls.append(("reg", ptr))
        return 1 if len(calls) == fail_at["n"] else 0

    stores = {i: _FakeStore(i) for i in range(4)}
    previews = GpuPreviews(torch.device("cpu"), stores, register=register,
                           unregister=lambda ptr: calls.append(("unreg", ptr)))
    previews.cuda = True  # the registration path; nothing is copied here
    locked = previews._lock(stores[1])
    assert [c[1] for c in calls] == [t.data_ptr() for t in locked] and len(locked) == 3
    previews.blocks[1] = locked
    del stores[1]
    previews.prune()
    assert 1 not in previews.blocks and [c for c in calls if c[0] == "unreg"] == [("unreg", t.data_ptr()) for t in locked]
    calls.clear()
    fail_at["n"] = 2
    assert previews._lock(stores[3]) is None
    assert calls == [("reg", stores[3].master.data_ptr()), ("reg", stores[3].exp_avg.data_ptr()),
                     ("unreg", stores[3].master.data_ptr())]
    previews.close()


@pytest.mark.gpu
def test_on_cuda_the_kernel_writes_the_cpu_kernels_weights_bit_for_bit():
    """The GPU's approximate division and square root, or a fused multiply-add, would show here."""
    import triton

    from stronghold_ops.kernels.adamw_preview import adamw_preview
    torch.manual_seed(0)
    n = 3 * 2 ** 20 + 17
    p, m, g = torch.randn(n), torch.randn(n) * 1e-2, torch.randn(n) * 3e-2
    v = torch.rand(n) * 1e-4
    coeffs = AdamWCoeffs(3e-3, 0.9, 0.95, 1e-8, 0.1, 7)
    c = coeffs.as_struct()
    cpu, gpu = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    load_kernel().preview(p, m, v, g, cpu, coeffs, 0.37)
    p_, m_, v_, g_ = (t.cuda() for t in (p, m, v, g))
    adamw_preview[(triton.cdiv(n, 1024),)](p_, m_, v_, g_, gpu, n, 0.37, c.decay, c.w1, c.beta2, c.omb2,
                                           c.neg_step_size, c.bc2_sqrt, c.eps, BLOCK=1024, enable_fp_fusion=False)
    assert torch.equal(cpu.view(torch.int16), gpu.cpu().view(torch.int16))


@pytest.mark.gpu
def test_on_cuda_a_run_with_gpu_previews_is_bit_identical_to_one_without(monkeypatch):
    """Blocks of 4.2 M parameters (five chunks of a 1 Mi-element ring each), 4 steps of accumulation 2, clipped every step: the
    page-locked state, the ring's reuse and the second pass's wait for the copies up all take part."""
    from stronghold import gpu_preview

    from .test_gpu import ThinModel
    monkeypatch.setattr(gpu_preview, "CHUNK_NUMEL", 2 ** 20)
    torch.manual_seed(0)
    model = ThinModel(depth=6)
    data = [{"x": torch.randn(2, 16, dtype=torch.bfloat16), "y": torch.randn(2, dtype=torch.bfloat16)}
            for _ in range(8)]
    runs = []
    for on in (True, False):
        m = copy.deepcopy(model)
        engine, _, _, _ = stronghold.initialize(model=m, blocks=m.blocks, config=ds_config(
            window=2, resident=1, lr=1e-3, gas=2, clip=1e-4, bf16=True, weights_first=True, gpu_previews=on))
        run_steps(engine, data)
        runs.append(engine)
    _assert_identical(*runs)
    stats = runs[0].stronghold_runtime.cpu.stats
    # 5 streamed blocks, 2 of them previewed on the GPU from the second step on (the first locks them).
    assert stats.gpu_preview_blocks == 2 * 3, stats
    assert sorted(runs[0].stronghold_runtime.cpu.gpu_previews.blocks) == [2, 4]
    for engine in runs:
        engine.destroy()
