"""Data parallel across nodes on the CPU (gloo): 2 simulated nodes x 2 ranks, each node with its own node-shared
working copy (as two hosts would have: the launcher's node number GROUP_RANK tells the nodes apart, nodes.py),
against one process training the same global batch; a checkpoint saved at 4 ranks continues on 1 process and on
2 ranks (2 nodes x 1) equal to the one-process run.

Each layout is one spawn of its ranks (importing torch, transformers and DeepSpeed is most of the time); the tests
check what they wrote.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from stronghold.distributed.nodes import layout_of

pytestmark = pytest.mark.slow  # four gloo ranks, each importing torch and DeepSpeed: a minute on 2 cores

from .helpers import BATCH, batches, ds_config, named_params, relative_error, run_steps, spawn_ranks, tiny_gpt2

NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
GAS, STEPS, SAVED_AT = 2, 5, 3
"""Micro-steps per step; optimizer steps; the step after which the 4 ranks save."""
LR, CLIP = 3e-3, 0.5
"""Every step clips: the tiny model's global gradient norms are 1.2-3.5 at these settings."""
TOL = 1e-5
"""fp32: 4 ranks average the means of their quarters where one process takes the mean of the whole batch, the same
sum in another order (~1e-7 a step), which Adam amplifies where a gradient is mostly noise (test_data_parallel.py)."""
TIMEOUT_S = 300


def _model(seed: int):
    return tiny_gpt2(4, n_embd=64, seed=seed)


def _engine(model, world: int, **extra):
    import stronghold
    config = ds_config(window=2, resident=1, gas=GAS, clip=CLIP, lr=LR, **extra)
    config["train_micro_batch_size_per_gpu"] = BATCH * WORLD // world  # the same global batch
    model.train()
    return stronghold.initialize(model=model, config=config)[0]


