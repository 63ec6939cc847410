"""Host-side costs the Llama GA 8 step pays per streamed block, measured one by one on the GPU machine.

    python3 -m examples.probe_host_costs [--json OUT.json]

1. The native CPU kernel's fixed cost per call (its threads start and exit with each call): a tiny accumulate with
   1 thread and with the default thread count, and a block-sized one.
2. The launching thread's rate beside the CPU worker: 20000 tiny kernel launches alone, then while another thread
   calls the native accumulate back to back on block-sized buffers with 15 ... 8 threads (and that accumulate's time).
3. A block's gradient offload (a Llama h2560 block's nine gradients into a pinned host buffer): the engine's per-piece
   slice + copy + record_stream, the same with the destination views made once, and one gather into a flat device
   buffer followed by a single copy.
4. Re-pointing a block's nine parameters (`param.data = view`), with the views sliced per call and made once.
5. (`--parts host_work`) host work with a working set, alone and beside the accumulate.
6. (`--parts isolate`) which side of the accumulate slows launch-bound work: the same host-memory traffic from a
   thread of this process making block-sized calls (the engine's pattern: the GIL taken back and 15 threads started
   and joined per call), from this process in calls 16 times longer, and from another process in block-sized calls.
Host seconds per call; the GPU work each issues is waited for outside the timed region.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

from stronghold.optim.cpu_adam import default_threads, load_kernel
from stronghold.streaming.pinned import pinned_empty
from stronghold.planning.plan_types import ACCUMULATE_HOST_BYTES

H, INTER = 2560, 6912
THREAD_COUNTS = (15, 14, 13, 12, 10, 8)
SHAPES = [(H, H)] * 4 + [(INTER, H), (INTER, H), (H, INTER), (H,), (H,)]


BLOCK = sum(torch.Size(s).numel() for s in SHAPES)
"""Elements of one Llama h2560 block's nine parameters."""


