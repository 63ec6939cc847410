"""GPU evidence for the engine (run on the device machine: `make test-gpu`)."""
import copy
import functools
import math
import os

import pytest
import torch
from torch import nn

from .helpers import (batches, ds_config, named_params, relative_error, run_steps, tiny_llama, train_reference,
                      train_stronghold)

pytestmark = pytest.mark.gpu


def _bf16_reference(model: nn.Module, data: list[dict], lr: float, clip: float,
                    optimizer_device: str, compiled: bool = False) -> dict[str, torch.Tensor]:
    """Plain PyTorch with stronghold's mixed precision: bf16 weights and compute, fp32 master AdamW
    (on `optimizer_device`: torch's CPU AdamW or its fused CUDA AdamW). `compiled`: each decoder layer's forward
    through one torch.compile of its class's forward, with the Inductor options stronghold uses (the reference for
    compiled blocks: Inductor's fused kernels round differently from eager's)."""
    model = copy.deepcopy(model).cuda()
    if compiled:
        from stronghold.integrations.compile import INDUCTOR_OPTIONS
        layers = model.model.layers
        function = torch.compile(type(layers[0]).forward, backend="inductor", options=INDUCTOR_OPTIONS)
        for layer in layers:
            layer.forward = functools.partial(function, layer)
    masters = {n: p.detach().float().to(optimizer_device).clone() for n, p in model.named_parameters()}
    for param in model.parameters():  # parameters only, as DeepSpeed's bf16 mode: buffers (rotary
        param.data = param.data.bfloat16()  # inv_freq) keep their precision
    model.train()
    opt = torch.optim.AdamW(list(masters.values()), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=optimizer_device == "cuda")
    params = dict(model.named_parameters())
    for batch in data:
        loss = model(**{k: v.cuda() for k, v in batch.items()}).loss
        loss.backward()
        for name, master in masters.items():
            master.grad = params[name].grad.float().to(optimizer_device)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, master in masters.items():
                params[name].copy_(master)
    return {n: m.cpu() for n, m in masters.items()}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[n] - b[n]).pow(2).sum()) for n in b)
    return (num / sum(float(t.pow(2).sum()) for t in b.values())) ** 0.5


def test_bf16_matches_the_mixed_precision_reference():
    """Tolerance, calibrated on the reference itself: the same bf16 training with the AdamW on the CPU
    instead of the GPU differs from it by some amount d (the two AdamWs round differently, ~1e-7 in the
    masters; a bf16 weight that lands on the other side of a rounding boundary then moves the next
    forward by one bf16 ulp, and training amplifies that). Stronghold runs its streamed blocks' AdamW
    on the CPU and the rest on the GPU, so it must land within a small multiple of d of the reference."""
    torch.manual_seed(0)
    model, data = tiny_llama(6), batches(5)
    want = _bf16_reference(model, data, lr=1e-3, clip=0.5, optimizer_device="cuda")
    noise = _distance(_bf16_reference(model, data, lr=1e-3, clip=0.5, optimizer_device="cpu"), want)
    engine, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=1e-3, clip=0.5, bf16=True,
                                                        compile=False))
    masters = engine.stronghold_runtime.master_params()
    got = {n: masters[id(p)].float().cpu() for n, p in engine.module.named_parameters()}
    engine.destroy()
    assert _distance(got, want) <= max(3 * noise, 1e-6), (_distance(got, want), noise)


