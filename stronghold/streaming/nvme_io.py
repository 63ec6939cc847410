"""Whole-file reads and writes between page-aligned host buffers and files on a drive (the NVMe tier's I/O,
nvme.py), and the drive's measured rates.

The backend is a pool of threads doing `os.preadv` / `os.pwritev` (which release the GIL) on files opened with
O_DIRECT: the page cache would otherwise hold a second copy of every state byte, the very host memory the tier is
there to save, and the kernel's write-back would pick its own time. A file is split into CHUNK_BYTES requests, so
the pool keeps `threads` requests in flight: a queue depth the drive needs for its rated throughput. Where the
filesystem refuses O_DIRECT (tmpfs, some overlay filesystems) the files are opened buffered instead and `direct`
says so; every write is still complete before its buffer is reused (the request returns), never fsynced: the
files are scratch, rebuilt by every run.

DeepSpeed's async I/O op (libaio) is the other backend the tier could use; it is built only where libaio's headers
are installed (`aio_available`), and examples/bench/nvme_io.py measures it beside this one where it builds. A machine
without libaio can build it against examples/bench/libaio_shim (libaio's interface over the same system calls).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from stronghold.planning.plan_types import NVME_ALIGN

ALIGN = NVME_ALIGN
"""O_DIRECT needs the buffer address, the file offset and the length aligned to the logical block size: 4096
covers every drive (512 or 4096)."""
CHUNK_BYTES = 8 * 2 ** 20
"""One request: large enough that the per-request cost is small against its transfer, small enough that a block's
states (hundreds of MB) spread over every thread of the pool."""
DEFAULT_THREADS = 8
RATE_PROBE_BYTES = 256 * 2 ** 20
"""Written then read back once to measure a drive at start-up: past the drive's own write cache on most consumer
drives would need more, but a run re-measures nothing and the planner uses the rate only as a floor term."""
RATES_FILE = ".stronghold_nvme_rates.json"


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 host tensor of `nbytes` (a multiple of ALIGN) at a page-aligned address (an anonymous mapping)."""
    assert nbytes % ALIGN == 0 and nbytes > 0, nbytes
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


class Transfer:
    """The requests of one file transfer; `wait` returns when all are done and raises the first failure."""

    def __init__(self, futures: list[Future], after: tuple["Transfer", ...] = ()):
        self.futures = futures
        self.after = after

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        for future in self.futures:
            future.result()


DONE = Transfer([])


class DirectFiles:
    """Files under one directory, read and written whole by a thread pool (see the module docstring)."""

    def __init__(self, directory: Path, threads: int = DEFAULT_THREADS):
        self.directory = directory
        self.direct = _direct_supported(directory)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="stronghold-nvme")
        self.busy = Busy()

    def open(self, name: str, nbytes: int) -> int:
        """Create the file `name` of `nbytes` (a multiple of ALIGN, reading as zeros) with its space reserved
        (`reserve`), and remove its name at once: the descriptor keeps the data, and the drive gets its space back
        when the process ends however it ends (a SIGTERM or SIGKILL runs no clean-up, and a preempted job's states
        would fill the drive run after run)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        path = self.directory / name
        fd = os.open(path, flags, 0o600)
        try:
            reserve(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(path)
        return fd

    def read(self, fd: int, buffer: torch.Tensor, nbytes: int, after: tuple[Transfer, ...] = (),
             offset: int = 0) -> Transfer:
        """Fill buffer[:nbytes] from the file at `offset`, once every transfer in `after` is done."""
        return self._transfer(os.preadv, fd, buffer, nbytes, after, offset)

    def write(self, fd: int, buffer: torch.Tensor, nbytes: int, after: tuple[Transfer, ...] = (),
              offset: int = 0) -> Transfer:
        """Write buffer[:nbytes] to the file at `offset`, once every transfer in `after` is done."""
        return self._transfer(os.pwritev, fd, buffer, nbytes, after, offset)

    def _transfer(self, call, fd: int, buffer: torch.Tensor, nbytes: int, after: tuple[Transfer, ...],
                  offset: int) -> Transfer:
        assert nbytes % ALIGN == 0 and offset % ALIGN == 0 and buffer.data_ptr() % ALIGN == 0
        assert buffer.numel() >= nbytes
        view = memoryview(buffer.numpy())
        # The pool runs requests in submission order, so those of `after`, submitted earlier, have all started by
        # the time a request here waits for them: no request waits on one that has no thread.
        futures = [self.pool.submit(_request, call, fd, view[start:min(start + CHUNK_BYTES, nbytes)], offset + start,
                                    after, self.busy, self.directory) for start in range(0, nbytes, CHUNK_BYTES)]
        return Transfer(futures, after)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _libc_fallocate():
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).fallocate
    except (OSError, AttributeError):  # no libc here, or one without fallocate (not Linux)
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    function.restype = ctypes.c_int
    return function


FALLOCATE = _libc_fallocate()
"""fallocate(2), which fails where the filesystem cannot reserve space instead of emulating it by writing zeros (as
os.posix_fallocate does: minutes for tens of GB)."""


def reserve(fd: int, nbytes: int) -> None:
    """Allocate the file's `nbytes` on the drive now, so that a drive something else fills later fails here, at
    start-up, and not a state write hours into the run (OSError ENOSPC). Where the filesystem cannot (no fallocate:
    some network and overlay filesystems), a sparse file of that size, whose space the first writes take."""
    if FALLOCATE is not None:
        if FALLOCATE(fd, 0, 0, nbytes) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: reserving {nbytes} bytes for a state file")
    os.ftruncate(fd, nbytes)


class Busy:
    """Seconds during which at least one request was in flight: the drive's measured share of a step."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self.seconds = 0.0

    def reset(self) -> None:
        with self._lock:
            self.seconds = 0.0

    def __enter__(self):
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

    def __exit__(self, *exc):
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self.seconds += time.perf_counter() - self._since