def block_buffers(blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 accumulator and a bf16 gradient of `blocks` blocks' size, as the engine's host accumulate sees."""
    return torch.zeros(blocks * BLOCK), torch.ones(blocks * BLOCK, dtype=torch.bfloat16)


def tiny_launches():
    """20000 launches of a one-element GPU add: the launching thread's rate, nothing else."""
    x = torch.zeros(1, device="cuda")

    def launches():
        for _ in range(20000):
            x.add_(1)
    return launches


def per_call(fn, calls: int, sync=lambda: None) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls


def kernel_costs(out: dict) -> None:
    many = load_kernel()
    one = load_kernel(1)
    tiny_acc, tiny_g = torch.zeros(1024), torch.ones(1024, dtype=torch.bfloat16)
    acc, g = block_buffers()
    out["kernel"] = {
        "threads": many.threads,
        "tiny_1_thread_us": 1e6 * per_call(lambda: one.accumulate(tiny_acc, tiny_g, False), 2000),
        "tiny_default_threads_us": 1e6 * per_call(lambda: many.accumulate(tiny_acc, tiny_g, False), 500),
        "block_default_threads_ms": 1e3 * per_call(lambda: many.accumulate(acc, g, False), 20),
        "block_numel": BLOCK,
    }


def launch_rate(out: dict) -> None:
    sync = torch.cuda.synchronize
    launches = tiny_launches()
    acc, g = block_buffers()
    rows = {"alone_us": 1e6 * per_call(launches, 3, sync) / 20000}
    for threads in THREAD_COUNTS:
        kernel = load_kernel(threads)
        stop = threading.Event()
        calls = [0]

        def worker():
            while not stop.is_set():
                kernel.accumulate(acc, g, False)
                calls[0] += 1

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        time.sleep(0.2)
        start, before = time.perf_counter(), calls[0]
        rows[f"beside_accumulate_{threads}_threads_us"] = 1e6 * per_call(launches, 3, sync) / 20000
        rows[f"accumulate_{threads}_threads_ms"] = 1e3 * (time.perf_counter() - start) / max(1, calls[0] - before)
        stop.set()
        thread.join()
    rows["alone_again_us"] = 1e6 * per_call(launches, 3, sync) / 20000
    out["launch"] = rows


def autograd_ops():
    """Launch-bound host work with the model's kind of working set: autograd over 200 tiny GPU ops."""
    weights = [torch.randn(64, device="cuda", requires_grad=True) for _ in range(200)]
    x = torch.randn(64, device="cuda")

    def run():
        y = x
        for w in weights:
            y = torch.nn.functional.silu(y * w + 1.0)
        y.sum().backward()
    return run


def dict_walk(mb: float):
    """A Python walk over a dict of about `mb` MB (~160 bytes an entry: key, list, int)."""
    table = {f"k{i}": [i] for i in range(int(mb * 2 ** 20 / 160))}

    def walk():
        total = 0
        for key in table:
            total += table[key][0]
        return total
    return walk


def beside(fn, calls: int, background) -> float:
    """Seconds per call of `fn` while another thread calls `background` back to back."""
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            background()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    time.sleep(0.1)
    try:
        return per_call(fn, calls, torch.cuda.synchronize)
    finally:
        stop.set()
        thread.join()


def host_work_beside_kernels(out: dict) -> None:
    """Launch-bound host work with a working set alone, beside the accumulate on the default threads, and alone
    again. Bare launches slowed ~10% beside the kernels (run51). Session 26 read the Llama step as following the
    kernels' time (run56); session 27's skip probe (run64) showed that it does not."""
    kernel = load_kernel()
    acc, g = block_buffers()
    work = {"autograd_200_ops_ms": (autograd_ops(), 20)}
    for mb in (0.1, 2, 8, 32):
        work[f"dict_walk_{mb}MB_ms"] = (dict_walk(mb), max(2, int(200 / (1 + mb * 10))))
    rows: dict = {}
    sync = torch.cuda.synchronize
    for name, (fn, calls) in work.items():
        rows[name + "_alone"] = 1e3 * per_call(fn, calls, sync)
        rows[name + "_beside"] = 1e3 * beside(fn, calls, lambda: kernel.accumulate(acc, g, False))
        rows[name + "_again"] = 1e3 * per_call(fn, calls, sync)
    out["host_work"] = rows


def offload_costs(out: dict) -> None:
    device = torch.device("cuda")
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in SHAPES]
    numels = [g.numel() for g in grads]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    total = sum(numels)
    host = torch.empty(total, dtype=torch.bfloat16, pin_memory=True)
    stream = torch.cuda.Stream()
    views = [host[o:o + n] for o, n in zip(offsets, numels)]
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)

    def on_d2h(copies):
        """The engine's pattern around a block's copies (before 1b356b2: a new event each time)."""
        def issue():
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                stream.wait_event(produced)
                copies()
                torch.cuda.Event().record(stream)
        return issue

    def sliced_copies():
        for grad, offset in zip(grads, offsets):
            host[offset:offset + grad.numel()].copy_(grad.reshape(-1), non_blocking=True)
            grad.record_stream(stream)

    def view_copies():
        for grad, view in zip(grads, views):
            view.copy_(grad.view(-1), non_blocking=True)
            grad.record_stream(stream)

    def one_copy():
        host.copy_(flat, non_blocking=True)
        flat.record_stream(stream)

    current, cached_views, gather_copy = on_d2h(sliced_copies), on_d2h(view_copies), on_d2h(one_copy)

    def gathered():
        torch.cat([g.view(-1) for g in grads], out=flat)
        gather_copy()

    registered = pinned_empty(total, torch.bfloat16)  # how the engine allocates its gradient buffers
    registered_views = [registered[o:o + n].view(g.shape) for o, n, g in zip(offsets, numels, grads)]

    def engine_buffer(record: bool):
        def issue():
            produced.record(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                stream.wait_event(produced)
                for grad, view in zip(grads, registered_views):
                    view.copy_(grad, non_blocking=True)
                    if record:
                        grad.record_stream(stream)
                done.record(stream)
        return issue

    produced, done = torch.cuda.Event(), torch.cuda.Event()
    sync = torch.cuda.synchronize
    out["offload_us"] = {name: 1e6 * per_call(fn, 30, sync) for name, fn in
                         (("current", current), ("cached_views", cached_views), ("gathered", gathered),
                          ("registered_cached_views", engine_buffer(True)),
                          ("registered_no_record_stream", engine_buffer(False)))}


def repoint_costs(out: dict) -> None:
    params = [torch.nn.Parameter(torch.empty(s, dtype=torch.bfloat16, device="cuda")) for s in SHAPES]
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    buffers = [torch.empty(sum(numels), dtype=torch.bfloat16, device="cuda"),
               torch.empty(sum(numels), dtype=torch.bfloat16, pin_memory=True)]
    cached = [[b[o:o + p.numel()].view(p.shape) for p, o in zip(params, offsets)] for b in buffers]
    turn = [0]

    def sliced():
        turn[0] ^= 1
        buffer = buffers[turn[0]]
        for p, o in zip(params, offsets):
            p.data = buffer[o:o + p.numel()].view(p.shape)

    def made_once():
        turn[0] ^= 1
        for p, view in zip(params, cached[turn[0]]):
            p.data = view

    out["repoint_us"] = {"sliced": 1e6 * per_call(sliced, 2000), "views_made_once": 1e6 * per_call(made_once, 2000)}


def _in_process(kernel, acc, g, stats):
    def background():
        start = time.perf_counter()
        kernel.accumulate(acc, g, False)
        stats["s"] += time.perf_counter() - start
        stats["bytes"] += acc.numel() * ACCUMULATE_HOST_BYTES
    return background


def _beside_process(fn, calls: int, elements: int) -> tuple[float, float]:
    """(seconds per call of `fn`, the other process's GB/s) while another process sums block-sized buffers."""
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "load.jsonl")
        load = subprocess.Popen([sys.executable, "-m", "examples.bench.dram_load", "--native", "--threads",
                                 str(default_threads()), "--elements", str(elements), "--seconds", "600",
                                 "--json", record], stdout=subprocess.PIPE, text=True)
        # Its buffers allocated, its kernel loaded and its SIGTERM handler set before the timing starts.
        if "running" not in load.stdout.readline():
            raise RuntimeError("examples.bench.dram_load did not start")
        time.sleep(0.5)
        try:
            seconds = per_call(fn, calls, torch.cuda.synchronize)
        finally:
            load.send_signal(signal.SIGTERM)
            load.wait(timeout=60)
        with open(record) as handle:
            return seconds, json.loads(handle.readlines()[-1])["gb_per_s"]


