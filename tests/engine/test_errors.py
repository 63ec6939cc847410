"""Bad input fails early with a message that names the problem and the fix."""
import copy

import pytest
import torch

import stronghold
from stronghold.planning.plan_bytes import check_host_fits
from stronghold.planning.plan_result import HostParts

from .helpers import batches, caught_up, ds_config, relative_error, run_steps, tiny_gpt2, tiny_llama, train_reference


def test_not_enough_host_memory_fails_before_allocating(monkeypatch):
    import psutil

    class Tiny:
        available = 1024

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    model = tiny_llama(4)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(MemoryError, match=r"needs .* GiB of host memory .* only 0\.0 GiB is available.*resident_blocks"):
        stronghold.initialize(model=model, config=ds_config())
    assert before == {n: p.data_ptr() for n, p in model.named_parameters()}, "nothing was moved"


def test_host_memory_limit_is_the_budget_and_named_when_it_does_not_fit():
    import psutil

    from stronghold.config import StrongholdConfig, resolve
    from stronghold.planning.plan_inputs import DeviceMemory, budgets

    gib = 2 ** 30
    model = tiny_llama(4)
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = DeviceMemory(free=gib, total=gib, reserved=0, allocated=0)
    free = budgets(model, resolve(StrongholdConfig(), torch.device("cpu")), torch.device("cpu"), memory).host_bytes
    limit = (psutil.Process().memory_info().rss + gib) / gib  # one GiB above what the process holds now
    capped = budgets(model, resolve(StrongholdConfig(host_memory_limit_gb=limit), torch.device("cpu")),
                     torch.device("cpu"), memory)
    # The RSS moves a little between the two reads: within 64 MiB of the limit less the RSS, plus the model.
    assert abs(capped.host_bytes - (gib + own)) < 64 * 2 ** 20 and capped.host_bytes < free
    assert capped.host_limit_gb == limit
    # Below the planner's host margin: refused before anything is allocated, naming the limit.
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(MemoryError, match=r"under host_memory_limit_gb=.*raise the limit"):
        stronghold.initialize(model=model, config=ds_config(host_memory_limit_gb=limit - 0.99))
    assert before == {n: p.data_ptr() for n, p in model.named_parameters()}, "nothing was moved"


def test_host_plan_counts_every_buffer():
    """20 GiB of buffers less 4 GiB of the model's own storage they replace: 16 GiB more, plus the planner's
    margin (plan_types.default_host_margin) on available + freed: 4 GiB up to an 80 GiB budget."""
    gib = 2 ** 30
    plan = HostParts(master_and_moments=12 * gib, working=2 * gib, grads=2 * gib, accumulators=4 * gib)
    assert plan.total == 20 * gib
    check_host_fits(plan, available=20 * gib, freed=4 * gib)
    with pytest.raises(MemoryError, match=r"needs 20\.0 GiB of host memory"):
        check_host_fits(plan, available=20 * gib - 1, freed=4 * gib)


def test_client_optimizer_must_be_adamw():
    model = tiny_gpt2(2)
    cfg = ds_config()
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="implements AdamW; got a SGD"):
        stronghold.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    with pytest.raises(ValueError, match="L2"):
        stronghold.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), weight_decay=0.1),
                              config=cfg)


def test_client_adamw_groups_are_used():
    model, data = tiny_gpt2(4), batches(4)
    reference, _ = train_reference(model, data, lr=3e-3, weight_decay=0.2, groups=True, clip=0.5)
    mine = copy.deepcopy(model)
    decay = [p for p in mine.parameters() if p.ndim >= 2]
    no_decay = [p for p in mine.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.2}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    cfg = ds_config(clip=0.5)
    del cfg["optimizer"]
    engine, optimizer, _, _ = stronghold.initialize(model=mine, optimizer=opt, config=cfg)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]
    run_steps(engine, data)
    assert relative_error(engine.module, reference) <= 1e-5


