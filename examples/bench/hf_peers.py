"""The HF Trainer point with stronghold's one line and with each peer a user would pick instead, one record each.

    python -m examples.bench.hf_peers --peer torchao --arch llama --hidden 4096 --intermediate 14336 --layers 32 \\
        --heads 32 --kv-heads 8 --vocab 128256 --seq 2048 --batch 1 --accumulation 8 --bf16 --gradient-checkpointing \\
        --gpu-memory-limit-gb 24 --steps 5 --warmup-steps 1 --time-limit-s 100 --json OUT.jsonl

The flags are examples/hf_trainer.py's (same names, same Trainer arguments, same byte-corpus data) plus `--peer`
(hf_peer_setup.py: stronghold, plain, torchao, torchao_accumulate, fsdp2, zero3_offload, zenflow) and the limits.
The peers live here rather than in hf_trainer.py, which stays the script a user copies: one line added to a plain
Trainer script.
Every peer trains the bench's model of that shape with its seeded init (model.py) and runs under the same GPU cap
(`--gpu-memory-limit-gb`: torch.cuda.set_per_process_memory_fraction, set first; stronghold is also told it).

The point runs in a child process (harness.run_child: its own session, reaped with wait4) so that a peer that
runs out of GPU or host memory, raises, or overruns still leaves a record. The child prints progress lines as it
goes (each phase of the set-up, each optimizer step) and stops training at the step boundary where one more step
would not end `--reserve-s` before `--time-limit-s` (counted from its start), so a slow peer still reports its
set-up and first steps; past the limit the parent kills it (`timeout`) and records what the progress lines said.
Steady samples/s and tokens/s are over the steps after the first `--warmup-steps` (fewer when the time limit left
fewer steps: `warmup_steps` says how many were left out; none measured without two steps).

Record (one JSON line appended to `--json`): `peer`, the shape, `gpu_cap_GB`, `config` (the peer's settings),
`exact` and `caveats` (where its update is not exact AdamW with clipping and accumulation), `samples_per_s`,
`tokens_per_s`, `step_s`, `step_s_all`, `losses` and `grad_norms` (each step's), `first_step_s`, `steps_done`,
`stopped_by_time_limit`, the set-up (`setup_s`: process start to the first step; its parts `startup_s`, `build_s`,
`prepare_s` (the one line, or torchao's optimizer), `trainer_setup_s`), `peak_gpu_GB`/`peak_gpu_reserved_GB` (GiB, torch's allocator),
`peak_host_GB` (the child's peak RSS, GiB), `node_used_peak_GB` (the host's MemTotal - MemAvailable above its value
before the child, sampled every 0.2 s: pinned buffers and helper processes included), `engine` (what ran),
`error` (null, `oom_gpu`, `oom_host`, `timeout`, `error`) with `error_detail`, `stderr_tail` and `phase` (the
last set-up phase reached), `device`, `versions`, `commit`, `dirty`, `date`, `wall_s`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .data_parallel_rank import node_used_bytes
from .environment import _prefer_oom_victim, environment_info, setup_environment
from .harness import classify, failure_fields, parse_child_output, run_child
from .run_one import GiB, caught, classify_exception, emit
from .store import current_provenance, now_iso

PEERS = ("stronghold", "plain", "torchao", "torchao_accumulate", "fsdp2", "zero3_offload", "zenflow")
"""hf_peer_setup.py's table says what each runs."""
TORCHAO_PEERS = ("torchao", "torchao_accumulate")
"""The peers built on torchao's CPUOffloadOptimizer (their settings: hf_peer_setup.TORCHAO_PEERS; named here too
because this parent imports no torch)."""
DEFAULT_TIME_LIMIT_S = 1800.0
DEFAULT_RESERVE_S = 10.0
SIMULATIONS = ("oom_gpu", "oom_host", "timeout", "crash")
NEEDS_CUDA = {**dict.fromkeys(TORCHAO_PEERS, "torchao's CPUOffloadOptimizer asserts a CUDA or XPU device"),
              "fsdp2": "accelerate enables FSDP on accelerators only, and would silently train without it"}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this module's flags, the rest: examples/hf_trainer.py's flags, which the child parses with hf_trainer's own
    parser; the parent imports neither torch nor transformers, so it costs the point no start-up time)."""
    parser = argparse.ArgumentParser(prog="python -m examples.bench.hf_peers", description=__doc__.split("\n")[0],
                                     epilog="every other flag is examples/hf_trainer.py's", allow_abbrev=False)
    parser.add_argument("--peer", required=True, choices=PEERS)
    parser.add_argument("--time-limit-s", type=float, default=DEFAULT_TIME_LIMIT_S,
                        help="wall seconds for the whole point, start-up included; killed past it (timeout)")
    parser.add_argument("--reserve-s", type=float, default=DEFAULT_RESERVE_S,
                        help="stop training when one more step would end later than this before the limit")
    parser.add_argument("--json", type=Path, help="append the record to this JSONL file")
    parser.add_argument("--log-dir", type=Path, help="keep the child's stdout/stderr here (default: a temporary dir)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--simulate", choices=SIMULATIONS, help=argparse.SUPPRESS)
    ours, rest = parser.parse_known_args(argv)
    flags = {token.split("=")[0] for token in rest if token.startswith("--")}
    if flags & {"--no-stronghold", "--save-model"}:
        parser.error("--no-stronghold and --save-model are hf_trainer.py's: pick --peer plain for a plain Trainer")
    if ours.peer != "stronghold" and flags & {"--window", "--resident", "--stronghold-config"}:
        parser.error("--window/--resident/--stronghold-config are stronghold's knobs: drop them for "
                     f"--peer {ours.peer}")
    if ours.time_limit_s <= ours.reserve_s:
        parser.error(f"--time-limit-s={ours.time_limit_s} must exceed --reserve-s={ours.reserve_s}")
    return ours, rest


# ---------------------------------------------------------------- the child: one Trainer run

def progress(event: str, **fields: Any) -> None:
    """A progress line: `t`, seconds since the child started (hf_trainer.seconds_since_process_start's clock)."""
    import psutil

    emit({"event": event, "t": round(time.time() - psutil.Process().create_time(), 3), **fields})


def no_time_for_another(now_s: float, step_s: float, time_limit_s: float, reserve_s: float) -> bool:
    """Whether one more step as long as the last would end less than `reserve_s` before the limit (all seconds
    since the child started)."""
    return now_s + step_s > time_limit_s - reserve_s


def step_callbacks(time_limit_s: float, reserve_s: float):
    """Trainer callbacks: hf_trainer.py's StepTimer, and one that prints each step and stops at the time limit."""
    from transformers import TrainerCallback

    from examples.hf_trainer import StepTimer, seconds_since_process_start

    class Progress(TrainerCallback):
        def __init__(self) -> None:
            self.last: float | None = None
            self.stopped = False

        def on_step_begin(self, args, state, control, **kwargs):
            if self.last is None:
                progress("phase", phase="first_step")
                self.last = seconds_since_process_start()

        def on_step_end(self, args, state, control, **kwargs):
            now = seconds_since_process_start()
            step_s = now - self.last
            self.last = now
            progress("step", step=state.global_step, step_s=round(step_s, 6))
            if state.global_step < state.max_steps and no_time_for_another(now, step_s, time_limit_s, reserve_s):
                control.should_training_stop = True
                self.stopped = True

    return StepTimer(), Progress()


def build_model(peer: str, opts, args, device):
    """The bench's seeded model of hf_trainer.py's shape, where this peer wants it (module docstring of
    hf_peer_setup.py): under zero.Init for ZeRO-3, bf16 on the GPU for torchao and ZenFlow (DeepSpeed would cast and
    move it there), fp32 on the CPU as a user hands it over otherwise. Checkpointing is Trainer's to turn on."""
    import torch

    from examples.corpus import VOCAB

    from .model import build_model as bench_model, build_model_zero_init
    from .point import PLAIN_BASELINE, Point

    # The builders take a Point for its shape; its system is not read.
    point = Point(system=PLAIN_BASELINE, arch=opts.arch, layers=opts.layers, hidden=opts.hidden, heads=opts.heads,
                  seq=opts.seq, batch=opts.batch, accumulation=opts.accumulation, vocab=opts.vocab or VOCAB,
                  intermediate=opts.intermediate, kv_heads=opts.kv_heads, gpu_cap_GB=None, checkpointing=False)
    if peer == "zero3_offload":
        return build_model_zero_init(point, args.hf_deepspeed_config.config)
    if peer in (*TORCHAO_PEERS, "zenflow"):
        return bench_model(point, device, torch.bfloat16 if opts.bf16 else torch.float32)
    return bench_model(point, torch.device("cpu"), torch.float32)


def engine_facts(peer: str, trainer) -> dict[str, Any]:
    """What actually ran, read back from the trained objects (a peer silently falling back would show here)."""
    model = trainer.model_wrapped
    if peer == "stronghold":
        return model.stronghold_report()
    if peer in ("zero3_offload", "zenflow"):
        return {"zero_stage": int(model.zero_optimization_stage()), "optimizer": type(model.optimizer).__name__,
                "global_steps": int(model.global_steps)}
    if peer == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
        param = next(trainer.model.parameters())
        local = param.to_local() if hasattr(param, "to_local") else param  # a DTensor once sharded
        return {"fsdp_modules": len(modules), "parameters_on": local.device.type, "sharded": local is not param}
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    facts = {"optimizer": type(optimizer).__name__}
    if peer in TORCHAO_PEERS:
        facts.update(offloaded_tensors=len(optimizer.param_d2h_map),
                     gpu_tensors=sum(len(group["params"]) for group in optimizer.d_param_groups))
    return facts


def train(peer: str, opts, ours, summary: dict[str, Any]) -> None:
    """Set up and train `peer`, filling `summary` as it goes (so that a failure keeps what was measured)."""
    import torch
    from transformers import Trainer, TrainingArguments

    import stronghold
    from examples.corpus import corpus_bytes
    from examples.hf_trainer import ByteWindows
    from stronghold.engine.launch import apply_gpu_memory_limit

    from . import hf_peer_setup as setup
    from .peer_engines import init_one_rank_group

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:  # the same cap for every peer, before anything is allocated
        apply_gpu_memory_limit(opts.gpu_memory_limit_gb, device)
    if peer in NEEDS_CUDA and not on_gpu:
        raise ValueError(f"--peer {peer} needs a CUDA device ({NEEDS_CUDA[peer]}): run it on a GPU machine")
    if peer == "fsdp2":
        init_one_rank_group(device)
    args = TrainingArguments(**setup.trainer_arguments(opts, peer))
    if peer == "fsdp2":
        args.fsdp_plugin_args["mixed_precision_policy"] = setup.fsdp2_mixed_precision()
    summary.update(config=setup.peer_config(peer, args, opts), caveats=setup.peer_caveats(peer, opts))
    summary["exact"] = not summary["caveats"]
    start = time.perf_counter()
    model = build_model(peer, opts, args, device)
    summary.update(build_s=round(time.perf_counter() - start, 3), params=sum(p.numel() for p in model.parameters()))
    if peer == "zero3_offload":  # partitioned: each parameter's full size is ds_numel
        summary["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    progress("phase", phase="built")
    optimizers = (None, None)
    start = time.perf_counter()
    if peer == "stronghold":
        stronghold.initialize(model, config=setup.stronghold_section(opts))  # the one line
    elif peer in TORCHAO_PEERS:
        optimizers = (setup.torchao_optimizer(model, args, peer), None)
    summary["prepare_s"] = round(time.perf_counter() - start, 3) if peer in ("stronghold", *TORCHAO_PEERS) \
        else None
    timer, stepper = step_callbacks(ours.time_limit_s, ours.reserve_s)
    trainer_start = time.perf_counter()
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(corpus_bytes(), opts.seq),
                      callbacks=[timer, stepper], optimizers=optimizers)
    expected = {"fsdp2": trainer.is_fsdp_enabled, "zero3_offload": trainer.is_deepspeed_enabled,
                "zenflow": trainer.is_deepspeed_enabled}.get(peer, True)
    if not expected:
        raise RuntimeError(f"Trainer did not enable the {peer} path (is_fsdp_enabled={trainer.is_fsdp_enabled}, "
                           f"is_deepspeed_enabled={trainer.is_deepspeed_enabled})")
    progress("phase", phase="trainer")
    try:
        metrics = trainer.train().metrics
    finally:
        step_times = [b - a for a, b in zip([timer.start] + timer.ends, timer.ends)] if timer.start else []
        summary.update(steps_done=len(step_times), step_s_all=[round(t, 6) for t in step_times],
                       first_step_s=round(step_times[0], 6) if step_times else None,
                       stopped_by_time_limit=stepper.stopped)
        if timer.first_step_begin is not None:
            summary.update(setup_s=round(timer.setup_s, 3), trainer_setup_s=round(timer.first_step_begin - trainer_start, 3))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    warmup = min(opts.warmup_steps, len(step_times) - 1)
    timed = step_times[warmup:] if len(step_times) >= 2 else []
    # Every step's loss and pre-clipping gradient norm (logging_steps=1): with clipping at 1.0 an exact update has to
    # wait for the whole backward's norm on the steps where it binds, so the step's time can depend on it.
    norms = [entry.get("grad_norm") for entry in trainer.state.log_history if "loss" in entry]
    summary.update(losses=[round(loss, 6) for loss in losses],
                   grad_norms=[None if norm is None else round(float(norm), 6) for norm in norms])
    summary.update(first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                   trainer_samples_per_s=metrics.get("train_samples_per_second"), warmup_steps=warmup,
                   timed_steps=len(timed), engine=engine_facts(peer, trainer))
    if timed:
        samples_per_s = opts.batch * opts.accumulation * len(timed) / sum(timed)
        summary.update(samples_per_s=round(samples_per_s, 6), tokens_per_s=round(samples_per_s * opts.seq, 1),
                       step_s=round(sum(timed) / len(timed), 3))


def simulated_child(name: str) -> int:
    """Test-only: a child that fails as `name` says, before any of the real set-up (the parent's classification)."""
    emit({"event": "start", "simulated": name})
    progress("phase", phase="simulated")
    if name == "oom_host":
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    if name == "timeout":
        time.sleep(3600)
    import torch

    exc = torch.OutOfMemoryError("simulated: CUDA out of memory") if name == "oom_gpu" else RuntimeError("simulated")
    emit({"event": "result", "error": classify_exception(exc), "error_detail": str(exc)})
    return 1


def child_main(ours: argparse.Namespace, rest: list[str]) -> int:
    _prefer_oom_victim()  # the kernel's OOM killer takes this child, not the sweep that runs it
    if ours.simulate:
        return simulated_child(ours.simulate)
    has_cuda = setup_environment()  # before anything imports DeepSpeed
    from examples.hf_trainer import parse_args as trainer_args, seconds_since_process_start

    opts = trainer_args(rest)
    startup_s = round(seconds_since_process_start(), 3)
    start = {"event": "start", **shape_fields(opts), **environment_info(has_cuda)}
    if ours.peer in TORCHAO_PEERS:
        try:
            import torchao

            start["versions"]["torchao"] = torchao.__version__
        except ImportError as e:  # recorded: the run itself then fails with the same error
            start["versions"]["torchao"] = f"unavailable: {e}"
    emit(start)
    summary: dict[str, Any] = {"event": "result", "startup_s": startup_s}
    try:
        train(ours.peer, opts, ours, summary)
        summary["error"] = None
    except BaseException as exc:  # noqa: B036 - every failure becomes a recorded outcome
        summary.update(caught(exc))
    if has_cuda:
        import torch

        summary.update(peak_gpu_GB=torch.cuda.max_memory_allocated() / GiB,
                       peak_gpu_reserved_GB=torch.cuda.max_memory_reserved() / GiB)
    summary["peak_host_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    emit(summary)
    return 0 if summary["error"] is None else 1


# ---------------------------------------------------------------- the parent: the record

def shape_fields(opts: argparse.Namespace) -> dict[str, Any]:
    from examples.corpus import VOCAB
    from examples.llama import default_intermediate

    intermediate = 4 * opts.hidden if opts.arch == "gpt2" else opts.intermediate or default_intermediate(opts.hidden)
    return {"arch": opts.arch, "hidden": opts.hidden, "layers": opts.layers, "heads": opts.heads,
            "kv_heads": opts.kv_heads or opts.heads, "intermediate": intermediate, "vocab": opts.vocab or VOCAB,
            "seq": opts.seq, "micro_batch": opts.batch, "accumulation": opts.accumulation, "bf16": opts.bf16,
            "gradient_checkpointing": opts.gradient_checkpointing, "max_grad_norm": opts.max_grad_norm,
            "steps": opts.steps, "gpu_cap_GB": opts.gpu_memory_limit_gb}


def progress_fields(stdout: str) -> dict[str, Any]:
    """What the progress lines say of a child that left no result line: the last phase, the steps it finished."""
    phase, steps = None, []
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") == "phase":
            phase = event.get("phase")
        elif isinstance(event, dict) and event.get("event") == "step":
            steps.append(event.get("step_s"))
    return {"phase": phase, "steps_done": len(steps), "step_s_all": steps, "first_step_s": steps[0] if steps else None}


def run_parent(ours: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run the point in a child; its record (also appended to --json and summarised on stdout)."""
    provenance = current_provenance()
    baseline = node_used_bytes()
    peak = [baseline]

    def sample() -> None:
        peak[0] = max(peak[0], node_used_bytes())

    with tempfile.TemporaryDirectory() as tmp:
        log_dir = ours.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        stem = f"hf_{ours.peer}_{os.getpid()}"
        out_path, err_path = log_dir / f"{stem}.out", log_dir / f"{stem}.err"
        ended = run_child([sys.executable, "-m", "examples.bench.hf_peers", *argv, "--child"],
                          timeout_s=ours.time_limit_s, out_path=out_path, err_path=err_path, on_poll=sample)
        stdout = out_path.read_text(errors="replace")
        start, result = parse_child_output(stdout)
        error = classify(result, ended.returncode, ended.timed_out)
        # The child's result line where there is one; what its progress lines said for what it does not say.
        record: dict[str, Any] = {"script": "examples/bench/hf_peers.py", "peer": ours.peer, **start,
                                  **progress_fields(stdout), **(result or {})}
        record.pop("event", None)
        record.update(error=error, returncode=ended.returncode, time_limit_s=ours.time_limit_s, wall_s=ended.wall_s,
                      peak_host_GB=max(record.get("peak_host_GB") or 0.0, ended.peak_rss_GB),
                      node_used_peak_GB=(peak[0] - baseline) / GiB, commit=provenance.commit, dirty=provenance.dirty,
                      date=now_iso(), log=str(out_path) if ours.log_dir else None)
        if error is not None:
            record.update(failure_fields(error, err_path, record.get("error_detail")))
    if ours.json is not None:
        ours.json.parent.mkdir(parents=True, exist_ok=True)
        with ours.json.open("a") as f:
            f.write(json.dumps(record, default=str, sort_keys=True) + "\n")
    print(f"[hf_peers] {ours.peer}: " + one_line(record), flush=True)
    return record


def one_line(record: dict[str, Any]) -> str:
    if record.get("error"):
        return (f"{record['error']} after {record.get('steps_done') or 0} steps (phase {record.get('phase')}, "
                f"{record['wall_s']:.0f} s): {str(record.get('error_detail', ''))[-200:]}")
    rate = record.get("tokens_per_s")
    return (f"{'%.0f tokens/s' % rate if rate else 'no steady rate'} over {record.get('timed_steps')} steps, "
            f"first step {record.get('first_step_s')} s, set-up {record.get('setup_s')} s, "
            f"GPU peak {record.get('peak_gpu_GB') or 0:.1f} GiB, host peak {record['peak_host_GB']:.1f} GiB")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = parse_args(argv)
    if ours.child:
        code = child_main(ours, rest)
        sys.stdout.flush()
        sys.stderr.flush()
        # The result is out; skip interpreter teardown (DeepSpeed's process group and pinned buffers have hung
        # there). ZenFlow's optimizer process goes with the session (harness.run_child).
        os._exit(code)
    record = run_parent(ours, argv)
    return 0 if record["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
