"""Benchmark stronghold_ops on a GPU: each kernel's forward + backward against eager PyTorch, against
`torch.compile` of the eager reference and (when it imports) Liger-Kernel, in bf16 at LLM shapes; then
one end-to-end training step of a ~1B Llama with and without `stronghold_ops.apply`.

    python3 -m examples.bench.kernels_micro --out results/kernels            # everything
    python3 -m examples.bench.kernels_micro --only rms_norm,rope --skip-e2e  # a subset

Writes <out>/kernels.jsonl (one line per kernel and implementation), <out>/e2e.jsonl and
<out>/kernels.md (tables, with each target marked met or missed). Every line carries the commit, the
device, the date and the configuration. Times are medians of `triton.testing.do_bench` (which flushes
the L2 cache between runs); memory is the peak allocated during one forward + backward beyond the
inputs already resident. `--smoke` runs tiny shapes (CPU with TRITON_INTERPRET=1 works) to check the
script itself; its numbers mean nothing.
"""
import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file, not with -m: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import stronghold_ops as ops  # noqa: E402
from stronghold_ops import norm  # noqa: E402
from stronghold_ops.linear_cross_entropy import shifted_targets  # noqa: E402

from examples.bench.kernels_micro_report import write_markdown  # noqa: E402

FULL = dict(batch=4, seq=2048, hidden=4096, intermediate=11008, heads=32, kv_heads=8, head_dim=128,
            vocabs=(32000, 128256))
SMOKE = dict(batch=2, seq=16, hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, vocabs=(300, 500))
E2E_FULL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, batch=4, seq=2048)
E2E_SMOKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, batch=2, seq=16)


# Launch settings of the norm kernels timed by --sweep-norms (module attributes of stronghold_ops.norm,
# overridden in this process only). The default is timed first and again last: the spread between the
# two is the noise floor for comparing the others.
NORM_VARIANTS = {
    "default": {},
    "fused bwd, 1/SM": {"_FUSED_BACKWARD": True, "_FUSED_PROGRAMS_PER_SM": 1},
    "fused bwd, 2/SM": {"_FUSED_BACKWARD": True, "_FUSED_PROGRAMS_PER_SM": 2},
    "fused bwd, 4/SM": {"_FUSED_BACKWARD": True, "_FUSED_PROGRAMS_PER_SM": 4},
    "fused bwd, 2/SM, 2 rows/program": {"_FUSED_BACKWARD": True, "_FUSED_PROGRAMS_PER_SM": 2, "_ROW_ELEMENTS": 8192},
    "separate bwd": {"_FUSED_BACKWARD": False},
    "separate bwd, 2 rows/program": {"_FUSED_BACKWARD": False, "_ROW_ELEMENTS": 8192},
    "default (again)": {},
}


@contextlib.contextmanager
def norm_variant(overrides):
    """Run the norm kernels with other launch settings (this process only; restored on exit)."""
    saved = {name: getattr(norm, name) for name in overrides}
    for name, value in overrides.items():
        setattr(norm, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(norm, name, value)


def liger_functions():
    """Liger-Kernel's functional ops by our kernel names, or {} when it does not import."""
    try:
        import liger_kernel.functional as lf
    except Exception as exc:  # missing or broken install: the column is left out
        print(f"liger-kernel unavailable: {type(exc).__name__}: {exc}", flush=True)
        return {}
    return {
        "rms_norm": lambda x, w: lf.rms_norm(x, w, 1e-6),
        "layer_norm": lambda x, w, b: lf.layer_norm(x, w, b, 1e-5),
        "swiglu": lf.swiglu,
        "rope": lf.rope,
        "linear_ce": lambda h, w, labels: lf.fused_linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), w, shifted_targets(labels).reshape(-1))[0],
    }