def _data(rank: int, world: int) -> list[dict]:
    """Each micro-step's global batch, this rank's share of it."""
    share = BATCH * WORLD // world
    return [{k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
            for batch in batches(STEPS * GAS, batch=BATCH * WORLD)]


def _shared_inode(runtime) -> str | None:
    """device:inode of this process's mapping of its node's shared working copy (/proc/self/maps)."""
    path = runtime.data_parallel.shared.path
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == path:
            return f"{fields[3]}:{fields[4]}"
    return None


def _worker(rank: int, out: str, port: int, world: int, local: int) -> None:
    """One rank of `world // local` nodes of `local` ranks: with 4 ranks train and save midway; with fewer, resume
    from the 4 ranks' checkpoint."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % local), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local),
                      GROUP_RANK=str(rank // local), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    out_dir = Path(out)
    data = _data(rank, world)
    if world == WORLD:
        engine = _engine(_model(rank), world)  # seeded by rank: the start-up must make it rank 0's
        run_steps(engine, data[:SAVED_AT * GAS])
        engine.save_checkpoint(out_dir / "ckpt4")
        run_steps(engine, data[SAVED_AT * GAS:])
    else:
        engine = _engine(_model(7 + rank), world)
        engine.load_checkpoint(out_dir / "ckpt4")
        run_steps(engine, data[SAVED_AT * GAS:])
    runtime = engine.stronghold_runtime
    stores = runtime.stores.values()
    result = {"params": named_params(engine.module), "norm": engine.get_global_grad_norm(),
              "nodes": runtime.data_parallel.nodes.nodes, "inode": _shared_inode(runtime),
              "host": engine.stronghold_report()["host"],
              "state_numel": sum(b.numel() for s in stores for b in (s.master, s.exp_avg, s.exp_avg_sq))}
    engine.destroy()
    if world == WORLD:  # the embeddings and head with their states on the host: sharded over the 4 ranks too
        engine = _engine(_model(rank), world, rest_placement="host")
        run_steps(engine, data)
        result["cached"] = {"params": named_params(engine.module),
                            "cached_parts": sorted(engine.stronghold_runtime.cached_parts)}
        engine.destroy()
    torch.save(result, out_dir / f"w{world}-rank{rank}.pt")


def _spawn(out: Path, world: int, local: int) -> list[dict]:
    """Run `_worker` on `world` processes; their results, or a failure if they do not finish within TIMEOUT_S."""
    spawn_ranks(_worker, (str(out), world, local), world, TIMEOUT_S)
    return [torch.load(out / f"w{world}-rank{rank}.pt", weights_only=True) for rank in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode")
    single = _engine(_model(0), 1)
    data = _data(0, 1)
    run_steps(single, data)
    reference = {"params": named_params(single.module), "norm": single.get_global_grad_norm(),
                 "state_numel": sum(b.numel() for s in single.stronghold_runtime.stores.values()
                                    for b in (s.master, s.exp_avg, s.exp_avg_sq))}
    single.destroy()
    cached = _engine(_model(0), 1, rest_placement="host")
    run_steps(cached, data)
    reference["cached"] = named_params(cached.module)
    cached.destroy()
    four = _spawn(out, WORLD, LOCAL)
    two = _spawn(out, 2, 1)
    resumed = _engine(_model(9), 1)
    resumed.load_checkpoint(out / "ckpt4")
    run_steps(resumed, data[SAVED_AT * GAS:])
    one = named_params(resumed.module)
    resumed.destroy()
    return {"single": reference, "four": four, "two": two, "one": one}


def test_two_nodes_match_one_process_on_the_global_batch(runs):
    single, four = runs["single"], runs["four"]
    assert single["norm"] > CLIP, "clipping triggers"
    for rank in four:
        assert rank["nodes"] == NODES and rank["norm"] == four[0]["norm"], "every rank sees the same global norm"
        assert relative_error(rank["params"], single["params"]) <= TOL
    for name, value in four[0]["params"].items():
        assert all(torch.equal(value, rank["params"][name]) for rank in four[1:]), f"replicas differ at {name}"


def test_parts_outside_the_blocks_on_the_host_match_one_process_across_nodes(runs):
    for rank in runs["four"]:
        assert rank["cached"]["cached_parts"] == ["input", "output"]
        assert relative_error(rank["cached"]["params"], runs["single"]["cached"]) <= TOL


def test_each_node_has_its_own_shared_copy_and_each_rank_a_quarter_of_the_states(runs):
    inodes = [rank["inode"] for rank in runs["four"]]
    assert None not in inodes
    assert inodes[0] == inodes[1] and inodes[2] == inodes[3], "a node's ranks map one copy"
    assert inodes[0] != inodes[2], "the nodes' copies are separate"
    assert all(rank["host"]["local_ranks"] == LOCAL and rank["host"]["working_shared"] for rank in runs["four"])
    total = runs["single"]["state_numel"]
    assert sum(rank["state_numel"] for rank in runs["four"]) == total, "fp32 states sharded over all 4 ranks"
    assert all(rank["state_numel"] <= total / WORLD + 3 * 3 for rank in runs["four"])


def test_a_checkpoint_of_four_ranks_continues_on_one_process_and_on_two_nodes(runs):
    single = runs["single"]["params"]
    assert relative_error(runs["one"], single) <= TOL
    two = runs["two"]
    assert all(rank["nodes"] == 2 for rank in two), "2 nodes of 1 rank each"
    for rank in two:
        assert relative_error(rank["params"], single) <= TOL
    assert all(torch.equal(v, two[1]["params"][k]) for k, v in two[0]["params"].items())


def test_node_layout_from_the_ranks_identities():
    layout = layout_of(["a", "a", "b#1", "b#1"])
    assert layout.nodes == ((0, 1), (2, 3)) and layout.local_world == 2
    assert layout.column(1) == (1, 3) and layout.local_rank(3) == 1 and layout.node_of(2) == 1
    interleaved = layout_of(["a", "b", "a", "b"])  # a launcher that numbers ranks round-robin over nodes
    assert interleaved.nodes == ((0, 2), (1, 3)) and interleaved.column(0) == (0, 1)
    with pytest.raises(ValueError, match="as many ranks on every node"):
        layout_of(["a", "a", "b"])
