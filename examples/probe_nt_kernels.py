"""Does the CPU kernels' cache footprint, not their bandwidth alone, slow the launch-bound host work beside them?

    python3 -m examples.probe_nt_kernels [--json OUT.json]

Launch-bound host work with a working set runs 35-50% slower beside the accumulate (results/placement run57).
(Session 26 also read the Llama GA 8 step as following the kernels' time, run56; session 27's skip probe, run64,
showed that it does not.) This builds two versions of that accumulate (acc += bf16 g, the
same arithmetic, AVX2): one with ordinary loads and stores, one that prefetches with the non-temporal hint and writes
with streaming stores (lines that bypass the caches), and times the same host work alone and beside each, with each
kernel's own rate. If the streaming version leaves the host work faster at a similar rate, csrc/adamw.c's passes are
worth the same treatment.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
import torch

from .probe_host_costs import SHAPES, autograd_ops, beside, dict_walk, per_call, save

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>

typedef struct { float *acc; const uint16_t *g; int64_t lo, hi; int nt; } part;

static inline __m256 bf16x8(const uint16_t *g) {
    __m128i h = _mm_loadu_si128((const __m128i *)g);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static void *run_part(void *arg) {
    part *p = (part *)arg;
    float *acc = p->acc;
    const uint16_t *g = p->g;
    if (p->nt) {
        for (int64_t i = p->lo; i < p->hi; i += 8) {
            _mm_prefetch((const char *)(acc + i + 256), _MM_HINT_NTA);
            _mm_prefetch((const char *)(g + i + 512), _MM_HINT_NTA);
            _mm256_stream_ps(acc + i, _mm256_add_ps(_mm256_load_ps(acc + i), bf16x8(g + i)));
        }
        _mm_sfence();
    } else {
        for (int64_t i = p->lo; i < p->hi; i += 8)
            _mm256_store_ps(acc + i, _mm256_add_ps(_mm256_load_ps(acc + i), bf16x8(g + i)));
    }
    return 0;
}

/* n: a multiple of 8 * nthreads; acc 32-byte aligned. */
void accumulate(float *acc, const uint16_t *g, int64_t n, int nthreads, int nt) {
    pthread_t ids[256];
    part parts[256];
    int64_t per = n / nthreads;
    for (int t = 0; t < nthreads; ++t) {
        parts[t] = (part){acc, g, t * per, t == nthreads - 1 ? n : (t + 1) * per, nt};
        if (t) pthread_create(&ids[t], 0, run_part, &parts[t]);
    }
    run_part(&parts[0]);
    for (int t = 1; t < nthreads; ++t) pthread_join(ids[t], 0);
}
"""


def build() -> ctypes.CDLL:
    folder = tempfile.mkdtemp(prefix="nt_probe_")
    source, library = os.path.join(folder, "nt.c"), os.path.join(folder, "nt.so")
    with open(source, "w") as handle:
        handle.write(SOURCE)
    subprocess.run(["cc", "-O2", "-mavx2", "-pthread", "-fPIC", "-shared", source, "-o", library], check=True)
    lib = ctypes.CDLL(library)
    lib.accumulate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.accumulate.restype = None
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--threads", type=int, default=15)
    args = parser.parse_args()
    lib = build()
    threads = args.threads
    block = sum(torch.Size(s).numel() for s in SHAPES) // (8 * threads) * (8 * threads)
    acc, g = torch.zeros(block), torch.ones(block, dtype=torch.bfloat16)
    assert acc.data_ptr() % 32 == 0

    def accumulate(nt: int) -> None:
        lib.accumulate(acc.data_ptr(), g.data_ptr(), block, threads, nt)

    # The two versions compute the same sums.
    acc.zero_()
    accumulate(0)
    plain = acc.clone()
    acc.zero_()
    accumulate(1)
    assert torch.equal(acc, plain)

    out: dict = {"threads": threads, "block_numel": block,
                 "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                              if line.startswith("model name")), "?")}
    sync = torch.cuda.synchronize
    autograd, walk = autograd_ops(), dict_walk(16)
    for nt in (0, 1, 0, 1):
        label = "streaming" if nt else "ordinary"
        row: dict = {"kernel_ms": 1e3 * per_call(lambda: accumulate(nt), 20)}
        for name, fn, calls in (("autograd_200_ops_ms", autograd, 20), ("dict_walk_16MB_ms", walk, 10)):
            row[name + "_alone"] = 1e3 * per_call(fn, calls, sync)
            row[name + "_beside"] = 1e3 * beside(fn, calls, lambda: accumulate(nt))
        out.setdefault(label, []).append(row)
        print(json.dumps(out), flush=True)
    save(out, args.json)


if __name__ == "__main__":
    main()
