"""What a new user meets first: `stronghold.initialize` in a plain `python` process, a quiet start, messages
through logging, and nothing left behind in /dev/shm."""
from __future__ import annotations

import ast
import contextlib
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os
    import torch
    import stronghold
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=16, vocab_size=96,
                                       bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name names no loss; transformers warns otherwise
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
              "stronghold": {"window_size": 2, "resident_blocks": 1, "kernels": False}}
    engine, *_ = stronghold.initialize(model=model, config=config)
    for _ in range(2):
        ids = torch.randint(0, 96, (2, 16))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    print("trained", engine.global_steps, "steps; port", os.environ["MASTER_PORT"])
    engine.destroy()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_buffer(port) -> Path:
    """DeepSpeed's CPU all-reduce buffer of rank 0 for this master port (csrc/cpu/comm/shm.cpp's name)."""
    return Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (the GPU machine has its own launch tests)")
@pytest.mark.slow  # a fresh interpreter importing DeepSpeed, per launch
@pytest.mark.parametrize("launch", ["plain", "launcher"])
def test_a_script_trains_quietly_in_its_own_process_and_leaves_no_shm(tmp_path, launch):
    """`python script.py` with a clean environment (no RANK, no DS_ACCELERATOR, no mpi4py installed): DeepSpeed
    alone would try MPI discovery and fail. "launcher": the variables DeepSpeed's launcher sets for one process
    (LOCAL_SIZE among them, under which DeepSpeed's shared-memory op would create its /dev/shm buffer and
    never remove it). Either way: two steps, no warning, no compiled shm op, no buffer left."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "PYTHONPATH": str(ROOT)}
    if "STRONGHOLD_CACHE" in os.environ:
        env["STRONGHOLD_CACHE"] = os.environ["STRONGHOLD_CACHE"]
    if launch == "launcher":
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()), DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "trained 2 steps" in done.stdout
    buffer = _shm_buffer(done.stdout.split("port")[-1].strip())
    left = buffer.exists()
    buffer.unlink(missing_ok=True)  # so a failure here leaves nothing either
    assert not left
    assert "shm_comm" not in output
    noisy = [line for line in output.splitlines() if "warn" in line.lower()]
    assert noisy == []


def test_shm_op_is_off_only_inside_the_block():
    import deepspeed.ops

    from stronghold.engine.launch import SHM_COMM_OP, deepspeed_comm_without_shm
    ops = deepspeed.ops.__compatible_ops__
    before = dict(ops)
    with deepspeed_comm_without_shm():
        assert ops[SHM_COMM_OP] is False
    assert ops == before


def test_single_process_env_leaves_launches_alone(monkeypatch):
    from stronghold.engine.launch import single_process_env
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # mpirun: DeepSpeed's MPI discovery maps it
    single_process_env()
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    assert int(os.environ["MASTER_PORT"]) > 0


# Logging ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def root_handlers(*handlers):
    """The root logger with only `handlers` (none: a script that configured no logging); pytest puts its
    capture handler there for each test's call, so this runs inside the test."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers[:] = list(handlers)
    try:
        yield
    finally:
        root.handlers[:] = saved


def test_package_info_is_printed_when_the_application_configured_no_logging(capsys):
    with root_handlers():
        logging.getLogger("stronghold.engine.engine").info("placement at start-up: a table")
        logging.getLogger("stronghold.config").warning("a misspelt key")
    err = capsys.readouterr().err
    assert err.splitlines() == ["stronghold: placement at start-up: a table", "stronghold: warning: a misspelt key"]


def test_package_records_go_to_the_applications_handlers_once(capsys):
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    with root_handlers(Collect()):
        logging.getLogger("stronghold.engine.engine").info("placement at start-up: a table")
    assert records == ["placement at start-up: a table"]
    assert capsys.readouterr().err == ""  # the package's own handler stays silent


