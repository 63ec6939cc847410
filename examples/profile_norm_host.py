"""Where the host time of one LayerNorm forward + backward goes, on a CUDA GPU (results/kernels/NOTES.md).

    python3 examples/profile_norm_host.py

Prints host microseconds per call (launches queued behind a long device sleep, so the host never
waits) through autograd for ours and torch's, then for our `_forward` and `_backward` called directly,
each with a cProfile of 100 calls. Numbers only; nothing is written.
"""
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stronghold_ops as ops  # noqa: E402
from stronghold_ops import norm  # noqa: E402

x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
up = torch.randn_like(x)


def step(fn):
    y = fn(x, w, b, 1e-5)
    return torch.autograd.grad(y, (x, w, b), up)


for fn in (ops.layer_norm, ops.layer_norm_reference):
    for _ in range(20):
        step(fn)
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)
    t = time.perf_counter()
    for _ in range(100):
        step(fn)
    print(fn.__name__, "host us/call", (time.perf_counter() - t) * 1e4, flush=True)
    torch.cuda.synchronize()


class Ctx:
    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


ctx = Ctx()
norm._forward(ctx, x, w, b, 1e-5, False)
for label, call in (("forward", lambda: norm._forward(Ctx(), x, w, b, 1e-5, False)),
                    ("backward", lambda: norm._backward(ctx, up))):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)
    t = time.perf_counter()
    for _ in range(100):
        call()
    print(label, "host us/call, direct", (time.perf_counter() - t) * 1e4, flush=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
