"""The HF Trainer line on 2 ranks as users launch it (torchrun, accelerate launch), CPU and gloo: a plain Trainer
script plus `stronghold.initialize(model)` against the same script's plain DDP run on the same data.

Each run is a real launch of tests/hf/trainer_script.py (a new process group per launch; importing torch,
transformers and DeepSpeed in every rank is most of the time); rank 0 saves what it trained.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stronghold.engine.cores import node_cpus
from tests.engine.helpers import relative_error

pytestmark = pytest.mark.slow  # launched ranks, each importing torch, transformers and DeepSpeed

TOL = 1e-5
"""fp32: the engine reduce-scatters each streamed block's gradients and all-reduces the rest where DDP all-reduces
buckets: the same averages summed in another order (~1e-7 a step, amplified by Adam where a gradient is mostly noise);
the bar of the single-process Trainer test (test_trainer.py)."""
TIMEOUT_S = 300
SCRIPT = Path(__file__).with_name("trainer_script.py")
ROOT = Path(__file__).resolve().parents[2]

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    # accelerate's multi-process launch; on a machine without a GPU it runs the ranks on the CPU (gloo).
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
}


def _launch(launcher: str, out: Path, one_line: bool, *flags: str) -> dict:
    # The launcher sets every rank's variables; the single-process ones tests/conftest.py set must not leak in.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [*LAUNCHERS[launcher], str(SCRIPT), "--out", str(out), *(["--one-line"] if one_line else []), *flags]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{launcher} failed:\n{done.stderr[-4000:]}"
    result = torch.load(out / "result.pt", weights_only=True)
    result["ranks"] = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    return result


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory):
    return _launch("torchrun", tmp_path_factory.mktemp("plain"), one_line=False)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_one_line_on_two_ranks_matches_plain_ddp(plain_ddp, tmp_path, launcher):
    result = _launch(launcher, tmp_path, one_line=True)
    assert plain_ddp["world_size"] == 2 and plain_ddp["engine"] == "DistributedDataParallel"
    assert result["world_size"] == 2 and result["engine"] == "StrongholdEngine"
    assert min(plain_ddp["logs"]["grad_norm"]) > 0.05, "clipping triggers at every step"
    assert relative_error(result["params"], plain_ddp["params"]) <= TOL
    for key in ("loss", "grad_norm"):
        assert result["logs"][key] == pytest.approx(plain_ddp["logs"][key], rel=TOL), key
    # Each rank ran on its own share of the node's cores, with no flag (engine/cores.py).
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2 and cores == sorted(node_cpus()):  # this test runs unbound on a node of 2 cores or more
        first, second = (set(rank["cores"]) for rank in result["ranks"])
        assert not first & second and first | second == set(cores)
        assert all(rank["report_cores"]["how"] == "share" for rank in result["ranks"])


def test_one_line_with_the_rest_on_the_host_matches_plain_ddp(plain_ddp, tmp_path):
    """The embeddings' and head's fp32 states on the host, each rank its shard ("rest_placement" "host"), through the
    one line under torchrun: the same training as plain DDP."""
    result = _launch("torchrun", tmp_path, True, "--rest-on-host")
    assert all(rank["cached_parts"] == ["input", "output"] for rank in result["ranks"])
    assert relative_error(result["params"], plain_ddp["params"]) <= TOL
    for key in ("loss", "grad_norm"):
        assert result["logs"][key] == pytest.approx(plain_ddp["logs"][key], rel=TOL), key
