"""The CPU AdamW kernel of the streamed blocks (the interface: adamw_kernel.py): a native build of csrc/adamw.c, or its
eager reference (cpu_adam_reference.py) where no C compiler builds it.

Why our own and not DeepSpeedCPUAdam: its `adam_update` binding holds the GIL for the whole update
(so a worker thread would stall the main thread's kernel launches), and it does not write the bf16
working copy in the same pass. The native kernel is called through ctypes, which releases the GIL,
and moves ~28 bytes/param (p, m, v read+write, bf16 or fp16 grad in, the same dtype's copy out).
`python -m examples.bench.cpu_adam` measures it against DeepSpeedCPUAdam.

The C file is compiled on first use with the system C compiler (-O3 -march=native) into a
cache keyed by source, flags, compiler and CPU, in about a second. Its threads are started per call
and exit with it (no OpenMP runtime whose idle threads spin between calls). Where no compiler is
found the eager reference (cpu_adam_reference.py) is used instead (same results, several passes, slower), with a
warning.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from stronghold.optim.adamw_kernel import AdamWKernel, CCoeffs
from stronghold.optim.cpu_adam_reference import TorchAdamW

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "adamw.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-pthread", "-fPIC", "-shared", "-std=gnu11",
          "-ffp-contract=off", "-fno-math-errno"]


_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The element dtype codes of csrc/adamw.c (F32 / NONE, BF16, F16)."""


def _check(t: torch.Tensor, dtype: torch.dtype, n: int, what: str) -> None:
    assert t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and t.numel() == n, (
        f"{what}: expected contiguous cpu {dtype} of {n} elements, got {t.dtype} {tuple(t.shape)} on {t.device}")