def _request(call, fd: int, view: memoryview, offset: int, after: tuple[Transfer, ...], busy: Busy,
             directory: Path) -> None:
    for transfer in after:
        transfer.wait()
    done = 0
    with busy:
        while done < len(view):  # a short transfer is legal (a signal, a full queue): go on from where it stopped
            try:
                moved = call(fd, [view[done:]], offset + done)
            except OSError as err:
                what = "writing" if call is os.pwritev else "reading"
                raise OSError(err.errno, f"stronghold NVMe tier: {what} a block's optimizer states under {directory} "
                                         f"failed ({err.strerror}): the drive under \"nvme_path\" failed or is full. "
                                         "The run cannot go on without that state: resume from the last checkpoint "
                                         "once the drive works, or with nvme_path on another drive") from err
            if moved <= 0:
                raise OSError(errno.EIO, f"stronghold NVMe tier: a transfer moved {moved} bytes at offset "
                                         f"{offset + done} under {directory}")
            done += moved


def _direct_supported(directory: Path) -> bool:
    """Whether files under `directory` open with O_DIRECT (tmpfs and some overlay filesystems refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".stronghold_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    try:
        buffer = aligned_buffer(ALIGN)
        os.pwritev(fd, [memoryview(buffer.numpy())], 0)
        return True
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def aio_available() -> bool:
    """Whether DeepSpeed's async I/O op (libaio) can be built here."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # an accelerator without the builder, an import failure: no aio either way
        return False


def loaded_libaio() -> Optional[str]:
    """The path of the libaio this process has loaded (DeepSpeed's async I/O op links it), or None: which library the
    op's I/O went through, for a benchmark's record."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libaio" in line and "/" in line}
    except OSError:
        return None
    return min(paths) if paths else None


def measure_rates(directory: Path, nbytes: int = RATE_PROBE_BYTES, threads: int = DEFAULT_THREADS) -> dict:
    """Write then read `nbytes` through DirectFiles under `directory`: bytes per second each way, and whether
    O_DIRECT was used. Cached in RATES_FILE under `directory` (`cached_rates` reads it back)."""
    files = DirectFiles(directory, threads)
    buffer = aligned_buffer(aligned(nbytes))
    buffer.view(torch.float32).uniform_()  # not zeros: a drive may compress or dedupe
    fd = files.open(".stronghold_rate_probe", buffer.numel())  # nameless from here: nothing to remove after
    try:
        start = time.perf_counter()
        files.write(fd, buffer, buffer.numel()).wait()
        if not files.direct:
            os.fsync(fd)  # buffered: time the drive, not the page cache
        write_s = time.perf_counter() - start
        if not files.direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        files.read(fd, buffer, buffer.numel()).wait()
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        files.close()
    rates = {"read_bytes_per_s": buffer.numel() / read_s, "write_bytes_per_s": buffer.numel() / write_s,
             "direct": files.direct, "probe_bytes": buffer.numel(), "device": os.stat(directory).st_dev}
    try:
        (directory / RATES_FILE).write_text(json.dumps(rates))
    except OSError:
        pass  # a cache only: the next run measures again
    return rates


def cached_rates(directory: Path) -> Optional[dict]:
    """The rates `measure_rates` cached under `directory`, if they are for the same filesystem."""
    try:
        rates = json.loads((directory / RATES_FILE).read_text())
    except (OSError, ValueError):
        return None
    return rates if rates.get("device") == os.stat(directory).st_dev else None
