"""examples/bench/libaio_shim: libaio's interface over the Linux AIO system calls, for machines without libaio (the
GPU machines' image), so that DeepSpeed's async_io op and ZeRO-Infinity's NVMe offload build there. Its structures are
checked against the kernel's header when it compiles (libaio.c); here its calls move bytes to and from a file, and
DeepSpeed's op, built against it, runs ZeRO-Infinity with parameters and optimizer states on a drive."""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_fakes import ROOT

from examples.bench.harness import RENDEZVOUS

BUILD = Path(ROOT) / "examples" / "bench" / "libaio_shim" / "build.sh"


def build(into: Path) -> dict:
    """The shim built into `into`; the environment build.sh prints, applied to a copy of this one."""
    out = subprocess.run(["bash", str(BUILD), str(into)], capture_output=True, text=True, check=True)
    script = out.stdout + "\nenv -0\n"
    dump = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
    return dict(item.split("=", 1) for item in dump.decode().split("\0") if "=" in item)


class Common(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("nbytes", ctypes.c_ulong), ("offset", ctypes.c_longlong),
                ("reserved2", ctypes.c_longlong), ("flags", ctypes.c_uint), ("resfd", ctypes.c_uint)]


class Iocb(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("key", ctypes.c_uint), ("aio_rw_flags", ctypes.c_int),
                ("aio_lio_opcode", ctypes.c_short), ("aio_reqprio", ctypes.c_short), ("aio_fildes", ctypes.c_int),
                ("c", Common)]


class Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("res", ctypes.c_long), ("res2", ctypes.c_long)]


def test_the_shims_calls_write_and_read_a_file(tmp_path):
    env = build(tmp_path / "shim")
    lib = ctypes.CDLL(str(tmp_path / "shim" / "libaio.so"))
    assert env["LIBRARY_PATH"].split(":")[0] == str(tmp_path / "shim")
    context = ctypes.c_void_p(12345)  # io_queue_init clears it: the kernel refuses a context that is not zero
    assert lib.io_queue_init(4, ctypes.byref(context)) == 0 and context.value
    path = tmp_path / "file"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        payload = bytes(range(256)) * 16
        out, back = ctypes.create_string_buffer(payload, len(payload)), ctypes.create_string_buffer(len(payload))
        for opcode, buffer in ((1, out), (0, back)):  # IO_CMD_PWRITE, then IO_CMD_PREAD
            iocb = Iocb(data=7, aio_lio_opcode=opcode, aio_fildes=fd,
                        c=Common(buf=ctypes.addressof(buffer), nbytes=len(payload), offset=4096))
            assert lib.io_submit(context, ctypes.c_long(1), ctypes.byref(ctypes.pointer(iocb))) == 1
            event = Event()
            assert lib.io_pgetevents(context, ctypes.c_long(1), ctypes.c_long(1), ctypes.byref(event), None, None) == 1
            assert (event.res, event.data, event.obj) == (len(payload), 7, ctypes.addressof(iocb))
        assert back.raw == payload and os.pread(fd, len(payload), 4096) == payload
        bad = Iocb(aio_lio_opcode=0, aio_fildes=-1, c=Common(buf=ctypes.addressof(back), nbytes=16))
        assert lib.io_submit(context, ctypes.c_long(1), ctypes.byref(ctypes.pointer(bad))) == -9  # -EBADF, as libaio
    finally:
        os.close(fd)
        assert lib.io_queue_release(context) == 0


@pytest.mark.slow
def test_zero_infinity_trains_with_its_states_on_a_drive_through_the_shim(tmp_path):
    """The bench's ZeRO-Infinity point (parameters and optimizer states offloaded to NVMe) on the CPU, DeepSpeed's
    async_io op built against the shim (or taken from DeepSpeed's op cache): it trains, its files are on the drive,
    and the record names the libaio the process loaded."""
    pytest.importorskip("deepspeed")
    env = build(tmp_path / "shim")
    drive = tmp_path / "drive"
    drive.mkdir()
    argv = [sys.executable, "-m", "examples.bench.run_one", "--system", "zero_infinity_nvme", "--nvme-path", str(drive),
            "--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2",
            "--accumulation", "2", "--gpu-cap-gb", "none", "--warmup-steps", "1", "--timed-steps", "2"]
    # Without this process's rendezvous: an engine built earlier here still listens on its MASTER_PORT.
    env = {key: value for key, value in env.items() if key not in RENDEZVOUS}
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                         env={**env, "DS_ACCELERATOR": "cpu"})
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"') and '"result"' in line]
    assert lines, out.stderr[-3000:]
    result = lines[-1]
    assert result["error"] is None, result.get("error_detail")
    assert result["loss_last"] < result["loss_first"]
    assert result["libaio"] and "libaio" in result["libaio"]
    assert any(path.is_file() for path in drive.rglob("*")), "ZeRO-Infinity's swap files are on the drive"