class NativeAdamW(AdamWKernel):
    def __init__(self, library: ctypes.CDLL, threads: int):
        self.lib, self.threads = library, threads
        ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        coeffs = ctypes.POINTER(CCoeffs)
        library.sh_adamw_step.argtypes = [ptr, ptr, ptr, ptr, i32, ptr, i32, i64, coeffs, f32, i32]
        library.sh_adamw_step.restype = ctypes.c_double
        library.sh_adamw_preview.argtypes = [ptr, ptr, ptr, ptr, i32, ptr, i32, i64, coeffs, f32, i32]
        library.sh_adamw_preview.restype = None
        library.sh_adamw_redo.argtypes = [ptr, ptr, ptr, ptr, i32, ptr, i32, i64, coeffs, coeffs, f32, f32, i32, i32]
        library.sh_adamw_redo.restype = None
        library.sh_accumulate.argtypes = [ptr, ptr, i32, i64, i32, i32]
        library.sh_accumulate.restype = ctypes.c_double
        library.sh_accumulate2.argtypes = [ptr, ptr, ptr, i32, i64, i32, i32]
        library.sh_accumulate2.restype = ctypes.c_double
        library.sh_sum_squares.argtypes = [ptr, i32, i64, i32]
        library.sh_sum_squares.restype = ctypes.c_double
        library.sh_adamw_step_compact.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i64, coeffs, f32, i32]
        library.sh_adamw_step_compact.restype = ctypes.c_double
        library.sh_adamw_step_compact_master.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i64, coeffs, f32, i32]
        library.sh_adamw_step_compact_master.restype = None
        library.sh_adamw_moments.argtypes = [ptr, ptr, ptr, i32, i64, coeffs, f32, i32]
        library.sh_adamw_moments.restype = ctypes.c_double
        library.sh_master_merge.argtypes = [ptr, ptr, ptr, i64, i32]
        library.sh_master_merge.restype = None
        library.sh_master_split.argtypes = [ptr, ptr, ptr, i64, i32]
        library.sh_master_split.restype = None
        library.sh_set_thread_stack.argtypes = [i64]  # a probe's A/B (examples/bench/cpu_variants.py)
        library.sh_set_thread_stack.restype = None
        library.sh_kernel_ns.argtypes = []
        library.sh_kernel_ns.restype = ctypes.c_int64
        library.sh_fault_in.argtypes = [ptr, i64, i64]
        library.sh_fault_in.restype = None

    def kernel_seconds(self) -> Optional[float]:
        return self.lib.sh_kernel_ns() * 1e-9

    def fault_in(self, t: torch.Tensor) -> bool:
        assert t.device.type == "cpu" and t.is_contiguous(), "fault_in: a contiguous CPU tensor"
        self.lib.sh_fault_in(t.data_ptr(), t.numel() * t.element_size(), mmap.PAGESIZE)
        return True

    @staticmethod
    def _grad(g: torch.Tensor, n: int) -> tuple[int, int]:
        assert g.dtype in _KINDS, f"gradient dtype {g.dtype} is not fp32, bf16 or fp16"
        _check(g, g.dtype, n, "grad")
        return g.data_ptr(), _KINDS[g.dtype]

    def _state(self, p, m, v, out) -> tuple[int, Optional[int], int]:
        """(numel, out's pointer, out's dtype code) after checking the buffers."""
        n = p.numel()
        for t, what in ((p, "param"), (m, "exp_avg"), (v, "exp_avg_sq")):
            _check(t, torch.float32, n, what)
        if out is None:
            return n, None, 0
        assert out.dtype in (torch.bfloat16, torch.float16), f"working copy dtype {out.dtype} is not bf16 or fp16"
        _check(out, out.dtype, n, "working copy")
        return n, out.data_ptr(), _KINDS[out.dtype]

    def step(self, p, m, v, g, out, coeffs, scale=1.0):
        n, optr, okind = self._state(p, m, v, out)
        gptr, gkind = self._grad(g, n)
        return self.lib.sh_adamw_step(p.data_ptr(), m.data_ptr(), v.data_ptr(), gptr, gkind, optr, okind, n,
                                      ctypes.byref(coeffs.as_struct()), scale, self.threads)

    def preview(self, p, m, v, g, out, coeffs, scale=1.0):
        assert out is not None, "preview writes the working copy; fp32 mode has none"
        n, optr, okind = self._state(p, m, v, out)
        gptr, gkind = self._grad(g, n)
        self.lib.sh_adamw_preview(p.data_ptr(), m.data_ptr(), v.data_ptr(), gptr, gkind, optr, okind, n,
                                  ctypes.byref(coeffs.as_struct()), scale, self.threads)

    def _redo(self, p, m, v, g, out, spec, final, spec_scale, scale, undo):
        n, optr, okind = self._state(p, m, v, out)
        gptr, gkind = self._grad(g, n)
        self.lib.sh_adamw_redo(p.data_ptr(), m.data_ptr(), v.data_ptr(), gptr, gkind, optr, okind, n,
                               ctypes.byref(spec.as_struct()), ctypes.byref(final.as_struct()), spec_scale, scale,
                               int(undo), self.threads)

    def redo(self, p, m, v, g, out, spec, final, scale, spec_scale=1.0):
        self._redo(p, m, v, g, out, spec, final, spec_scale, scale, undo=False)

    def undo(self, p, m, v, g, out, spec, spec_scale=1.0):
        # The final coefficients are not read when undoing; pass valid ones all the same, since the
        # vectorized loop may evaluate both sides of its select.
        self._redo(p, m, v, g, out, spec, spec, spec_scale, 1.0, undo=True)

    def accumulate(self, acc, g, first):
        _check(acc, torch.float32, acc.numel(), "accumulator")
        gptr, gkind = self._grad(g, acc.numel())
        return self.lib.sh_accumulate(acc.data_ptr(), gptr, gkind, acc.numel(), int(first), self.threads)

    def accumulate2(self, acc, g, g2, first):
        """One pass over acc for two micro-steps' gradients: 12 bytes a parameter moved against two passes' 20."""
        _check(acc, torch.float32, acc.numel(), "accumulator")
        gptr, gkind = self._grad(g, acc.numel())
        assert g2.dtype == g.dtype, (g.dtype, g2.dtype)
        g2ptr, _ = self._grad(g2, acc.numel())
        return self.lib.sh_accumulate2(acc.data_ptr(), gptr, g2ptr, gkind, acc.numel(), int(first), self.threads)

    def sum_squares(self, g):
        gptr, gkind = self._grad(g, g.numel())
        return self.lib.sh_sum_squares(gptr, gkind, g.numel(), self.threads)

    @staticmethod
    def _halves(hi, lo, *fp32: tuple[torch.Tensor, str]) -> int:
        """The element count after checking a compact master's halves and the fp32 buffers beside them."""
        n = hi.numel()
        _check(hi, torch.bfloat16, n, "working copy")
        _check(lo, torch.int16, n, "low half")
        for t, what in fp32:
            _check(t, torch.float32, n, what)
        return n

    def step_compact(self, hi, lo, m, v, g, coeffs, scale=1.0):
        n = self._halves(hi, lo, (m, "exp_avg"), (v, "exp_avg_sq"))
        gptr, gkind = self._grad(g, n)
        return self.lib.sh_adamw_step_compact(hi.data_ptr(), lo.data_ptr(), m.data_ptr(), v.data_ptr(), gptr, gkind, n,
                                              ctypes.byref(coeffs.as_struct()), scale, self.threads)

    def step_compact_master(self, hi, lo, m, v, g, coeffs, scale=1.0):
        n = self._halves(hi, lo, (m, "exp_avg"), (v, "exp_avg_sq"))
        gptr, gkind = self._grad(g, n)
        self.lib.sh_adamw_step_compact_master(hi.data_ptr(), lo.data_ptr(), m.data_ptr(), v.data_ptr(), gptr, gkind,
                                              n, ctypes.byref(coeffs.as_struct()), scale, self.threads)

    def moments(self, m, v, g, coeffs, scale=1.0):
        n = m.numel()
        _check(m, torch.float32, n, "exp_avg")
        _check(v, torch.float32, n, "exp_avg_sq")
        gptr, gkind = self._grad(g, n)
        return self.lib.sh_adamw_moments(m.data_ptr(), v.data_ptr(), gptr, gkind, n,
                                         ctypes.byref(coeffs.as_struct()), scale, self.threads)

    def merge_master(self, hi, lo, master):
        n = self._halves(hi, lo, (master, "master"))
        self.lib.sh_master_merge(hi.data_ptr(), lo.data_ptr(), master.data_ptr(), n, self.threads)

    def split_master(self, master, hi, lo):
        n = self._halves(hi, lo, (master, "master"))
        self.lib.sh_master_split(master.data_ptr(), hi.data_ptr(), lo.data_ptr(), n, self.threads)