class Thin(nn.Module):
    """A block with big weights and almost no arithmetic: a missing wait on its H2D shows up as wrong
    numbers, because the copy is still running when the (tiny) compute reads the slot."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return x + 0.01 * torch.tanh(self.proj(x))


class ThinModel(nn.Module):
    def __init__(self, width: int = 2048, depth: int = 8):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList([Thin(width) for _ in range(depth)])
        self.out = nn.Linear(width, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)

        class Out:
            loss = torch.nn.functional.mse_loss(self.out(h).squeeze(-1), y)

        return Out


def test_low_arithmetic_density_blocks_wait_for_their_copies():
    import stronghold
    torch.manual_seed(0)
    model = ThinModel()
    data = [{"x": torch.randn(2, 16), "y": torch.randn(2)} for _ in range(4)]
    reference = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for batch in data:
        reference(**{k: v.cuda() for k, v in batch.items()}).loss.backward()
        opt.step()
        opt.zero_grad()
    cfg = ds_config(window=2, resident=0, lr=1e-3)
    engine, _, _, _ = stronghold.initialize(model=model, config=cfg, blocks=model.blocks)
    run_steps(engine, data)
    error = relative_error(engine.module, reference)
    engine.destroy()
    assert error <= 1e-5


def test_streamed_memory_is_bounded_by_the_window():
    """Same window, 3x the depth: peak GPU memory grows by the per-layer activations only, far less
    than the streamed blocks' weights (16 blocks of 25 MB here) would add."""
    import gc

    from transformers import GPT2Config, GPT2LMHeadModel
    import stronghold
    growth = {}
    for layers in (8, 24):
        gc.collect()  # the previous engine's buffers (hooks and closures form reference cycles)
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model = GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=layers, n_head=8, n_positions=128, vocab_size=256))
        model.gradient_checkpointing_enable()
        engine, _, _, _ = stronghold.initialize(model=model, config=ds_config(window=3, resident=1, bf16=True))
        ids = torch.randint(0, 256, (2, 128), device="cuda")
        run_steps(engine, [{"input_ids": ids, "labels": ids}] * 2)
        torch.cuda.synchronize()
        growth[layers] = torch.cuda.max_memory_allocated() - baseline
        engine.destroy()
        del engine, model
    block_bytes = 12 * 1024 * 1024 * 2  # one streamed block's bf16 weights
    assert growth[24] - growth[8] < 8 * block_bytes, growth


def _capped_engine(cap_gb: float, section: dict, layers: int = 8, gas: int = 1, checkpointing: bool = False,
                   collect: bool = True):
    """A GPT-2 of `layers` blocks of 12.6 M parameters (201 MB each in fp32 with grads and moments)
    under a GPU cap, fp32 so that two placements can be compared to rounding. `collect`: a full collection and an
    empty cache first."""
    import gc

    from transformers import GPT2Config, GPT2LMHeadModel
    import stronghold
    if collect:
        gc.collect()
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=layers, n_head=8, n_positions=16, vocab_size=96))
    if checkpointing:
        from stronghold.integrations.hf_compat import enable_checkpointing
        enable_checkpointing(model)
    cfg = ds_config(lr=1e-4, clip=1.0, gas=gas)
    cfg["stronghold"] = {"kernels": False, "gpu_memory_limit_gb": cap_gb, **section}
    engine, _, _, _ = stronghold.initialize(model=model, config=cfg)
    return engine


@pytest.fixture
def uncap_after():
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)


def test_auto_placement_promotes_after_the_first_step_and_trains_the_same(uncap_after):
    """2.5 GiB: half held back for the first step's activations leaves room for few resident blocks;
    the measured activations (batch 2 x 16 tokens) are tiny, so after step 1 most blocks move to the
    GPU. Against the same run placed that way from the start: fp32, so only the first step's streamed
    updates (C AdamW instead of torch's) differ, by rounding (same bar as the equivalence tests)."""
    data = batches(4)
    engine = _capped_engine(2.5, {})
    runtime = engine.stronghold_runtime
    first = runtime.resident_count
    run_steps(engine, data)
    report = engine.stronghold_report()
    assert runtime.resident_count > first, report["placement"]
    assert report["placement"]["measured"]["activations_bytes"] < 256 * 2 ** 20
    # The steps after it, as placed, timed the blocks again and refreshed the prediction (prediction.py _refresh)
    # from their typical time (block_timer.typical).
    measured = report["placement"]["measured"]
    second, block_s = measured["rates_refreshed"], measured["block_s_after_placement"]
    from stronghold.planning.prediction import REFRESH_STEPS
    assert len(block_s) == REFRESH_STEPS and all(s > 0 for s in block_s)
    assert measured["host_rss_bytes_first_step"] > 0
    # What the first step's reserved peak rose from, and the reserved peak since, beside the allocated ones.
    assert 0 < measured["allocated_at_start_bytes"] <= measured["reserved_at_start_bytes"] <= measured[
        "peak_reserved_bytes"] <= measured["gpu_peak_reserved_bytes_now"]
    assert 0 <= measured["peak_inactive_split_bytes"] <= measured["peak_reserved_bytes"]
    by_stream = measured["reserved_by_stream"]  # the segments at the first step's end, by the stream they serve
    assert by_stream["compute"]["reserved"] > 0
    assert sum(v["reserved"] for v in by_stream.values()) <= measured["gpu_peak_reserved_bytes_now"]
    assert second["gpu_s_per_block"] > 0 and report["placement"]["plan"]["resident_blocks"] == runtime.resident_count
    assert second["gpu_adam_params_per_s"] > 0 and runtime.resident.timings is None  # timed, then no more events
    assert not runtime.placement._timer.handles  # the hooks are gone once the timed steps are done
    final = (runtime.resident_count, max(runtime.window_size, 2))
    trained = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    engine.destroy()
    del engine, runtime
    fixed = _capped_engine(2.5, {"resident_blocks": final[0], "window_size": final[1]})
    assert fixed.stronghold_runtime.placement.pending is False
    run_steps(fixed, data)
    placed = named_params(fixed.module)
    fixed.destroy()
    assert _distance(trained, placed) <= 1e-5


