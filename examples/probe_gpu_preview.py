"""Probe: can the GPU take part of the update boundary's previews, and what does that cost the CPU's?

Measured and dropped (results/placement/NOTES.md, session 30): the engine previewed every other streamed block this
way for one session (runs 97-99). The copies' DMA reads the same host memory the CPU's previews do, so the CPU's
slowed from 13.5 to ~20 ms a block and the chain fell only ~40 ms; no step gain showed. The kernel below computes the
CPU kernel's weights bit for bit (division and square root correctly rounded, no fused multiply-adds).

At the accumulation boundary the CPU previews every streamed block's next weights (18 bytes a parameter at the host's
memory bandwidth, results/placement/NOTES.md session 29) while the next forward waits for them. The GPU could compute
some of them from the fp32 master and moments copied up (12 bytes a parameter over PCIe; the gradient is on the GPU
with GPU accumulation). Whether that helps depends on whether the copies' DMA slows the CPU's kernels (both read host
memory), so this times, for blocks of `--numel` elements:
- `cpu`: one CPU preview alone; `h2d_pinned` / `h2d_pageable`: the 12 bytes a parameter copied up alone, from
  page-locked and from pageable (huge-page) memory, plus the GPU kernel;
- `chain_cpu`: `--blocks` previews back to back on the CPU (today's boundary); `chain_split`: the same blocks, each
  given to whichever of the CPU and the GPU would finish it first (at the rates measured alone), both running at once;
- `equal`: whether the GPU kernel's weights equal the CPU kernel's, bit for bit.

    python examples/probe_gpu_preview.py [--numel 79000000] [--blocks 8] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402  (after the path: stronghold_ops from this checkout)
import triton.language as tl  # noqa: E402

from stronghold_ops.kernels.rounding import cast_to  # noqa: E402


@triton.jit
def adamw_preview(P, M, V, G, OUT, n, scale, decay, w1, beta2, omb2, neg_step_size, bc2_sqrt, eps,
                  BLOCK: tl.constexpr):
    """stronghold/csrc/adamw.c's adamw_math, one rounding per operation (launched with enable_fp_fusion=False)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    p = tl.load(P + offs, mask=ok, other=0.0)
    m = tl.load(M + offs, mask=ok, other=0.0)
    v = tl.load(V + offs, mask=ok, other=0.0)
    gs = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32) * scale
    pi = p * decay
    mi = m + w1 * (gs - m)
    vi = v * beta2
    vi = vi + omb2 * gs * gs
    denom = tl.math.div_rn(tl.math.sqrt_rn(vi), bc2_sqrt) + eps
    pi = pi + neg_step_size * tl.math.div_rn(mi, denom)
    tl.store(OUT + offs, cast_to(pi, OUT.dtype.element_ty), mask=ok)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=79_000_000)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from stronghold.optim.cpu_adam import AdamWCoeffs, load_kernel
    from stronghold.streaming.pinned import pageable_empty, pinned_empty

    kernel, n, dev = load_kernel(), args.numel, torch.device("cuda")
    coeffs = AdamWCoeffs(3e-4, 0.9, 0.95, 1e-8, 0.1, 7)
    c = coeffs.as_struct()

    def filled(alloc):
        t = alloc(n, torch.float32)
        t.copy_(torch.randn(n) * 1e-2)
        return t

    blocks = []
    for _ in range(args.blocks):
        pinned = [filled(pinned_empty) for _ in range(3)]
        pageable = [filled(pageable_empty) for _ in range(3)]
        for v in (pinned[2], pageable[2]):  # exp_avg_sq is a sum of squares
            v.abs_()
        blocks.append({"pinned": pinned, "pageable": pageable, "g": filled(pageable_empty),
                       "out": pinned_empty(n, torch.bfloat16)})
    g_dev = torch.randn(n, device=dev) * 1e-2
    staging = [torch.empty(n, device=dev) for _ in range(3)]
    slot = torch.empty(n, device=dev, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()

    def cpu_preview(b):
        p, m, v = b["pageable"]
        kernel.preview(p, m, v, b["g"], b["out"], coeffs, 0.5)

    def gpu_preview(b, source="pinned"):
        with torch.cuda.stream(stream):
            for dst, src in zip(staging, b[source]):
                dst.copy_(src, non_blocking=True)
            adamw_preview[(triton.cdiv(n, 4096),)](*staging, g_dev, slot, n, 0.5, c.decay, c.w1, c.beta2, c.omb2,
                                                   c.neg_step_size, c.bc2_sqrt, c.eps, BLOCK=4096,
                                                   enable_fp_fusion=False)
        return stream

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def median(fn):
        fn()
        return statistics.median(timed(fn) for _ in range(args.repeats))

    result = {"numel": n, "threads": kernel.threads, "blocks": args.blocks}
    result["cpu_s"] = median(lambda: cpu_preview(blocks[0]))
    result["h2d_pinned_s"] = median(lambda: gpu_preview(blocks[0]).synchronize())
    result["h2d_pageable_s"] = median(lambda: gpu_preview(blocks[0], "pageable").synchronize())
    result["h2d_pinned_GB_per_s"] = round(12 * n / result["h2d_pinned_s"] / 1e9, 1)

    # Bit equality on the same inputs (gradient copied to the GPU).
    b = blocks[0]
    g_dev.copy_(b["g"])
    gpu_preview(b).synchronize()
    kernel.preview(*b["pinned"], b["g"], b["out"], coeffs, 0.5)
    result["equal"] = bool(torch.equal(slot.cpu().view(torch.int16), b["out"].view(torch.int16)))

    def chain_cpu():
        for b in blocks:
            cpu_preview(b)

    def chain_split():
        cpu_t, gpu_t, mine = 0.0, 0.0, {"cpu": [], "gpu": []}
        for b in blocks:  # greedy, at the rates measured alone
            if gpu_t + result["h2d_pinned_s"] < cpu_t + result["cpu_s"]:
                gpu_t += result["h2d_pinned_s"]; mine["gpu"].append(b)
            else:
                cpu_t += result["cpu_s"]; mine["cpu"].append(b)
        times = {}

        def cpu_side():
            times["cpu"] = timed(lambda: [cpu_preview(b) for b in mine["cpu"]])

        worker = threading.Thread(target=cpu_side)
        start = time.perf_counter()
        worker.start()
        for b in mine["gpu"]:
            gpu_preview(b)
        stream.synchronize()
        times["gpu"] = time.perf_counter() - start
        worker.join()
        times["wall"] = time.perf_counter() - start
        times["split"] = [len(mine["cpu"]), len(mine["gpu"])]
        return times

    result["chain_cpu_s"] = median(chain_cpu)
    splits = [chain_split() for _ in range(args.repeats + 1)][1:]
    result["chain_split"] = {key: statistics.median(s[key] for s in splits) for key in ("cpu", "gpu", "wall")}
    result["chain_split"]["cpu_gpu_blocks"] = splits[0]["split"]
    result["cpu_per_block_in_split_s"] = result["chain_split"]["cpu"] / max(1, splits[0]["split"][0])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
