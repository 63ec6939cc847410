"""Where a block's first compiled step goes: one decoder layer compiled as the engine compiles it (its class's forward,
inductor with stronghold.integrations.compile.INDUCTOR_OPTIONS), run under non-reentrant checkpointing as HF runs it,
first call (compile included) against the steady call, each variant in a fresh process with its own Inductor cache.

    python3 -m examples.bench.compile_cold --json results/engine/setup_time.jsonl \
        --variants eager,default,warm,no_pointwise_autotune,one_compile_thread

Variants: `eager` (no compile), `default` (the engine's options, a cold cache), `warm` (default again on the cache the
`default` run left: a user's second run), `no_pointwise_autotune` (Inductor's `triton.autotune_pointwise` off: it
benchmarks several launch configurations of each pointwise kernel at its first call), `one_compile_thread`
(TORCHINDUCTOR_COMPILE_THREADS=1: Triton kernels compiled in the process instead of Inductor's worker pool). Each line
has the first call's seconds, the steady call's (median of `--iters`), and Dynamo's time per compile phase.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "eager": None,
    "default": {},
    "warm": {},
    "no_pointwise_autotune": {"triton.autotune_pointwise": False},
    "one_compile_thread": {},
}
ENV = {"one_compile_thread": {"TORCHINDUCTOR_COMPILE_THREADS": "1"}}


def child(args) -> dict:
    import torch
    import torch._inductor.config as inductor_config
    import torch.utils.checkpoint as checkpoint
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from stronghold.integrations.compile import INDUCTOR_OPTIONS

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, num_hidden_layers=1, max_position_embeddings=args.seq,
                         torch_dtype=torch.bfloat16)
    config._attn_implementation = "sdpa"
    device = torch.device(args.device)
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=torch.bfloat16)
    rotary = LlamaRotaryEmbedding(config, device=device)
    hidden = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.batch, -1)
    embeddings = tuple(t.to(torch.bfloat16) for t in rotary(hidden, positions))
    forward = type(layer).forward
    if VARIANTS[args.child] is not None:
        forward = torch.compile(forward, backend="inductor", options={**INDUCTOR_OPTIONS, **VARIANTS[args.child]})

    def call():
        out = checkpoint.checkpoint(lambda h: forward(layer, h, position_embeddings=embeddings, attention_mask=None,
                                                      position_ids=positions), hidden, use_reentrant=False)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    call()
    sync()
    first_s = time.perf_counter() - started
    times = []
    for _ in range(args.iters):
        started = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - started)
    phases = {}
    try:
        from torch._dynamo.utils import calculate_time_spent
        phases = {key: round(float(value), 3) for key, value in calculate_time_spent().items()}
    except Exception as error:  # a private helper: its absence leaves the phases out, not the record
        phases = {"unavailable": repr(error)[:200]}
    return {"first_s": round(first_s, 3), "steady_s": round(statistics.median(times), 5), "phases": phases,
            "compile_threads": inductor_config.compile_threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--intermediate", type=int, default=6912)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--kv-heads", type=int, default=20)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=sorted(VARIANTS), default=None)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args)))
        return
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}: choose from {sorted(VARIANTS)}")
    import torch

    from examples.bench.environment import environment_info
    from examples.provenance import emit_record

    caches = tempfile.mkdtemp(prefix="compile_cold_")
    keys = ("hidden", "intermediate", "heads", "kv_heads", "seq", "batch", "iters", "device")
    shape = {key: getattr(args, key) for key in keys}
    for variant in args.variants.split(","):
        cache = os.path.join(caches, "default" if variant in ("default", "warm") else variant)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
               **ENV.get(variant, {})}
        command = [sys.executable, "-m", "examples.bench.compile_cold", "--child", variant] + [
            f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        record = {"bench": "compile_cold", "variant": variant, "shape": shape,
                  "process_s": round(time.perf_counter() - started, 2), **environment_info(torch.cuda.is_available()),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if done.returncode == 0:
            record.update(json.loads(done.stdout.strip().splitlines()[-1]))
        else:
            lines = done.stderr.strip().splitlines()
            record["error"] = lines[-1][:300] if lines else f"rc {done.returncode}"
        emit_record(record, args.json)


if __name__ == "__main__":
    main()
