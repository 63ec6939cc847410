"""step() claims the updates the CPU worker has not begun (cpu_optim.py, `UpdateRecord.claim`): their sums of
squares are read on the calling thread and their exact updates queued in forward order. The arithmetic is the one
the worker's job would have done (an early update with the unclipped gradient is the final update with clip
coefficient 1.0; a deferred one is the same final update), so a run with claims is bit-identical to the same run
without (masters and module weights, torch.equal); that run itself matches plain PyTorch (test_exactness.py,
test_speculation.py). Not where a step clips after early updates (a first step, which has no forecast, or a norm that
jumps): an early update is then redone, exact to about one rounding, and a claimed one is deferred, exact, so such a
run agrees with one whose worker kept up to rounding only (test_batch_room.py's RUN_TOL); these tests clip every step
or never. `Backlog` holds the worker with events so that every step meets a backlog, and claims
happen on every run; at full speed they may or may not, which changes nothing either way."""
import copy
import threading
from types import SimpleNamespace

import pytest
import torch

import stronghold

from .helpers import VOCAB, batches, ds_config, relative_error, tiny_gpt2, tiny_llama, train_reference
from .test_weights_first import _assert_identical, _train

LR = 3e-3
CLAIMED_PER_STEP = 4
"""Six blocks, one resident: five streamed; the first of them to get its gradients runs before the hold."""
HOLD_TIMEOUT_S = 120.0
"""A hold that is never released fails the worker (and so the test) instead of hanging it."""


class Backlog:
    """The engine's CPU worker held behind backward, so that step() finds a backlog on every run. Each step, once the
    first streamed block's boundary job is queued, the worker reaches a job that waits on an event: every later
    block's update job queues behind it (with host accumulation the urgent sums may still overtake it, as they
    would a slow update). step() releases it when it asks for the global norm (`grad_sq_sum`), and a second hold,
    urgent, queued behind the sums already waiting and ahead of every update job, lasts until step() has made its
    claims (`finish_step`). The update jobs behind the holds are claimed, whatever the machine's speed."""

    def __init__(self, engine):
        self.cpu = cpu = engine.stronghold_runtime.cpu
        self._submit_grads, self._grad_sq_sum, self._finish_step = cpu.submit_grads, cpu.grad_sq_sum, cpu.finish_step
        cpu.submit_grads, cpu.grad_sq_sum, cpu.finish_step = self.submit_grads, self.grad_sq_sum, self.finish_step
        self.first = self.second = None

    def _hold(self, urgent: bool) -> tuple[threading.Event, threading.Event]:
        """Queue a job that holds the worker until released; returns (reached, release)."""
        reached, release = threading.Event(), threading.Event()

        def wait():
            reached.set()
            if not release.wait(HOLD_TIMEOUT_S):
                raise TimeoutError("Backlog: a hold on the CPU worker was never released")

        self.cpu._submit(wait, urgent=urgent)
        return reached, release

    def submit_grads(self, store, present, landed, boundary, *args, **kwargs):
        self._submit_grads(store, present, landed, boundary, *args, **kwargs)
        if boundary and self.first is None:
            reached, self.first = self._hold(urgent=False)
            # Until the worker is inside the hold, the first block's job (queued before it) may not have begun, and
            # step() would claim it too: one more claim on a loaded machine. Backward waits here instead.
            if not reached.wait(HOLD_TIMEOUT_S):
                raise TimeoutError("Backlog: the CPU worker never reached the hold")

    def grad_sq_sum(self) -> float:
        _, self.second = self._hold(urgent=True)
        self.first.set()
        return self._grad_sq_sum()

    def finish_step(self, *args, **kwargs) -> None:
        try:
            self._finish_step(*args, **kwargs)
        finally:
            self.second.set()
            self.first = self.second = None


def _engine(model, held: bool, **cfg):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(
        lr=LR, window=2, resident=1, bf16=True, **cfg))
    if held:
        Backlog(engine)
    return engine