def test_a_checkpointed_model_is_placed_at_its_first_forward(uncap_after):
    """With checkpointing, the batch's activation estimate replaces the construction-time reserve at the first
    forward: the first step already runs with more blocks resident, and training equals the same run placed that
    way from the start (fp32: rounding only)."""
    data = batches(4)
    engine = _capped_engine(2.5, {}, checkpointing=True)
    runtime = engine.stronghold_runtime
    first = runtime.resident_count
    run_steps(engine, data[:1])
    measured = engine.stronghold_report()["placement"]["measured"]
    placed = measured["first_forward"]
    assert placed["resident_blocks"] > first, measured
    assert sum(placed["promote_parts_s"].values()) <= placed["promote_s"], "the parts are of the promotion"
    assert placed["plan_s"] > 0  # the estimate and the plan, before the promotion
    run_steps(engine, data[1:])
    final = (runtime.resident_count, max(runtime.window_size, 2))
    trained = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    engine.destroy()
    del engine, runtime
    fixed = _capped_engine(2.5, {"resident_blocks": final[0], "window_size": final[1]}, checkpointing=True)
    run_steps(fixed, data)
    placed = named_params(fixed.module)
    fixed.destroy()
    assert _distance(trained, placed) <= 1e-5


def test_a_placement_that_cannot_fit_fails_before_allocating(uncap_after):
    with pytest.raises(MemoryError, match="does not fit the GPU.*resident_blocks=8 needs"):
        _capped_engine(1.0, {"resident_blocks": 8})


def test_an_engine_dropped_without_destroy_gives_its_gpu_memory_back(uncap_after):
    """A sweep that drops each engine without destroy(): building the next one frees the last first
    (engine/collector.py free_dropped_engines), so the next engine is built as the first was, on the memory the
    process held before it; the first holds far more than the difference (which is the cuBLAS workspace its steps
    made, and the allocator's rounding)."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    engine = _capped_engine(2.5, {}, gas=2)
    built, resident = torch.cuda.memory_allocated() - before, engine.stronghold_runtime.resident_count
    run_steps(engine, batches(4))
    held = torch.cuda.memory_allocated() - before
    del engine
    following = _capped_engine(2.5, {}, gas=2, collect=False)
    again = torch.cuda.memory_allocated() - before
    assert following.stronghold_runtime.resident_count == resident
    following.destroy()
    assert held > 2 ** 28 and again - built < 2 ** 26, (built, held, again)


def test_main_job_trains_on_the_gpu(tmp_path):
    """`make train`'s job with the shipped GPU config and no knobs: it logs `stronghold_report()` every
    step, which once broke the first step's placement measurements (KeyError at the first step). Its output
    directory holds a metrics line per step with the GPU's fields and the final checkpoint."""
    import json
    import math
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "train.jsonl"
    # A fresh process as `make train` starts it: without this test process's launcher variables, whose
    # MASTER_PORT the process group here still listens on (EADDRINUSE in the child otherwise).
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "examples/train.py", "--deepspeed_config", "ds_configs/stronghold.json",
                           "--size", "tiny", "--steps", "4", "--json", str(out), "--output-dir", str(tmp_path / "run")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text().splitlines()[-1])
    assert summary["steps"] == 4 and not summary["device"].startswith("cpu")  # the GPU's name on a GPU
    assert all(map(math.isfinite, (summary["first_loss"], summary["last_loss"])))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["peak_gpu_GB"] > 0 and m["tflops"] > 0 for m in metrics)
    assert (tmp_path / "run" / "checkpoint" / "latest").read_text().strip() == "global_step4"