def isolate(out: dict) -> None:
    """Launch-bound work alone and beside the same accumulate traffic from three sources (module docstring, 6)."""
    kernel = load_kernel()
    small, big = block_buffers(), block_buffers(16)
    launches = tiny_launches()
    rows: dict = {}
    for round_ in (1, 2, 3):
        for name, fn, calls in (("autograd_200_ops_ms", autograd_ops(), 40), ("launches_20000_ms", launches, 3)):
            key = f"{name}_r{round_}"
            rows[key + "_alone"] = 1e3 * per_call(fn, calls, torch.cuda.synchronize)
            for label, (acc, g) in (("block_calls", small), ("calls_16x_longer", big)):
                stats = {"s": 0.0, "bytes": 0}
                rows[f"{key}_beside_{label}"] = 1e3 * beside(fn, calls, _in_process(kernel, acc, g, stats))
                rows[f"{key}_{label}_gb_per_s"] = round(stats["bytes"] / max(stats["s"], 1e-9) / 1e9, 1)
            seconds, rate = _beside_process(fn, calls, BLOCK)
            rows[f"{key}_beside_other_process"] = 1e3 * seconds
            rows[f"{key}_other_process_gb_per_s"] = rate
            rows[key + "_again"] = 1e3 * per_call(fn, calls, torch.cuda.synchronize)
            print(json.dumps({k: v for k, v in rows.items() if k.startswith(key)}), flush=True)
    out["isolate"] = rows


def save(out: dict, path) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(out, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--parts", default="kernel,launch,offload,repoint")
    args = parser.parse_args()
    out: dict = {"default_threads": default_threads(), "device": torch.cuda.get_device_name()}
    parts = {"kernel": kernel_costs, "launch": launch_rate, "offload": offload_costs, "repoint": repoint_costs,
             "host_work": host_work_beside_kernels, "isolate": isolate}
    for part in (parts[name] for name in args.parts.split(",")):
        part(out)
        print(json.dumps(out), flush=True)
    save(out, args.json)


if __name__ == "__main__":
    main()