# clip 0: no clipping (early updates, step() need not wait); 1e3: clipping configured, never active (early updates
# validated at step()).
@pytest.mark.parametrize("make,clip", [(tiny_llama, 0.0), (tiny_llama, 1e3), (tiny_gpt2, 1e3)])
def test_claimed_updates_are_bit_identical(make, clip):
    model, data = make(6), batches(4)
    held, fast = _engine(model, True, clip=clip), _engine(model, False, clip=clip)
    _train(held, data)
    _train(fast, data)
    _assert_identical(held, fast)
    stats = held.stronghold_runtime.cpu.stats
    assert stats.claimed_blocks == len(data) * CLAIMED_PER_STEP, "every update behind the hold is claimed"
    assert stats.claimed_blocks <= stats.deferred_blocks, "a claimed update is counted among the deferred"
    assert held.stronghold_report()["overlap"]["claimed_blocks_per_step"] > 0


def test_clipping_every_step_defers_and_stays_identical():
    """Clipping at 1e-4 clips every step: after the first step's forecast the worker's jobs only read the sums of
    squares (every update is deferred); what the held worker leaves is claimed, identically."""
    model, data = tiny_llama(6), batches(4)
    held, fast = _engine(model, True, clip=1e-4), _engine(model, False, clip=1e-4)
    _train(held, data)
    _train(fast, data)
    _assert_identical(held, fast)
    assert held.stronghold_runtime.cpu.stats.deferred_blocks > 0
    assert held.stronghold_runtime.cpu.stats.claimed_blocks == len(data) * CLAIMED_PER_STEP


def test_a_skipped_step_with_claimed_updates():
    """Step 2's gradients are NaN: its claimed updates are dropped like deferred ones, and training goes on."""
    model, data = tiny_llama(6), batches(4)
    held, fast = _engine(model, True, clip=1e3), _engine(model, False, clip=1e3)
    _train(held, data, nan_at=2)
    _train(fast, data, nan_at=2)
    assert held.skipped_steps == fast.skipped_steps == 1
    _assert_identical(held, fast)
    assert held.stronghold_runtime.cpu.stats.claimed_blocks == len(data) * CLAIMED_PER_STEP


def test_host_accumulation_claims_the_update_behind_the_sum():
    """With accumulation on the host the sum of squares is the worker's (of the summed gradient), an urgent job that
    step() waits for; the early update behind it is claimed when the worker has not begun it."""
    model, data = tiny_llama(6), batches(4)
    held, fast = _engine(model, True, clip=1e3, gas=2), _engine(model, False, clip=1e3, gas=2)
    _train(held, data)
    _train(fast, data)
    _assert_identical(held, fast)
    assert held.stronghold_runtime.cpu.stats.claimed_blocks == len(data) // 2 * CLAIMED_PER_STEP


class _Skippy(torch.nn.Module):
    """Four residual blocks; a batch's `skip` leaves one out of its forward, so that block gets no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                          for _ in range(4))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels, skip=-1):
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = x + layer(x)
        loss = torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss)


def test_a_block_without_gradients_at_the_boundary_sums_after_its_earlier_jobs():
    """Accumulation 4, the last streamed block left out of every window's last micro-batch: at the boundary it sends
    nothing, so nothing waits for its buffer; its sum must still take micro-step 2's parked gradients (its job is an
    ordinary one, behind them, cpu_optim.submit_grads). The run equals plain PyTorch's. (Here the other blocks'
    waits for their buffers drain the queue before this block's sum is submitted: the worker runs each block's jobs
    in backward order, so the order is also kept by those waits.)"""
    model, data = _Skippy(), batches(8)
    for i, batch in enumerate(data):
        batch["skip"] = 3 if i % 4 == 3 else -1
    trained = copy.deepcopy(model)
    engine, _, _, _ = stronghold.initialize(model=trained, blocks=trained.layers, config=ds_config(
        lr=LR, window=2, resident=1, gas=4, clip=1.0))
    for batch in data:
        engine.backward(engine(**batch).loss)
        engine.step()
    engine.synchronize_host()
    reference, _ = train_reference(model, data, lr=LR, gas=4, clip=1.0)
    assert relative_error(engine.module, reference) <= 1e-5