def test_no_print_in_the_package():
    """Messages inside the package go through logging (the application decides where they go)."""
    calls = []
    for path in sorted((ROOT / "stronghold").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []


def test_cpu_adamw_build_is_announced_once(tmp_path, monkeypatch, caplog):
    from stronghold.optim import cpu_adam
    monkeypatch.setenv("STRONGHOLD_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="stronghold"):
        first = cpu_adam.build_native_library()
        second = cpu_adam.build_native_library()
    assert first == second and first.parent == tmp_path
    announced = [r.getMessage() for r in caplog.records if "building the CPU AdamW kernel" in r.getMessage()]
    assert len(announced) == 1  # before the compile, and not again once it is cached


# LR schedulers -------------------------------------------------------------------------------------------------
WARMUPS = [
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 9, "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}),
    ("WarmupCosineLR", {"total_num_steps": 9, "warmup_min_ratio": 0.1, "warmup_num_steps": 3}),
    ("WarmupLR", {"warmup_max_lr": 1e-2, "warmup_num_steps": 5, "last_batch_iteration": 2}),  # a resumed schedule
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3}),
]


@pytest.mark.parametrize("name,params", WARMUPS)
def test_warmup_schedulers_are_deepspeeds_without_the_warning(name, params):
    """The engine's scheduler against DeepSpeed's own construction: the optimizer's rates after construction and
    after each step, and the saved state, are identical; DeepSpeed's logger gets no warning from ours."""
    from deepspeed.runtime import lr_schedules
    from deepspeed.utils import logger as ds_logger

    from stronghold.engine.engine import scheduler_from_config

    def optimizer():
        params_ = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
        return torch.optim.AdamW([{"params": params_[:1]}, {"params": params_[1:], "lr": 5e-3}], lr=2e-3)

    def construct(make):
        warned = []

        class Collect(logging.Handler):
            def emit(self, record):
                warned.append(record.getMessage())

        handler, level = Collect(logging.WARNING), ds_logger.level
        ds_logger.addHandler(handler)
        ds_logger.setLevel(logging.WARNING)  # tests/engine/helpers quiets DeepSpeed to errors
        try:
            return make(), warned
        finally:
            ds_logger.removeHandler(handler)
            ds_logger.setLevel(level)

    theirs_opt, ours_opt = optimizer(), optimizer()
    theirs, theirs_warned = construct(lambda: getattr(lr_schedules, name)(theirs_opt, **params))
    ours, ours_warned = construct(lambda: scheduler_from_config(
        name, params, ours_opt, lambda: getattr(lr_schedules, name)(ours_opt, **params)))
    fresh_warmup = name.startswith("Warmup") and "last_batch_iteration" not in params
    assert len(theirs_warned) == fresh_warmup  # DeepSpeed's own constructor reads its rate before its start
    assert ours_warned == []
    assert type(ours) is type(theirs)
    for _ in range(12):
        assert [g["lr"] for g in ours_opt.param_groups] == [g["lr"] for g in theirs_opt.param_groups]
        ours.step()
        theirs.step()
    assert ours.state_dict() == theirs.state_dict()
    assert ours.get_last_lr() == theirs.get_last_lr()


def test_deepspeeds_throughput_timer_does_not_synchronize_the_device_unless_the_config_says_so():
    # DeepSpeed's default timer synchronizes the whole device at every forward and step(), side streams included.
    import stronghold
    from stronghold.engine.launch import unsynchronized_timer

    from .helpers import ds_config, tiny_gpt2

    engine, *_ = stronghold.initialize(model=tiny_gpt2(2), config=ds_config())
    assert engine.tput_timer.config.enabled and not engine.tput_timer.config.synchronized
    asked = {**ds_config(), "timers": {"throughput": {"synchronized": True}}}
    engine, *_ = stronghold.initialize(model=tiny_gpt2(2), config=asked)
    assert engine.tput_timer.config.synchronized
    assert unsynchronized_timer(asked) == asked and "timers" not in ds_config()