def kernel_cases(cfg, device, dtype):
    """(name, shape text, inputs, ours, reference). Inputs requiring grad are the ones differentiated."""
    tokens, hidden, inter = cfg["batch"] * cfg["seq"], cfg["hidden"], cfg["intermediate"]

    def leaf(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device=device, dtype=dtype) * scale + shift).requires_grad_()

    # Linear-CE first: it carries the memory and time targets, so a run cut short still has it.
    for vocab in cfg["vocabs"]:
        def ce_inputs(vocab=vocab):
            labels = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), device=device)
            return [leaf(cfg["batch"], cfg["seq"], hidden), leaf(vocab, hidden, scale=hidden ** -0.5), labels]

        yield (f"linear_ce_{vocab}", f"h[{tokens},{hidden}] W[{vocab},{hidden}]", ce_inputs,
               ops.fused_linear_cross_entropy, ops.linear_cross_entropy_reference)
    yield ("rms_norm", f"x[{tokens},{hidden}]", lambda: [leaf(tokens, hidden), leaf(hidden, scale=0.1, shift=1)],
           lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: ops.rms_norm_reference(x, w, 1e-6))
    yield ("layer_norm", f"x[{tokens},{hidden}]",
           lambda: [leaf(tokens, hidden), leaf(hidden, scale=0.1, shift=1), leaf(hidden, scale=0.1)],
           lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), lambda x, w, b: ops.layer_norm_reference(x, w, b, 1e-5))
    yield ("swiglu", f"gate,up[{tokens},{inter}]", lambda: [leaf(tokens, inter), leaf(tokens, inter)],
           ops.swiglu, ops.swiglu_reference)
    yield ("gelu_tanh", f"x[{tokens},{inter}]+bias", lambda: [leaf(tokens, inter, scale=2), leaf(inter)],
           ops.gelu_tanh, ops.gelu_tanh_reference)

    def rope_inputs():
        b, s, d = cfg["batch"], cfg["seq"], cfg["head_dim"]
        # As HF passes them: projections viewed [b, s, heads, d] and transposed (non-contiguous).
        q = leaf(b, s, cfg["heads"], d).transpose(1, 2)
        k = leaf(b, s, cfg["kv_heads"], d).transpose(1, 2)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        freqs = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        return [q, k, emb.cos().to(dtype), emb.sin().to(dtype)]

    yield ("rope", f"q[{cfg['batch']},{cfg['heads']},{cfg['seq']},{cfg['head_dim']}] k[..{cfg['kv_heads']}..]",
           rope_inputs, ops.rope, ops.rope_reference)


def make_step(fn, inputs, upstream_cache):
    """Closure running fn forward and backward to every input that requires grad."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if "upstream" not in upstream_cache:
            upstream_cache["upstream"] = [torch.randn_like(o) if o.dim() else None for o in outs]
        return list(outs) + list(torch.autograd.grad(outs, leaves, upstream_cache["upstream"]))

    return step


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("inf")


def measure(step, device):
    """(median ms, peak extra MB) of one forward + backward, after warm-up."""
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        import triton.testing

        return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"), peak_mb
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3, float("nan")


def _emit(out_dir, row, name="kernels.jsonl"):
    """Print one result row and append it to <out_dir>/<name>."""
    print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, name), "a") as f:
        f.write(json.dumps(row) + "\n")


def run_kernels(args, cfg, device, meta, liger):
    dtype = torch.bfloat16
    for name, shape, make_inputs, ours, reference in kernel_cases(cfg, device, dtype):
        if args.only and name not in args.only and name.rsplit("_", 1)[0] not in args.only:
            continue
        if time.monotonic() > args.deadline:
            print(f"deadline reached, skipping {name}", flush=True)
            continue
        torch.manual_seed(0)
        inputs = make_inputs()
        leaves_fp32 = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                       for t in inputs]
        upstream = {}
        impls = {"stronghold_ops": ours, "eager": reference}
        if not args.no_compile:
            impls["torch_compile"] = torch.compile(reference, dynamic=False)
        liger_key = "linear_ce" if name.startswith("linear_ce") else name
        if liger_key in liger:
            impls["liger"] = liger[liger_key]
        gold = None
        for impl, fn in impls.items():
            row = dict(meta, kind="kernel", kernel=name, shape=shape, dtype="bfloat16", impl=impl)
            try:
                step = make_step(fn, inputs, upstream)
                results = step()
                if gold is None:  # the fp32 reference, with the same upstream gradients
                    gold_up = [u.float() if u is not None else None for u in upstream["upstream"]]
                    gold = make_step(reference, leaves_fp32, {"upstream": gold_up})()
                row["max_rel_err_vs_fp32"] = max(rel_err(r, g) for r, g in zip(results, gold))
                del results
                row["ms"], row["peak_mb"] = measure(step, device)
            except Exception as exc:  # one failing implementation must not lose the others' numbers
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            _emit(args.out, row)
        if args.sweep_norms and name in ("rms_norm", "layer_norm"):
            sweep_norm(args, name, shape, inputs, upstream, gold, ours, reference, device, meta)
        del inputs, leaves_fp32, gold, upstream, impls
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, dy):
        return dy * 1


def device_and_host_time(step):
    """(ms of device work alone: replays of a CUDA graph of the step; ms of host work per call: launches
    queued behind a long device sleep, so the host never waits). When the host's time is near or over
    the device's, do_bench's number is the launch overhead, not the kernels."""
    import triton.testing

    try:
        graph_ms = triton.testing.do_bench_cudagraph(step, rep=100, return_mode="median")
    except Exception as exc:  # capture can fail (e.g. a sync inside); keep the other numbers
        print(f"graph capture failed: {type(exc).__name__}: {exc}", flush=True)
        graph_ms = float("nan")
    torch.cuda.synchronize()
    calls = 50
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time, far longer than queuing the calls takes
    start = time.perf_counter()
    for _ in range(calls):
        step()
    host_ms = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    return graph_ms, host_ms


def sweep_norm(args, name, shape, inputs, upstream, gold, ours, reference, device, meta):
    """Each NORM_VARIANTS setting (forward + backward), then the forward alone for ours and eager, so
    the backward's share is the difference."""
    def record(impl, step, check):
        row = dict(meta, kind="variant", kernel=name, shape=shape, dtype="bfloat16", impl=impl)
        if check:
            row["max_rel_err_vs_fp32"] = max(rel_err(r, g) for r, g in zip(step(), gold))
        row["ms"], row["peak_mb"] = measure(step, device)
        if device.type == "cuda":
            row["graph_ms"], row["host_ms"] = device_and_host_time(step)
        _emit(args.out, row)

    for variant, overrides in NORM_VARIANTS.items():
        with norm_variant(overrides):
            record(variant, make_step(ours, inputs, upstream), check=True)
    record("eager (forward + backward)", make_step(reference, inputs, upstream), check=True)
    # The host cost any Python autograd.Function pays, whatever its kernels: x * 1 both ways.
    record("identity autograd.Function (host floor)", make_step(_Identity.apply, inputs[:1], {}), check=False)
    for impl, fn in (("forward only: stronghold_ops", ours), ("forward only: eager", reference)):
        def forward(fn=fn):
            with torch.no_grad():
                return fn(*inputs)
        record(impl, forward, check=False)


