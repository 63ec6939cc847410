"""Every call order DeepSpeed allows, against plain DeepSpeed (stage 0, fp32, torch.optim.AdamW as the client
optimizer, tests/engine/helpers.deepspeed_reference): the same weights, steps and learning rate (1e-5, the
equivalence tests' bar: DeepSpeed's AdamW is torch's), or a clear error before anything changes, after which the run
equals DeepSpeed's without that call.

A sequence is a string of calls: "b" runs forward and backward of the next micro-batch, "s" calls step().
"""
import copy

import pytest
import torch

import stronghold

from .helpers import batches, deepspeed_reference, ds_config, relative_error, tiny_llama

LR = 3e-3
REF_TOL = 1e-5
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4,
                                         "warmup_type": "linear"}}


def _config(top=None, **cfg):
    config = ds_config(lr=LR, scheduler=WARMUP, window=2, resident=1, **cfg)
    config.update(top or {})
    return config


def _stronghold(model, config):
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=config)
    return engine


def _run(engine, data, calls: str):
    batch = iter(data)
    for call in calls:
        if call == "b":
            engine.backward(engine(**next(batch)).loss)
        else:
            engine.step()


def _assert_same(engine, reference):
    if hasattr(engine, "synchronize_host"):
        engine.synchronize_host()
    assert engine.global_steps == reference.global_steps
    assert engine.get_lr() == pytest.approx(reference.get_lr(), rel=1e-12)
    assert relative_error(engine.module, reference.module) <= REF_TOL


SEQUENCES = {
    # The boundary's step() without the boundary's backward: DeepSpeed steps on the window's gradients so far.
    "step_twice_accumulation_2": (dict(gas=2, clip=1.0), "bss" + "bsbs" * 2),
    # Accumulation 4 on the host: the window ends while micro-step 2's gradients wait in the spare buffer.
    "step_early_accumulation_4": (dict(gas=4, clip=1.0), "bsbsbss" + "bsbsbsbs"),
    "step_twice_gpu_accumulation": (dict(gas=2, clip=1.0, gpu_accumulation=True), "bss" + "bsbs" * 2),
    # No backward at all since the last step: nothing is updated, the step and the LR schedule still advance.
    # (Without clipping: DeepSpeed's own clipping fails on a model without gradients.)
    "step_without_backward": (dict(gas=1, clip=0.0), "bss" + "sbs" + "bs"),
    "window_without_backward": (dict(gas=2, clip=0.0), "bsbs" + "ss" + "bsbs"),
    # DeepSpeed's caller-owned boundary: every backward accumulates, every step() is the boundary.
    "unmanaged_accumulation": (dict(gas=2, clip=1.0, top={"managed_gradient_accumulation": False}),
                               "bbs" + "bbbs" + "bs" + "bbs"),
}


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_call_sequence_matches_deepspeed(name):
    cfg, calls = SEQUENCES[name]
    model, data = tiny_llama(4), batches(calls.count("b"))
    config = _config(**cfg)
    reference = deepspeed_reference(model, config)
    _run(reference, data, calls)
    engine = _stronghold(model, config)
    _run(engine, data, calls)
    _assert_same(engine, reference)


def _refused(engine, call, match, cls=ValueError):
    """`call(engine)` raises `cls` matching `match` and leaves every weight, AdamW state and counter as it was."""
    runtime = engine.stronghold_runtime
    runtime.cpu.drain()
    steps = {e.name: e.step for s in runtime.stores.values() for e in s.entries}
    masters = {k: v.clone() for k, v in runtime.master_params().items()}
    counters = (engine.global_steps, engine.micro_steps, runtime.state)
    with pytest.raises(cls, match=match):
        call(engine)
    runtime.cpu.drain()
    assert {e.name: e.step for s in runtime.stores.values() for e in s.entries} == steps
    assert all(torch.equal(v, masters[k]) for k, v in runtime.master_params().items())
    assert (engine.global_steps, engine.micro_steps, runtime.state) == counters


@pytest.mark.parametrize("pending", ["after_boundary_backward", "mid_accumulation"])
@pytest.mark.parametrize("call", ["load_checkpoint", "save_checkpoint", "optimizer.state_dict()",
                                  "optimizer.load_state_dict()"])
def test_whole_state_calls_between_backward_and_step_raise_and_change_nothing(tmp_path, call, pending):
    """The issue's case: a load between backward() and step() used to leave the streamed blocks' AdamW step counts
    one behind DeepSpeed's (a wrong bias correction from the next step on). Each of these calls now refuses, with
    one message, and the run then equals DeepSpeed's without the call."""
    model, data = tiny_llama(4), batches(8)
    config = _config(gas=2, clip=1.0)
    engine = _stronghold(model, config)
    _run(engine, data, "bsbs")
    engine.save_checkpoint(tmp_path)
    saved = engine.optimizer.state_dict()
    _run(engine, data[2:], "bs" if pending == "mid_accumulation" else "bsb")
    actions = {"load_checkpoint": lambda e: e.load_checkpoint(tmp_path),
               "save_checkpoint": lambda e: e.save_checkpoint(tmp_path / "again"),
               "optimizer.state_dict()": lambda e: e.optimizer.state_dict(),
               "optimizer.load_state_dict()": lambda e: e.optimizer.load_state_dict(saved)}
    _refused(engine, actions[call], rf"{call.replace('(', '[(]').replace(')', '[)]')} was called between "
                                    r"backward\(\) and step\(\)")
    rest = "bsbsbs" if pending == "mid_accumulation" else "sbsbs"
    _run(engine, data[2 + ("bs" if pending == "mid_accumulation" else "bsb").count("b"):], rest)
    reference = deepspeed_reference(model, config)
    _run(reference, data, "bsbs" + ("bs" if pending == "mid_accumulation" else "bsb") + rest)
    _assert_same(engine, reference)


def test_backward_twice_at_a_boundary_raises_and_changes_nothing():
    """DeepSpeed would add the second backward's gradients into the first's; stronghold has already begun the first
    one's update, so it refuses the second before anything changes, and step() then completes the first."""
    model, data = tiny_llama(4), batches(3)
    config = _config(gas=1, clip=1.0)
    engine = _stronghold(model, config)
    _run(engine, data, "bsb")
    # (A forward here is refused too, test_step_state.py: the second backward comes with a loss of its own.)
    _refused(engine, lambda e: e.backward(torch.zeros((), requires_grad=True)), r"backward\(\) was called twice",
             cls=RuntimeError)
    _run(engine, data[2:], "sbs")
    reference = deepspeed_reference(model, config)
    _run(reference, data, "bsbsbs")
    _assert_same(engine, reference)


def test_a_non_boundary_backward_without_accumulation_raises_and_changes_nothing():
    """DeepSpeed's set_gradient_accumulation_boundary(False) with gradient_accumulation_steps 1: the streamed blocks
    have no buffers to accumulate in, which is said (and how to fix it) before anything changes."""
    model, data = tiny_llama(4), batches(3)
    config = _config(gas=1, clip=1.0)
    engine = _stronghold(model, config)
    _run(engine, data, "bs")
    loss = engine(**data[1]).loss
    engine.set_gradient_accumulation_boundary(False)
    _refused(engine, lambda e: e.backward(loss), "gradient_accumulation_steps is 1")
    engine.set_gradient_accumulation_boundary(True)
    _run(engine, data[1:], "bsbs")
    reference = deepspeed_reference(model, config)
    _run(reference, data, "bsbsbs")
    _assert_same(engine, reference)
