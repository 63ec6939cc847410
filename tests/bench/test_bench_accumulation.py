"""Gradient accumulation in the runner: a timed step is one optimizer step of `accumulation`
micro-batches (forward, backward and step() on each, as DeepSpeed expects), and samples/s counts
all of them. The loop on a recording fake engine; one real tiny Llama point on the CPU."""
from types import SimpleNamespace

import pytest
import torch
from bench_fakes import TINY

from examples.bench.harness import RunnerConfig, run_point
from examples.bench.point import Point
from examples.bench.run_one import optimizer_steps
from examples.bench.store import Provenance


class RecordingEngine:
    """Calls in order, with DeepSpeed's counting: an update at every `accumulation`-th step()."""

    def __init__(self, accumulation):
        self.accumulation, self.calls, self.micro_steps, self.global_steps = accumulation, [], 0, 0

    def __call__(self, input_ids, labels):
        self.calls.append(("forward", int(input_ids[0, 0])))
        return SimpleNamespace(loss=torch.tensor(float(self.micro_steps)))

    def backward(self, loss):
        self.calls.append(("backward", float(loss)))

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.accumulation == 0:
            self.global_steps += 1
            self.calls.append(("update", self.global_steps))


def test_each_timed_step_spans_every_micro_batch():
    point = Point(system="no_offload", layers=2, accumulation=3, warmup_steps=2, timed_steps=4, **TINY)
    engine = RecordingEngine(3)
    batches = [{"input_ids": torch.full((2, 4), i), "labels": torch.full((2, 4), i)} for i in range(3)]
    syncs, warm = [], []
    step_s, losses = optimizer_steps(engine, point, batches, lambda: syncs.append(len(engine.calls)),
                                     lambda: warm.append(engine.global_steps))
    assert len(step_s) == 4 and losses == [float(i) for i in range(18)]
    assert engine.global_steps == 6 and warm == [2], "the report resets after the 2 warm-up updates"
    forwards = [b for kind, b in engine.calls if kind == "forward"]
    assert forwards == [0, 1, 2] * 6, "every micro-batch of a step is a different batch"
    # The clock is read (after a sync) only between optimizer steps: just before a step's first
    # forward and just after its update (a step is 3 forwards, 3 backwards and the update).
    updates = [i + 1 for i, call in enumerate(engine.calls) if call[0] == "update"]
    assert syncs == [n for end in updates for n in (end - 7, end)]


@pytest.mark.slow
@pytest.mark.parametrize("system", ["stronghold"])
def test_real_llama_point_counts_every_micro_batch(tmp_path, system):
    """The acceptance path on a tiny shape: stronghold, Llama with GQA, accumulation 2."""
    pytest.importorskip("stronghold.engine.engine")
    point = Point(system=system, layers=2, arch="llama", kv_heads=2, accumulation=2, vocab=256, gpu_cap_GB=None,
                  warmup_steps=1, timed_steps=2, **TINY)
    r = run_point(point, 300, RunnerConfig(log_dir=tmp_path), Provenance(commit="test", dirty=False))
    assert r["error"] is None, r.get("error_detail") or (tmp_path / f"{point.label()}.err").read_text()[-3000:]
    assert r["optimizer_steps"] == 3, "one update per accumulated step"
    assert r["samples_per_s"] == pytest.approx(2 * 2 / r["step_s"])
    assert r["tokens_per_s"] == pytest.approx(2 * 2 * 32 / r["step_s"])
    assert (r["arch"], r["accumulation"], r["kv_heads"], r["intermediate"]) == ("llama", 2, 2, 256)
    assert 5 < r["loss_first"] < 6.5, "about ln(256): random tokens, random init"
    assert r["stronghold"]["steps"] == 2, "the engine's report covers the timed steps"