def _cache_dir() -> Path:
    root = os.environ.get("STRONGHOLD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "stronghold")
    return Path(root)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def build_native_library(compiler: Optional[str] = None) -> Path:
    """Compile csrc/adamw.c (cached); raise RuntimeError with the compiler's output on failure."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha1("\0".join([_SOURCE.read_text(), *_FLAGS, version, platform.machine(),
                                  _cpu_model()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"adamw-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info(f"building the CPU AdamW kernel (once, a few seconds; cached in {target.parent})")
    # Build beside the target and rename, so concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        scratch = Path(tmp) / target.name
        result = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(scratch), "-lm"], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{result.stderr[-2000:]}")
        os.replace(scratch, target)
    return target


def default_threads() -> int:
    """All cores this process may use but one: the thread that launches GPU work (and autograd's)
    must not queue behind the optimizer's threads, or the GPU starves while the CPU updates. Under a cgroup CPU
    quota (a container's CPU limit), no more cores than this rank's part of the quota: threads beyond it are
    throttled, and a throttled update thread holds up the whole step."""
    from stronghold import cgroups
    from stronghold.engine.cores import local_ranks

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = cgroups.cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota / local_ranks(os.environ)[1])))
    return max(1, cores - 1)


_LIBRARY: Optional[ctypes.CDLL] = None


def load_kernel(threads: Optional[int] = None) -> AdamWKernel:
    """The native kernel where it builds, else the eager reference (with a warning)."""
    global _LIBRARY
    threads = threads or default_threads()
    try:
        if _LIBRARY is None:
            _LIBRARY = ctypes.CDLL(str(build_native_library()))
        return NativeAdamW(_LIBRARY, threads)
    except (RuntimeError, OSError) as err:
        warnings.warn(f"stronghold: native CPU AdamW unavailable ({err}); using the slower eager reference")
    return TorchAdamW(threads)