def test_activation_offload_on_the_gpu_trains_the_same_with_less_memory():
    """offload_activations on CUDA streams: the checkpointed block inputs go to pinned host memory and
    come back for backward. Same fp32 run with and without: a missed wait on a copy would read a freed
    or half-written input (garbage or NaN, far above the bound); what may differ is only run-to-run
    rounding of the GPU kernels (eager attention, so no atomics in its backward: ~1e-7), hence 1e-6.
    Memory: 8 blocks at batch 4 x 1024 tokens x 1024 wide hold 16 MiB of input each; offloading 7 of
    them (2 come back at once in backward) must lower the peak by at least 3 of those inputs."""
    import gc

    from transformers import GPT2Config, GPT2LMHeadModel
    import stronghold
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=8, n_head=8, n_positions=1024, vocab_size=256,
                                      attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (3, 4, 1024))]
    runs = {}
    for offload in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        cfg = ds_config(window=3, resident=1, lr=1e-4, clip=1.0, offload_activations=offload)
        engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(base), config=cfg)
        torch.cuda.reset_peak_memory_stats()
        losses = run_steps(engine, data)
        peak = torch.cuda.max_memory_allocated()
        params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
        report = engine.stronghold_report()
        engine.destroy()
        del engine
        runs[offload] = (losses, peak, params, report)
    assert runs[True][3]["activations"]["d2h_bytes_per_step"] > 0
    assert _distance(runs[True][2], runs[False][2]) <= 1e-6
    block_input = 4 * 1024 * 1024 * 4  # fp32 hidden state of one block
    assert runs[False][1] - runs[True][1] >= 3 * block_input, (runs[False][1], runs[True][1])


def test_long_batch_under_auto_offloads_chunks_and_trains_like_offload_off(monkeypatch):
    """offload_activations "auto" on CUDA (long_context.py), with the share lowered so that a small model's
    batch counts as long: the first training forward installs the offload (every block but the last),
    chunked MLPs (every call: the chunk size is set here) and the long-context kernels, and training
    matches the same run with offload off. The kernels differ between the two runs (Triton's dots may run
    in TF32, ~1e-3 relative each, amplified by Adam's normalisation over 3 steps), so the bound is 1e-2,
    not the offload test's 1e-6; a wrong wait or a lost chunk gives O(1)."""
    import gc

    from stronghold.memory import long_context
    import stronghold
    # The tiny batch's block inputs (4 blocks x 32 tokens x 32 x 4 bytes = 16 KiB) must exceed the share of an
    # 80-141 GiB budget: 1e-6 of it (~84 KiB) did not, 1e-9 (~84 bytes) does.
    monkeypatch.setattr(long_context, "AUTO_OFFLOAD_SHARE", 1e-9)
    torch.manual_seed(0)
    base = tiny_llama(4)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = batches(3)
    runs = {}
    for offload in ("auto", False):
        gc.collect()
        torch.cuda.empty_cache()
        section = {"offload_activations": offload, "mlp_chunk_tokens": 5 if offload == "auto" else False}
        cfg = ds_config(window=2, resident=1, lr=1e-3, clip=1.0, **section)
        cfg["stronghold"].pop("kernels")  # the default, "auto"
        engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(base), config=cfg)
        losses = run_steps(engine, data)
        params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
        report = engine.stronghold_report()
        chunked = engine.stronghold_runtime.mlp_chunks
        engine.destroy()
        runs[offload] = (losses, params, report, chunked)
    losses, params, report, chunked = runs["auto"]
    assert report["long_context"]["long_context"] and report["activations"]["d2h_bytes_per_step"] > 0
    assert any(item.startswith("kernels") for item in report["long_context"]["enabled"])
    assert chunked is not None and chunked.chunked_calls > 0
    assert all(map(math.isfinite, losses))
    assert _distance(params, runs[False][1]) <= 1e-2


def test_large_logits_under_auto_kernels_get_the_fused_head_and_train_like_without(monkeypatch):
    """kernels "auto" on CUDA (long_context.py): with the share lowered so that a small model's logits count as
    large, the first training forward patches the fused linear + cross-entropy head in (and nothing else), and
    training matches the same run with kernels off within the Triton kernels' tolerance (see the test above)."""
    import gc

    from stronghold.memory import long_context
    import stronghold
    monkeypatch.setattr(long_context, "FUSED_HEAD_SHARE", 1e-9)
    torch.manual_seed(0)
    base = tiny_llama(4)
    data = batches(3)
    runs = {}
    for kernels in ("auto", False):
        gc.collect()
        torch.cuda.empty_cache()
        cfg = ds_config(window=2, resident=1, lr=1e-3, clip=1.0, offload_activations=False, kernels=kernels)
        engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(base), config=cfg)
        losses = run_steps(engine, data)
        params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
        report = engine.stronghold_report()
        engine.destroy()
        runs[kernels] = (losses, params, report)
    losses, params, report = runs["auto"]
    assert report["long_context"]["fused_head"] == ["fused_linear_cross_entropy"]
    assert not report["long_context"]["long_context"] and "long_context" not in runs[False][2]  # nothing to decide
    assert all(map(math.isfinite, losses))
    assert _distance(params, runs[False][1]) <= 1e-2


