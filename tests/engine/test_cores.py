"""Each local rank's share of the node's cores (engine/cores.py): the pure decision, the sysfs readers on a fake
tree, and the affinity a process ends up with when a launch's variables say it is one of several local ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

from stronghold.engine.cores import (core_shares, local_ranks, numa_nodes, parse_cpu_list, physical_cores, plan_cores,
                                     worker_cores)

ROOT = Path(__file__).resolve().parents[2]


def _check_partition(shares, cpus):
    for a, b in combinations(shares, 2):
        assert not set(a) & set(b), f"shares overlap: {a} {b}"
    assert sorted(c for share in shares for c in share) == sorted(cpus), "shares cover the cores"


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == frozenset()


@pytest.mark.parametrize("cpus,ranks", [(32, 2), (32, 3), (32, 8), (16, 5), (7, 7), (2, 2), (128, 6)])
def test_shares_are_disjoint_cover_and_differ_by_at_most_one(cpus, ranks):
    shares = core_shares(ranks, range(cpus))
    _check_partition(shares, range(cpus))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(share == tuple(range(share[0], share[-1] + 1)) for share in shares), "contiguous"


def test_shares_follow_numa_nodes():
    """Two nodes whose CPUs interleave in numbering (0-15,32-47 and 16-31,48-63, with hyperthread siblings i and
    i + 32): two ranks get one node each, four ranks half a node each, and siblings stay together."""
    nodes = [set(range(0, 16)) | set(range(32, 48)), set(range(16, 32)) | set(range(48, 64))]
    cores = [{i, i + 32} for i in range(32)]
    two = core_shares(2, range(64), nodes, cores)
    _check_partition(two, range(64))
    assert [set(share) for share in two] == nodes
    four = core_shares(4, range(64), nodes, cores)
    _check_partition(four, range(64))
    for share in four:
        assert sum(set(share) <= node for node in nodes) == 1, "a quarter lies on one node"
        assert all(c + 32 in share for c in share if c < 32), "a physical core's siblings stay together"
    assert len({len(share) for share in four}) == 1


def test_uneven_split_keeps_every_core_and_siblings():
    cores = [{i, i + 4} for i in range(4)]  # 4 physical cores, 8 CPUs
    three = core_shares(3, range(8), (), cores)
    _check_partition(three, range(8))
    assert [len(share) for share in three] == [4, 2, 2]
    eight = core_shares(8, range(8), (), cores)  # more ranks than physical cores: the siblings are split
    _check_partition(eight, range(8))


def test_more_ranks_than_cpus_share_round_robin():
    assert core_shares(3, [4, 5]) == [(4,), (5,), (4,)]


def test_plan_respects_a_launcher_affinity_and_splits_otherwise():
    node = range(8)
    bound = plan_cores(1, 2, {4, 5, 6, 7}, node)
    assert bound.how == "launcher" and bound.cores == (4, 5, 6, 7) and not bound.changes
    shared = [plan_cores(rank, 2, node, node) for rank in range(2)]
    assert [p.how for p in shared] == ["share", "share"]
    _check_partition([p.cores for p in shared], node)
    alone = plan_cores(0, 1, {2, 3}, node)
    assert alone.how == "all" and alone.cores == (2, 3)
    assert plan_cores(3, 2, node, node).how == "all", "a rank the launch does not account for keeps its cores"
    numa = plan_cores(1, 2, node, node, nodes=[range(4), range(4, 8)])
    assert numa.numa_nodes == (1,) and "NUMA node 1" in numa.describe() and "4-7" in numa.describe()


def test_worker_keeps_off_the_launching_core():
    assert worker_cores((3, 1, 2, 0), threads=3) == (1, 2, 3)
    assert worker_cores((0, 1, 2, 3), threads=4) == (0, 1, 2, 3), "more threads than the rest: all cores"
    assert worker_cores((5,), threads=1) == (5,)


def test_local_ranks_from_each_launcher():
    assert local_ranks({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}) == (1, 4)  # torchrun, accelerate
    assert local_ranks({"LOCAL_RANK": "1", "LOCAL_SIZE": "2"}) == (1, 2)  # deepspeed's launcher
    assert local_ranks({}) == (0, 1)


def test_sysfs_readers(tmp_path):
    for index, cpus in enumerate(["0-1,4-5", "2-3,6-7"]):
        (tmp_path / "node" / f"node{index}").mkdir(parents=True)
        (tmp_path / "node" / f"node{index}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "node" / "possible").write_text("0-1\n")
    for cpu in range(8):
        topology = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        topology.joinpath("thread_siblings_list").write_text(f"{cpu % 4},{cpu % 4 + 4}\n")
    assert numa_nodes(tmp_path / "node") == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    assert physical_cores(range(8), tmp_path / "cpu") == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    assert physical_cores([0, 1], tmp_path / "cpu") == [{0}, {1}], "siblings outside the set are left out"


PROBE = """
import json, os, sys, threading
import torch
if os.environ.get("PROBE_INDUCTOR_FIRST") == "1":
    import torch._inductor.config  # a script's import that decides the compile pool before the share is set
from stronghold.engine.cores import share_cores
event = threading.Event()
before = threading.Thread(target=event.wait)
before.start()  # a thread that exists before the share is set up
plan = share_cores()
result = {"how": plan.how, "cores": sorted(os.sched_getaffinity(0)), "thread": sorted(os.sched_getaffinity(before.native_id)),
          "torch_threads": torch.get_num_threads()}
import torch._inductor.config
result["compile_threads"] = torch._inductor.config.compile_threads
event.set()
print(json.dumps(result))
"""


def _probe(env: dict, pin: list[int] | None = None) -> dict:
    launch = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")
    environment = {k: v for k, v in os.environ.items() if k not in launch}
    environment.update(env, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-c", PROBE]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120,
                          preexec_fn=(lambda: os.sched_setaffinity(0, pin)) if pin else None)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_local_ranks_get_disjoint_shares_on_every_thread():
    from stronghold.engine.cores import node_cpus
    node = sorted(node_cpus())
    if sorted(os.sched_getaffinity(0)) != node:
        pytest.skip("this test process is bound to part of the node already")
    ranks = [_probe({"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}) for r in range(2)]
    assert all(r["how"] == "share" and r["thread"] == r["cores"] for r in ranks), ranks
    assert all(r["torch_threads"] <= len(r["cores"]) for r in ranks), "torch's threads fit the share"
    assert all(r["compile_threads"] <= len(r["cores"]) for r in ranks), "so does Inductor's compile pool"
    early = [_probe({"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "PROBE_INDUCTOR_FIRST": "1"}) for r in range(2)]
    assert all(r["compile_threads"] <= len(r["cores"]) for r in early), "also when decided before the share"
    said = _probe({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TORCHINDUCTOR_COMPILE_THREADS": str(len(node))})
    assert said["compile_threads"] == len(node), "TORCHINDUCTOR_COMPILE_THREADS is the user's word"
    _check_partition([r["cores"] for r in ranks], node)
    kept = _probe({"LOCAL_RANK": "0", "LOCAL_SIZE": "2"}, pin=node[-1:])
    assert kept["how"] == "launcher" and kept["cores"] == node[-1:], "a launcher's binding is kept"
    told = _probe({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "2"})
    assert told["how"] == "share" and told["torch_threads"] == 2, "OMP_NUM_THREADS is the user's word"