def test_parameter_missing_from_the_groups():
    model = tiny_gpt2(2)
    with pytest.raises(ValueError, match="require grad but are in no optimizer param group"):
        stronghold.initialize(model=model, model_parameters=[model.transformer.wte.weight], config=ds_config())


def test_retain_graph_is_rejected():
    engine, _, _, _ = stronghold.initialize(model=tiny_gpt2(2), config=ds_config(resident=0))
    loss = engine(**batches(1)[0]).loss
    with pytest.raises(ValueError, match="retain_graph"):
        engine.backward(loss, retain_graph=True)


def test_lr_changed_between_backward_and_step_is_applied_exactly():
    model, data = tiny_llama(4), batches(3)
    reference, _ = train_reference(model, data, lr=3e-3, lrs=[3e-3, 1e-3, 2e-3])
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(lr=3e-3))
    lrs = [3e-3, 1e-3, 2e-3]

    def set_lr(engine, i):  # after backward, so after the speculative CPU updates ran
        caught_up(engine)
        for group in engine.optimizer.param_groups:
            group["lr"] = lrs[i]

    run_steps(engine, data, before_step=set_lr)
    assert engine.stronghold_runtime.cpu.stats.redo_blocks > 0
    assert relative_error(engine.module, reference) <= 1e-5


def test_gpu_out_of_memory_names_the_knobs(monkeypatch):
    from stronghold.engine.runtime import StrongholdRuntime

    def no_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine, _, _, _ = stronghold.initialize(model=tiny_gpt2(4), config=ds_config(window=2, resident=1))
    engine.backward(engine(**batches(1)[0]).loss)
    monkeypatch.setattr(StrongholdRuntime, "step", no_memory)
    with pytest.raises(torch.OutOfMemoryError, match=r"window_size=2 and resident_blocks=1.*lower \"resident_blocks\""):
        engine.step()


def test_out_of_memory_after_a_longer_micro_batch_names_both_lengths(monkeypatch):
    """The placement plans from the first training step's activations: a collator that pads each batch to its own
    longest sequence can later bring one that needs more. The advice names the lengths and the fix."""
    from stronghold.engine.runtime import StrongholdRuntime

    def no_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine, _, _, _ = stronghold.initialize(model=tiny_gpt2(4), config=ds_config(window=2, resident=1))
    short, = batches(1)
    engine.backward(engine(**short).loss)
    monkeypatch.setattr(StrongholdRuntime, "step", no_memory)
    with pytest.raises(torch.OutOfMemoryError) as same_length:
        engine.step()
    assert "planned from the first" not in str(same_length.value), "no longer batch: nothing to say about lengths"
    monkeypatch.undo()
    engine.step()
    first = short["input_ids"].numel()
    longer = {k: torch.cat([v, v]) for k, v in short.items()}
    with torch.no_grad():
        engine(**longer)  # evaluation: not a training batch, the placement does not count it
    engine.backward(engine(**longer).loss)
    monkeypatch.setattr(StrongholdRuntime, "step", no_memory)
    with pytest.raises(torch.OutOfMemoryError, match=rf"first training micro-batch, {first} tokens; micro-batches "
                                                     rf"have since had up to {2 * first}.*pad every micro-batch"):
        engine.step()


def test_out_of_memory_advice_names_fragmentation():
    """The Llama seq 163840 failure under a 32 GiB cap: 24.1 GiB allocated of 29.9 reserved (H100)."""
    from stronghold.engine.engine import fragmentation_hint

    gib = 2 ** 30
    hint = fragmentation_hint(None, reserved=int(29.9 * gib), allocated=int(24.1 * gib))
    assert "5.8 GiB of the 29.9 GiB" in hint and "expandable_segments:True" in hint
    assert fragmentation_hint(None, reserved=10 * gib, allocated=9 * gib) == "", "10% idle: not fragmentation"
    assert fragmentation_hint(torch.device("cpu")) == "" and fragmentation_hint(None) == ""
