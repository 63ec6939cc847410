"""Data parallel on the CPU: 2 processes (gloo), each on its half of the global batch and its half of the
streamed blocks' host states, against one process training the same global batch (micro-batch doubled):
same parameters, checkpoints across world sizes, one node-shared working copy, clear errors for ranks
configured differently and for a rank that dies.

The two ranks are started once for the whole file (spawn, then importing torch, transformers and
DeepSpeed is most of the time) and run every scenario in sequence; the tests check what they wrote.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from stronghold.distributed.data_parallel import Averaging

from .helpers import BATCH, batches, ds_config, named_params, relative_error, run_steps, spawn_ranks, tiny_gpt2, tiny_llama

pytestmark = pytest.mark.slow  # two spawned ranks importing torch, transformers and DeepSpeed: minutes on 2 cores

WORLD, GAS, STEPS, SAVED_AT = 2, 2, 3, 2
"""Ranks; micro-steps per step; optimizer steps; the step after which the checkpoints are written."""
LR, CLIP = 3e-3, 0.5
"""Every step clips: the tiny models' global gradient norms are 1.2-3.5 at these settings."""
TOL = 1e-5
"""fp32: two ranks average the means of their halves where one process takes the mean of the whole batch,
the same sum in another order (~1e-7 per step), which Adam amplifies where a gradient is mostly noise;
the bar of the single-process equivalence tests (test_equivalence.py)."""
TIMEOUT_S = 240

MODELS = {
    "gpt2": lambda seed: tiny_gpt2(4, n_embd=64, seed=seed),
    "qwen2_tied": lambda seed: tiny_llama(4, tie=True, qwen2=True, seed=seed),
}


def _checkpointed_llama(seed: int):
    model = tiny_llama(4, seed=seed)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # HF's default
    return model


FACTORIES = {**MODELS, "llama_checkpointed": _checkpointed_llama}
"""MODELS, which every scenario loop runs, and the models of single scenarios."""


def _config(world: int, gas: int = GAS, **overrides) -> dict:
    config = ds_config(window=2, resident=1, gas=gas, clip=CLIP, lr=LR, **overrides)
    config["train_micro_batch_size_per_gpu"] = BATCH * WORLD // world  # the same global batch
    return config