def test_lean_blocks_and_registered_host_buffers_on_cuda():
    """The lean tier on a GPU (gradients D2H'd into the working copy the next H2D reads): bit-identical to
    buffered blocks with clipping that holds every step (both defer every update, tests/engine/test_lean.py);
    the streamed blocks' host buffers large enough for pinned.py are page-locked by cudaHostRegister."""
    from stronghold.streaming import pinned
    torch.manual_seed(0)
    model, data = tiny_llama(4), batches(4)
    runs = {}
    for lean in (2, 0):
        engine, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=1e-3, clip=1e-4, bf16=True,
                                                            lean_blocks=lean))
        masters = engine.stronghold_runtime.master_params()
        runs[lean] = {n: masters[id(p)].float().cpu() for n, p in engine.module.named_parameters()}
        assert engine.stronghold_report()["lean_blocks"] == lean
        engine.destroy()
    for name in runs[0]:
        assert torch.equal(runs[2][name], runs[0][name]), name
    big = pinned.pinned_empty(pinned.EXACT_MIN_BYTES, torch.uint8)
    assert big.is_pinned()
    device = torch.empty(big.numel(), dtype=torch.uint8, device="cuda")
    big.fill_(7)
    device.copy_(big, non_blocking=True)
    torch.cuda.synchronize()
    assert int(device.sum()) == 7 * big.numel()


def test_gpu_accumulation_on_cuda_is_bit_identical_to_host_accumulation():
    """Accumulation 4, bf16, no clipping: the streamed gradients summed on the GPU (device_accum.py) and sent
    down once per step give the same masters, bit for bit, as the host path's fp32 sums of the per-micro-step
    gradients (same additions, same order, tests/engine/test_gpu_accumulation.py); and the D2H volume is one
    fp32 sum per step instead of four bf16 gradients."""
    torch.manual_seed(0)
    model, data = tiny_llama(4), batches(8)
    runs, d2h = {}, {}
    for on_gpu in (True, False):
        engine, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=1e-3, gas=4, bf16=True,
                                                            gpu_accumulation=on_gpu))
        masters = engine.stronghold_runtime.master_params()
        runs[on_gpu] = {n: masters[id(p)].float().cpu() for n, p in engine.module.named_parameters()}
        report = engine.stronghold_report()
        assert report["gpu_accumulation"] is on_gpu
        d2h[on_gpu] = report["d2h_bytes_per_step"]
        engine.destroy()
    for name in runs[False]:
        assert torch.equal(runs[True][name], runs[False][name]), name
    assert d2h[True] * 2 == d2h[False]  # 4 bytes once against 2 bytes four times


def test_auto_gpu_accumulation_after_the_first_step_trains_like_that_placement_from_the_start(uncap_after):
    """Accumulation 4 under "auto": the first step accumulates on the host (the start-up plan's activation
    reserve leaves no room for accumulators), and after it the measured plan may move the accumulation to the
    GPU (device_accum.switch_to_gpu) along with promoting blocks. Whatever it chose, the report says it, and
    the run equals the same placement set by hand from the start (fp32: 1e-5, as the promotion test)."""
    data = batches(8)
    engine = _capped_engine(2.5, {}, layers=16, gas=4)
    runtime = engine.stronghold_runtime
    assert runtime.device_accum is None
    run_steps(engine, data)
    report = engine.stronghold_report()
    chosen = report["placement"]["plan"]["gpu_accumulation"]
    print(f"auto chose gpu_accumulation={chosen}, resident {runtime.resident_count}, window {runtime.window_size}")
    assert report["gpu_accumulation"] is (chosen and bool(runtime.stores))
    final = {"resident_blocks": runtime.resident_count, "window_size": max(runtime.window_size, 2),
             "gpu_accumulation": bool(chosen and runtime.stores)}
    trained = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    engine.destroy()
    del engine, runtime
    fixed = _capped_engine(2.5, final, layers=16, gas=4)
    run_steps(fixed, data)
    placed = named_params(fixed.module)
    fixed.destroy()
    assert _distance(trained, placed) <= 1e-5