def run_e2e(args, cfg, device, meta):
    """One training step (forward, backward, AdamW) of a Llama-style model, HF vs patched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_cfg = {k: v for k, v in cfg.items() if k not in ("batch", "seq")}
    config = LlamaConfig(**model_cfg, max_position_embeddings=cfg["seq"], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    ids = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]), device=device)
    with torch.no_grad():
        loss_hf = model(input_ids=ids, labels=ids).loss.float().item()
        ops.apply(model)
        loss_ops = model(input_ids=ids, labels=ids).loss.float().item()
        ops.unapply(model)

    def train_step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for mode in ("hf", "stronghold_ops"):
        report = ops.apply(model) if mode == "stronghold_ops" else None
        row = dict(meta, kind="e2e", mode=mode, params=params, config=cfg, tokens=cfg["batch"] * cfg["seq"],
                   loss_hf=loss_hf, loss_stronghold_ops=loss_ops, patched=report.num_patched if report else 0)
        for _ in range(3):
            train_step()
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(1 if args.smoke else 6):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                train_step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                train_step()
                times.append((time.perf_counter() - t0) * 1e3)
        row["step_ms_median"] = sorted(times)[len(times) // 2]
        row["step_ms_all"] = times
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        _emit(args.out, row, "e2e.jsonl")
        ops.unapply(model)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/kernels")
    parser.add_argument("--only", default="", help="comma-separated kernel names (linear_ce covers both vocabs)")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--sweep-norms", action="store_true", help="also time the NORM_VARIANTS launch settings")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script runs")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no new kernel case after this")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    args.only = set(filter(None, args.only.split(",")))
    args.deadline = time.monotonic() + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from examples.provenance import git_commit

    commit = args.commit or git_commit() or "unknown"
    import triton
    import transformers

    meta = dict(commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__)
    if not args.skip_kernels:
        run_kernels(args, SMOKE if args.smoke else FULL, device, meta, liger_functions())
    if not args.skip_e2e:
        run_e2e(args, E2E_SMOKE if args.smoke else E2E_FULL, device, meta)
    print(write_markdown(args.out))


if __name__ == "__main__":
    main()