def _data(rank: int, world: int, gas: int = GAS) -> list[dict]:
    """Each micro-step's global batch, this rank's share of it."""
    share = BATCH * WORLD // world
    return [{k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
            for batch in batches(STEPS * gas, batch=BATCH * WORLD)]


def _engine(model, world: int, gas: int = GAS, **overrides):
    import stronghold
    model.train()
    engine, _, _, _ = stronghold.initialize(model=model, config=_config(world, gas, **overrides))
    return engine


def _train(arch: str, rank: int, world: int, save_dir: Path | None = None, gas: int = GAS, promote: bool = False,
           **overrides) -> dict:
    """Train STEPS steps of `gas` micro-steps (the model built with seed `rank`: the broadcast must make it rank
    0's), saving after SAVED_AT; the final parameters and the last global norm. `promote`: block 1 becomes resident
    before the first step (as the placement promotes at the first forward) and block 2 after SAVED_AT steps."""
    engine = _engine(FACTORIES[arch](rank), world, gas, **overrides)
    runtime = engine.stronghold_runtime
    memory = _memory(runtime)
    if rank == 1:
        _delay_last_update(engine)
    data = _data(rank, world, gas)
    if promote:
        runtime.promote(2, 2)
    run_steps(engine, data[:SAVED_AT * gas])
    queue_passed = None
    if promote:  # a job that holds the CPU's queue: the promotion waits for block 2's own jobs, not for it
        gate = threading.Event()
        runtime.cpu.submit_after(lambda: gate.wait(120))
        runtime.promote(3, 2)
        queue_passed = not gate.is_set()
        gate.set()
    if save_dir is not None:
        runtime.host_bytes.reset_peak()
        memory.update(before_save=runtime.host_bytes.live)
        engine.save_checkpoint(save_dir)
        memory.update(save_peak=runtime.host_bytes.peak)
    run_steps(engine, data[SAVED_AT * gas:])
    memory.update(after_training=runtime.host_bytes.live)
    stores = runtime.stores.values()
    result = {"params": named_params(engine.module), "norm": engine.get_global_grad_norm(),
              "reduced": runtime.data_parallel is not None, "streamed": sorted(runtime.stores),
              # fp32 states, gradient buffers and accumulators this rank holds (elements)
              "state_numel": sum(b.numel() for s in stores for b in (s.master, s.exp_avg, s.exp_avg_sq, s.grad, s.accum)
                             if b is not None),
              "trainable_numel": sum(s.trainable_numel for s in stores),
              "host": engine.stronghold_report()["host"], "mapping": _shared_mapping(runtime), "memory": memory,
              "cores": sorted(os.sched_getaffinity(0)), "report_cores": engine.stronghold_report()["cores"],
              "collector": engine.stronghold_report()["garbage_collection"],
              "cached_parts": sorted(runtime.cached_parts), "queue_passed": queue_passed,
              "units_sharded": [unit.store.sharded for unit in runtime.cached.units.values()],
              "compile": engine.stronghold_report().get("compile")}
    engine.destroy()
    return result


def _memory(runtime) -> dict:
    """Host bytes of the streamed blocks' buffers after set-up (`steady`) and their peak during it, with the
    sizes the bounds are made of: the largest block's full (unsharded) state and trainable elements, and the
    full replica every rank built before sharding it until issue 11's second part."""
    from stronghold.planning.plan_bytes import store_bytes
    from stronghold.streaming.store import counts
    accumulate = runtime.accumulation_steps > 1
    full = [store_bytes([counts(s.entries)], runtime.compute_dtype.itemsize, accumulate).total
            for s in runtime.stores.values()]
    return {"setup_peak": runtime.host_bytes.peak, "steady": runtime.host_bytes.live, "block_full_bytes": max(full),
            "replica_bytes": sum(full), "block_trainable": max(s.trainable_numel for s in runtime.stores.values())}


def _bf16_setup(rank: int) -> dict:
    """A bf16 engine built from seed `rank`: every rank's fp32 master shard must be rank 0's (seed 0) original
    fp32 values, not their bf16 cast; the working copy their bf16 cast."""
    engine = _engine(MODELS["gpt2"](rank), WORLD, bf16=True)
    runtime = engine.stronghold_runtime
    reference = dict(MODELS["gpt2"](0).named_parameters())
    names = {id(p): n for n, p in engine.module.named_parameters()}
    masters_match = working_match = True
    for store in runtime.stores.values():
        expected = torch.cat([reference[names[id(e.param)]].detach().reshape(-1) for e in store.trainable])
        masters_match &= torch.equal(store.master, expected[store.shard_start:store.shard_stop])
        working_match &= torch.equal(store.working[:store.trainable_numel], expected.to(torch.bfloat16))
    result = {"memory": _memory(runtime), "masters_match": bool(masters_match), "working_match": bool(working_match)}
    engine.destroy()
    return result


def _delay_last_update(engine, seconds: float = 0.5) -> None:
    """This rank's CPU worker starts the last step's final updates `seconds` late, so the other rank's read
    of the parameters after the step (synchronize_host, then named_params) comes first unless it waits for
    every rank's shard of the node-shared copy, not only its own worker."""
    cpu = engine.stronghold_runtime.cpu
    finish_step, steps = cpu.finish_step, 0

    def late(coef, **kwargs):  # on this engine's optimizer only
        nonlocal steps
        steps += 1
        if steps == STEPS:
            cpu.submit_after(lambda: time.sleep(seconds))
        finish_step(coef, **kwargs)

    cpu.finish_step = late


def _shared_mapping(runtime) -> tuple[str, int] | None:
    """(device:inode, path) of this process's mapping of the node-shared working copy, from /proc/self/maps
    (the file is unlinked once every rank mapped it, so the inode is what identifies it)."""
    if runtime.data_parallel is None:
        return None
    path = runtime.data_parallel.shared.path
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == path:
            return f"{fields[3]}:{fields[4]}", path
    return None


def _resume(rank: int, world: int, load_dir: Path, **overrides):
    """A fresh engine (other init) that loads the checkpoint and trains the steps after SAVED_AT."""
    engine = _engine(MODELS["gpt2"](7 + rank), world, **overrides)
    engine.load_checkpoint(load_dir)
    run_steps(engine, _data(rank, world)[SAVED_AT * GAS:])
    return engine


def _failed_save(engine, path: Path) -> str | None:
    """Save into `path`, a file: rank 0's write fails."""
    path.touch()
    try:
        engine.save_checkpoint(path)
    except (OSError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _rank_env(rank: int, port: int) -> None:
    """What a launcher sets for one rank; the rendezvous store is the one `_spawn` hosts on `port`, so every
    rank connects to it as a client (torchrun's agent store)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")


def _worker(rank: int, out: str, port: int) -> None:
    _rank_env(rank, port)
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    out_dir = Path(out)
    results = {arch: _train(arch, rank, WORLD, out_dir / "dp_ckpt" if arch == "gpt2" else None) for arch in MODELS}
    engine = _resume(rank, WORLD, out_dir / "single_ckpt")
    results["resumed"] = named_params(engine.module)
    results["bf16"] = _bf16_setup(rank)
    results["bf16_train"] = _train("gpt2", rank, WORLD, bf16=True)
    results["bf16_compact"] = _train("gpt2", rank, WORLD, out_dir / "compact_ckpt", bf16=True, compact_master=True)
    results["gpt2_gas1"] = _train("gpt2", rank, WORLD, gas=1)
    # A promotion that drained the CPU's queue would meet the held job and raise at the stall timeout.
    results["promoted"] = _train("gpt2", rank, WORLD, promote=True, stall_timeout_s=30.0)
    results["cached"] = _train("gpt2", rank, WORLD, out_dir / "cached_ckpt", rest_placement="host")
    results["qwen2_cached"] = _train("qwen2_tied", rank, WORLD, rest_placement="host")
    from stronghold.integrations import compile as compile_module
    compile_module.BACKEND = "aot_eager"  # Dynamo and AOTAutograd without Inductor's C++ build (test_compile.py)
    results["compiled"] = _train("llama_checkpointed", rank, WORLD, compile=True)
    results["failed_save"] = _failed_save(engine, out_dir / "not_a_directory")
    engine.destroy()
    try:
        _engine(MODELS["gpt2"](0), WORLD, cpu_optimizer_threads=1 + rank)
        results["mismatch"] = None
    except ValueError as err:
        results["mismatch"] = str(err)
    import stronghold
    results["package"] = stronghold.__file__
    torch.save(results, out_dir / f"rank{rank}.pt")


def _dying_worker(rank: int, out: str, port: int) -> None:
    """Rank 1 exits (status 0, so the launcher leaves rank 0 running) after agreeing on step 1, before its
    updates of the streamed blocks are published: rank 0's next forward must fail naming it."""
    _rank_env(rank, port)
    torch.set_num_threads(1)
    engine = _engine(MODELS["gpt2"](0), WORLD)
    cpu = engine.stronghold_runtime.cpu
    if rank == 1:
        finish_step = cpu.finish_step

        def finish_then_die(coef, **kwargs):  # on this engine's optimizer only
            finish_step(coef, **kwargs)
            cpu.submit_after(lambda: os._exit(0))

        cpu.finish_step = finish_then_die
    data = _data(rank, WORLD)
    start = time.monotonic()
    try:
        run_steps(engine, data[:2 * GAS])
        outcome = None
    except Exception as err:  # noqa: BLE001 - what the survivor saw is the result
        outcome = f"{type(err).__name__}: {err}"
    torch.save({"error": outcome, "seconds": time.monotonic() - start}, Path(out) / f"dying{rank}.pt")
    os._exit(0)  # the peer is gone: skip the process group's teardown


def _spawn(out: Path, worker=_worker) -> None:
    """Run `worker` on WORLD processes; fail (and stop them) if they do not finish in TIMEOUT_S."""
    spawn_ranks(worker, (str(out),), WORLD, TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process first (its checkpoint is what the ranks resume from), then the ranks, then one process
    resuming from the ranks' checkpoint."""
    out = tmp_path_factory.mktemp("data_parallel")
    single = {arch: _train(arch, 0, 1, out / "single_ckpt" if arch == "gpt2" else None) for arch in MODELS}
    single["bf16_train"] = _train("gpt2", 0, 1, bf16=True)
    single["gpt2_gas1"] = _train("gpt2", 0, 1, gas=1)
    single["cached"] = _train("gpt2", 0, 1, rest_placement="host")
    single["qwen2_cached"] = _train("qwen2_tied", 0, 1, rest_placement="host")
    single["compiled"] = _train("llama_checkpointed", 0, 1)
    _spawn(out)
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    engine = _resume(0, 1, out / "dp_ckpt")
    resumed = named_params(engine.module)
    engine.destroy()
    engine = _resume(0, 1, out / "compact_ckpt", bf16=True)
    compact_resumed = named_params(engine.module)
    engine.destroy()
    engine = _resume(0, 1, out / "cached_ckpt", rest_placement="host")
    cached_resumed = named_params(engine.module)
    engine.destroy()
    return {"single": single, "ranks": ranks, "resumed_single": resumed, "compact_resumed": compact_resumed,
            "cached_resumed": cached_resumed, "out": out}


@pytest.mark.parametrize("arch", [*sorted(MODELS), "gpt2_gas1"])
def test_matches_one_process_on_the_global_batch(runs, arch):
    """With accumulation (the resident part reduced at the end of backward) and without (reduced as its
    gradients complete, resident_reduce.py)."""
    single, ranks = runs["single"][arch], [r[arch] for r in runs["ranks"]]
    assert single["norm"] > CLIP, "clipping triggers"
    assert not single["reduced"], "one process calls no collective"
    for rank in ranks:
        assert rank["reduced"] and rank["streamed"] == [1, 2, 3], "block 0 resident, 1-3 streamed and reduced"
        assert rank["norm"] == ranks[0]["norm"], "every rank sees the same global norm"
        assert relative_error(rank["params"], single["params"]) <= TOL
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"replicas differ at {name}"


def test_compiled_blocks_checkpointed_reentrantly_match_one_eager_process(runs):
    """HF's non-reentrant checkpointing of compiled blocks runs reentrant (integrations/reentrant.py): each block's
    gradients come out of the reentrant checkpoint's own backward, through the hooks that reduce them across ranks;
    the ranks equal one eager process with HF's checkpoint on the global batch."""
    single, ranks = runs["single"]["compiled"], [r["compiled"] for r in runs["ranks"]]
    assert single["compile"] is None
    for rank in ranks:
        assert rank["reduced"] and rank["compile"]["enabled"] and rank["compile"]["reentrant_calls"] > 0
        assert relative_error(rank["params"], single["params"]) <= TOL
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"replicas differ at {name}"


def test_blocks_promoted_before_and_between_steps_train_the_same(runs):
    """Every rank promotes the same blocks before the first step and between steps, the second time past a job that
    holds the CPU's queue (one node: the promotion waits for the promoted block's jobs only); a promoted block's rows
    stay in the node-shared copy unpublished, and the reads of the whole copy (each `run_steps` ends with one) wait only for
    the blocks still streamed. Training equals the ranks' run without promotion (the promoted blocks' updates move
    from the C kernel to torch's AdamW: rounding only)."""
    ranks = [r["promoted"] for r in runs["ranks"]]
    for rank in ranks:
        assert rank["reduced"] and rank["streamed"] == [3] and rank["queue_passed"]
        assert relative_error(rank["params"], runs["single"]["gpt2"]["params"]) <= TOL
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"replicas differ at {name}"


def test_bf16_training_matches_one_process_within_bf16_rounding(runs):
    """bf16 over STEPS steps with clipping and accumulation: the ranks reduce bf16 gradient halves where one
    process takes the whole batch's, so they differ by bf16 rounding, which Adam carries into the weights.
    The bound is bf16's own: the ranks may be no farther from the one-process bf16 run than that run is
    from the same training in fp32 (the size of bf16 rounding here). A lost or doubled shard is far above."""
    single, fp32 = runs["single"]["bf16_train"], runs["single"]["gpt2"]
    rounding = relative_error(single["params"], fp32["params"])
    assert 0 < rounding < 0.05
    ranks = [r["bf16_train"] for r in runs["ranks"]]
    for rank in ranks:
        assert rank["reduced"] and relative_error(rank["params"], single["params"]) <= rounding
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"bf16 replicas differ at {name}"


def test_compact_masters_on_two_ranks_train_as_full_ones_and_save_full_masters(runs):
    """Each rank keeps its shard's low halves beside its shard of the shared copy: training is the ranks' bf16 run
    with full masters but for the ulps a rounding tie moves (test_compact_master.py), and the checkpoint holds the
    full fp32 masters, from which one process without compact masters goes on as the ranks did."""
    single, fp32 = runs["single"]["bf16_train"], runs["single"]["gpt2"]
    rounding = relative_error(single["params"], fp32["params"])
    ranks = [r["bf16_compact"] for r in runs["ranks"]]
    for rank, full in zip(ranks, [r["bf16_train"] for r in runs["ranks"]]):
        assert rank["reduced"] and rank["state_numel"] < full["state_numel"], "no rank holds an fp32 master"
        # A tenth of bf16's own rounding here: the ties move masters by ulps; a lost shard or high half is far above.
        assert relative_error(rank["params"], full["params"]) <= rounding / 10
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"replicas differ at {name}"
    assert relative_error(runs["compact_resumed"], ranks[0]["params"]) <= rounding


@pytest.mark.parametrize("scenario", ["cached", "qwen2_cached"])
def test_parts_outside_the_blocks_on_the_host_match_one_process(runs, scenario):
    """"rest_placement" "host" on two ranks: the embeddings and head keep their fp32 states on the host, each rank
    its shard (their gradients reduce-scattered as a streamed block's), and train as one process does (GPT-2's
    untied head and Qwen2's tied one); the checkpoint continues on one process."""
    single = runs["single"][scenario]
    assert single["cached_parts"], "the one-process run keeps them on the host too"
    for rank in runs["ranks"]:
        result = rank[scenario]
        assert result["reduced"] and result["cached_parts"] == single["cached_parts"]
        assert result["units_sharded"] and all(result["units_sharded"])
        assert relative_error(result["params"], single["params"]) <= TOL
        assert result["norm"] == pytest.approx(single["norm"], rel=TOL)
    if scenario == "cached":
        assert relative_error(runs["cached_resumed"], single["params"]) <= TOL


def test_each_rank_holds_its_shard_of_the_host_states(runs):
    """fp32 states, gradient buffers and accumulators: the ranks' shards partition one process's buffers."""
    import stronghold
    single = runs["single"]
    for arch in MODELS:
        ranks = [r[arch] for r in runs["ranks"]]
        assert sum(r["state_numel"] for r in ranks) == single[arch]["state_numel"]
        # Equal shards of ceil(T / 2) per block, 5 buffers each: at most 5 elements per block over half.
        assert all(r["state_numel"] <= single[arch]["state_numel"] / 2 + 5 * 3 for r in ranks)
        host = [r["host"] for r in ranks]
        assert all(h["working_shared"] and h["local_ranks"] == WORLD for h in host)
        assert host[0]["working_bytes"] == single[arch]["host"]["working_bytes"]
        assert host[0]["node_bytes_estimate"] <= 1.01 * (single[arch]["host"]["rank_state_bytes"]
                                                         + single[arch]["host"]["working_bytes"])
    assert all(r["package"] == stronghold.__file__ for r in runs["ranks"]), "the ranks imported this checkout"


def test_set_up_and_save_hold_at_most_one_block_beyond_the_steady_state(runs):
    """Host bytes of the streamed blocks' buffers (pinned.HostMeter: this rank's mapping of the shared copy,
    its shards, and every transient of set-up and saves), each rank: set-up never exceeds the steady state
    plus one block's full state, nor does a save (rank 0 gathers one block at a time, the others send)."""
    for rank, result in enumerate(runs["ranks"]):
        for arch in MODELS:
            memory = result[arch]["memory"]
            # fp32: the master is the shared copy itself, so set-up has no transient at all; the bound is
            # the steady state + one block's working copy (4 N) + moments (8 T) + gradient buffer (4 T) +
            # accumulator (4 T), well under the full replica (3 such blocks) built before sharding it.
            assert memory["setup_peak"] <= memory["steady"] + memory["block_full_bytes"]
            assert memory["block_full_bytes"] < memory["replica_bytes"]
            assert memory["after_training"] == memory["steady"], "training allocates no host buffer"
        memory = result["gpt2"]["memory"]
        trainable = memory["block_trainable"]
        shard = -(-trainable // WORLD)
        growth = memory["save_peak"] - memory["before_save"]
        if rank == 0:
            # One block's fp32 master, exp_avg, exp_avg_sq per parameter (12 B per trainable element) plus
            # the padded gather buffer of one state kind (4 B x shard x world), and at times the previous
            # kind's too: the collective's own (gloo) thread may drop its reference to a buffer a moment
            # after the call returned (seen in about half the runs on a loaded 2-core box). Still at most one
            # block's full state (4 B x numel for the working copy + 16 B x trainable >= 12 T + 8 T).
            gather_buffer = 4 * shard * WORLD
            assert 12 * trainable <= growth <= 12 * trainable + 2 * gather_buffer <= memory["block_full_bytes"]
        else:
            assert growth <= 4 * shard, "a rank other than 0 holds at most its padded send buffer"
        bf16 = result["bf16"]
        assert bf16["masters_match"], "fp32 master shards are rank 0's original fp32 values"
        assert bf16["working_match"], "the shared working copy is rank 0's values in bf16"
        memory = bf16["memory"]
        # bf16: rank 0's fp32 values of one block are broadcast and each rank keeps its shard: 4 B x T at
        # most beyond the steady state (here less: the later blocks' shards outgrow the first's transient).
        assert memory["setup_peak"] - memory["steady"] <= 4 * memory["block_trainable"]
    print({f"rank{rank}": {arch: result[arch]["memory"] for arch in (*MODELS, "bf16")}
           for rank, result in enumerate(runs["ranks"])})


def test_each_rank_runs_on_its_share_of_the_cores(runs):
    """The launch says 2 local ranks (LOCAL_WORLD_SIZE): each rank took its share of the cores at initialize."""
    from stronghold.engine.cores import node_cpus
    node = set(node_cpus())
    if len(node) < WORLD or set(os.sched_getaffinity(0)) != node:
        pytest.skip("needs an unbound process on a node of 2 cores or more")
    first, second = (set(r["gpt2"]["cores"]) for r in runs["ranks"])
    assert not first & second and first | second == node
    for rank in runs["ranks"]:
        cores = rank["gpt2"]["report_cores"]
        assert cores["how"] == "share" and cores["cores"] == len(rank["gpt2"]["cores"])
        assert cores["cpu_adam_threads"] == max(1, cores["cores"] - 1)


def test_the_ranks_collect_garbage_at_the_same_steps(runs):
    """Each rank timed its own full collection and step (rank 1's step carries a delayed update), then all took the
    largest interval: their boundary collections fall on the same steps (collector.py)."""
    from stronghold.engine.collector import INCREMENTAL
    if INCREMENTAL:
        pytest.skip("Python 3.14+: \"auto\" leaves the interpreter's incremental collector alone")
    for arch in MODELS:
        first, second = (rank[arch]["collector"] for rank in runs["ranks"])
        assert first["mode"] == second["mode"] == "steps"
        assert first["interval_steps"] == second["interval_steps"] is not None, arch
        assert first["collections"] == second["collections"] >= 1, arch


def test_the_ranks_stream_from_one_shared_mapping(runs):
    for arch in MODELS:
        first, second = (r[arch]["mapping"] for r in runs["ranks"])
        assert first is not None and first == second, "both ranks map the same (unlinked) /dev/shm file"


def test_checkpoint_from_two_ranks_continues_on_one(runs):
    assert relative_error(runs["resumed_single"], runs["ranks"][0]["gpt2"]["params"]) <= TOL


def test_checkpoint_from_one_process_continues_on_two_ranks(runs):
    resumed = [r["resumed"] for r in runs["ranks"]]
    assert relative_error(resumed[0], runs["single"]["gpt2"]["params"]) <= TOL
    assert all(torch.equal(v, resumed[1][k]) for k, v in resumed[0].items())


def test_checkpoint_keeps_every_rank_rng(runs):
    meta = torch.load(runs["out"] / "dp_ckpt" / f"global_step{SAVED_AT}" / "meta.pt", weights_only=True)
    first, second = meta["rng_ranks"]
    assert torch.equal(meta["rng"]["torch"], first["torch"])
    assert not torch.equal(first["torch"], second["torch"]), "the ranks' models were built with different seeds"


def test_ranks_configured_differently_fail_on_every_rank(runs):
    for rank in runs["ranks"]:
        message = rank["mismatch"]
        assert message is not None
        assert "rank 1 has stronghold.cpu_optimizer_threads=2 where rank 0 has 1" in message


def test_a_rank_that_dies_makes_the_other_fail_naming_it(tmp_path):
    _spawn(tmp_path, _dying_worker)
    assert not (tmp_path / "dying1.pt").exists(), "rank 1 exited before reporting"
    survivor = torch.load(tmp_path / "dying0.pt", weights_only=True)
    assert survivor["error"] is not None and "never arrived from rank 1 (rank 1 exited)" in survivor["error"]
    assert survivor["seconds"] < 60, "failed promptly (the dead rank's pid is checked while waiting)"


def test_averaging_matches_deepspeed_allreduce_bucket():
    """DeepSpeed's stage 0 (engine.allreduce_bucket): sum, then x predivide/world after 1/predivide before;
    or 1/world before with prescale_gradients; or a plain sum when gradient_average is off."""
    assert (Averaging(world_size=4).before, Averaging(world_size=4).after) == (1.0, 0.25)
    predivided = Averaging(world_size=4, predivide=2.0)
    assert (predivided.before, predivided.after) == (0.5, 0.5)
    prescaled = Averaging(world_size=4, predivide=2.0, prescale=True)
    assert (prescaled.before, prescaled.after) == (0.25, 1.0)
    summed = Averaging(world_size=4, average=False)
    assert (summed.before, summed.after) == (1.0, 1.0)


def test_a_failed_save_on_rank_0_raises_on_every_rank(runs):
    first, second = (rank["failed_save"] for rank in runs["ranks"])
    assert first is not None and first.startswith("FileExistsError")
    assert second is not None and second.startswith("RuntimeError") and "rank 0: FileExistsError" in second