class ThinWithBigRest(ThinModel):
    """ThinModel whose parts outside the blocks are large (an input projection of 4.2 M parameters, 17 MB in fp32)
    and cheap to compute: a forward that did not wait for a cached part's copy would read it half written."""

    def __init__(self, width: int = 2048):
        super().__init__(width)
        self.inp = nn.Sequential(nn.Linear(16, width), nn.Linear(width, width))


def test_cached_parts_on_cuda_wait_for_their_copies():
    """"rest_placement": "host" on the GPU, fp32, accumulation 2, clipping that triggers: the input and output
    parts are updated by the CPU AdamW and copied back before each forward; against plain PyTorch at 1e-5."""
    import stronghold
    torch.manual_seed(0)
    model = ThinWithBigRest()
    data = [{"x": torch.randn(2, 16), "y": torch.randn(2)} for _ in range(8)]
    reference = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for i, batch in enumerate(data):
        (reference(**{k: v.cuda() for k, v in batch.items()}).loss / 2).backward()
        if i % 2:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
    cfg = ds_config(window=2, resident=0, lr=1e-3, gas=2, clip=0.05, rest_placement="host")
    engine, _, _, _ = stronghold.initialize(model=model, config=cfg, blocks=model.blocks)
    assert engine.stronghold_runtime.cached_parts == {"input", "output"}
    run_steps(engine, data)
    error = relative_error(engine.module, reference)
    engine.destroy()
    assert error <= 1e-5


def test_cached_parts_bf16_match_the_mixed_precision_reference():
    """As test_bf16_matches_the_mixed_precision_reference, with the embeddings and head in the cached tier."""
    torch.manual_seed(0)
    model, data = tiny_llama(6), batches(5)
    want = _bf16_reference(model, data, lr=1e-3, clip=0.5, optimizer_device="cuda")
    noise = _distance(_bf16_reference(model, data, lr=1e-3, clip=0.5, optimizer_device="cpu"), want)
    engine, _ = train_stronghold(model, data, ds_config(window=2, resident=1, lr=1e-3, clip=0.5, bf16=True,
                                                        rest_placement="host", compile=False))
    assert engine.stronghold_runtime.cached_parts == {"input", "output"}
    masters = engine.stronghold_runtime.master_params()
    got = {n: masters[id(p)].float().cpu() for n, p in engine.module.named_parameters()}
    engine.destroy()
    assert _distance(got, want) <= max(3 * noise, 1e-6), (_distance(got, want), noise)


def test_the_gpu_budget_is_the_process_memory_fraction(uncap_after):
    from stronghold.config import parse_stronghold_section, resolve
    from stronghold.planning import plan_inputs
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25, device)
    budget = plan_inputs.budgets(tiny_llama(2), resolve(parse_stronghold_section({}), device), device)
    assert budget.gpu_bytes <= 0.25 * total


def test_steps_with_no_synchronization_between_micro_steps_train_like_adamw():
    """stronghold.initialize leaves DeepSpeed's throughput timer unsynchronized (engine/launch.py), so nothing waits for
    the whole device between micro-steps: the window's copies, the gradients' D2H and the CPU's updates run on across
    their boundaries. Ten optimizer steps of two micro-batches, a clipping threshold the norm stays under (the updates
    then run early, beside the backward: optim/speculation.py), no loss read before the end: fp32 equals torch AdamW on
    the GPU at the CPU tests' bar."""
    import stronghold
    model, data = tiny_llama(4), batches(20)
    reference, _ = train_reference(copy.deepcopy(model).cuda(), [{k: v.cuda() for k, v in b.items()} for b in data],
                                   lr=1e-3, gas=2, clip=100.0)
    engine, *_ = stronghold.initialize(model=copy.deepcopy(model),
                                       config=ds_config(window=2, resident=0, gas=2, clip=100.0, lr=1e-3))
    assert not engine.tput_timer.config.synchronized
    losses = []
    for batch in data:
        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    engine.synchronize_host()
    stats, streamed = engine.stronghold_runtime.cpu.stats, len(engine.stronghold_runtime.stores)
    assert streamed == 4 and stats.deferred_blocks < streamed * len(data) // 2, "no update ran early"
    assert all(math.isfinite(float(loss)) for loss in losses)
    error = relative_error(engine.module, reference)
    engine.destroy()
    assert error <= 1e-5
