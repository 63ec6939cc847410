"""A promotion's copies on a thread (streaming/promotion_fill.py, `runtime.promote(background=True)`): training stays
PyTorch's to the equivalence tolerance, each promoted block's first forward runs after its own copies, a failed copy
is raised where the values are next needed, and the host buffers go to the releaser once copied. No verdict from a
timing: the thread is held at a gate that the training thread opens, and the checks are orders of events."""
import threading

import pytest
import torch

from stronghold.streaming import promotion_fill

from .helpers import batches, ds_config, relative_error, run_steps, tiny_gpt2, tiny_llama, train_reference

TOL = 1e-5
LR = 3e-3


def _engine(model, config):
    import stronghold
    engine, _, _, _ = stronghold.initialize(model=model, config=config)
    return engine


@pytest.mark.parametrize("steps_before,gas,clip", [(0, 1, 0.5), (0, 2, 0.0), (2, 1, 0.0), (2, 2, 0.5)])
def test_training_with_a_background_promotion_matches_pytorch(steps_before, gas, clip):
    """Promoted before the first step (the first forward's promotion: masters only) or after steps (moments too)."""
    model, data = tiny_llama(4), batches(8)
    reference, _ = train_reference(model, data, lr=LR, gas=gas, clip=clip)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR, gas=gas, clip=clip))
    runtime = engine.stronghold_runtime
    run_steps(engine, data[:steps_before * gas])
    runtime.promote(3, 2, background=True)
    assert runtime.resident_count == 3 and sorted(runtime.stores) == [3]
    run_steps(engine, data[steps_before * gas:])
    assert runtime.promotion_fill is None and runtime.promotion_fills[0]["blocks"] == 2
    assert runtime.promotion_fills[0]["error"] is None
    assert relative_error(engine.module, reference) <= TOL
    engine.destroy()


def _gated(monkeypatch, events: list) -> threading.Event:
    """Fill copies that wait for the returned gate, each recorded in `events` as ("copy", block index)."""
    gate = threading.Event()
    copy_into = promotion_fill.Stager.copy_into
    indices = {}

    def gated(self, out, source):
        gate.wait(60)
        events.append(("copy", indices.get(out.data_ptr())))
        copy_into(self, out, source)

    original_init = promotion_fill.PromotionFill.__init__

    def init(self, device, blocks, fills, *args, **kwargs):
        for fill in fills:
            for _, out in fill.copies:
                indices[out.data_ptr()] = fill.index
        original_init(self, device, blocks, fills, *args, **kwargs)

    monkeypatch.setattr(promotion_fill.Stager, "copy_into", gated)
    monkeypatch.setattr(promotion_fill.PromotionFill, "__init__", init)
    return gate


def test_a_promoted_blocks_forward_runs_after_its_copies(monkeypatch):
    events = []
    gate = _gated(monkeypatch, events)
    model, data = tiny_gpt2(4), batches(4)
    reference, _ = train_reference(model, data, lr=LR)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR))
    runtime = engine.stronghold_runtime
    blocks = engine.module.transformer.h
    runtime.promote(3, 2, background=True)
    fill = runtime.promotion_fill
    assert not any(f.ready.is_set() for f in fill.fills.values())  # the promotion returned before any copy
    blocks[0].register_forward_pre_hook(lambda module, args: gate.set())  # the gate opens in the forward
    for index in (1, 2):
        blocks[index].register_forward_pre_hook(lambda module, args, i=index: events.append(("forward", i)))
    run_steps(engine, data)
    for index in (1, 2):
        first_forward = events.index(("forward", index))
        assert ("copy", index) in events[:first_forward] and ("copy", index) not in events[first_forward:]
    assert relative_error(engine.module, reference) <= TOL
    engine.destroy()


def test_a_failed_copy_is_raised_where_the_block_is_needed(monkeypatch):
    def fails(self, out, source):
        raise OSError("copy failed")

    monkeypatch.setattr(promotion_fill.Stager, "copy_into", fails)
    model, data = tiny_gpt2(4), batches(2)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR))
    engine.stronghold_runtime.promote(3, 2, background=True)
    with pytest.raises(RuntimeError, match="copying promoted block 1 onto the GPU failed: OSError: copy failed"):
        engine(**data[0])
    engine.destroy()  # nothing reads the values any more: not raised again


def test_the_host_buffers_go_to_the_releaser_once_copied(monkeypatch):
    import weakref

    events = []
    gate = _gated(monkeypatch, events)
    engine = _engine(tiny_llama(4), ds_config(window=2, resident=1, lr=LR))
    runtime = engine.stronghold_runtime
    gated_init = promotion_fill.PromotionFill.__init__

    def releaser_first(self, device, blocks, fills, staged, release, *args, **kwargs):
        """The fill thread goes on only once the releaser has dropped what it was handed: then whatever the thread
        itself still held would be the last reference, and free its buffer there."""
        def release_then_drain(objects, then=None):
            release(objects, then)
            runtime.releaser.drain()
        gated_init(self, device, blocks, fills, staged, release_then_drain, *args, **kwargs)

    monkeypatch.setattr(promotion_fill.PromotionFill, "__init__", releaser_first)
    run_steps(engine, batches(2))
    freed: dict[tuple[int, str], str] = {}
    for index in (1, 2):
        for name in ("master", "exp_avg", "exp_avg_sq", "working", "grad"):
            storage = getattr(runtime.stores[index], name).untyped_storage()
            weakref.finalize(storage, lambda key=(index, name): freed.setdefault(key, threading.current_thread().name))
        del storage
    runtime.promote(3, 2, background=True)
    runtime.releaser.drain()
    assert not freed  # the copies have not run: the sources are held
    gate.set()
    runtime.finish_promotion()
    runtime.releaser.drain()
    names = ("master", "exp_avg", "exp_avg_sq", "working", "grad")
    assert sorted(freed) == sorted((i, n) for i in (1, 2) for n in names)
    assert set(freed.values()) == {"stronghold-host-release"}
    engine.destroy()


def test_a_checkpoint_right_after_a_background_promotion_holds_the_copied_values(tmp_path):
    model, data = tiny_gpt2(4), batches(6)
    reference, _ = train_reference(model, data, lr=LR, clip=0.5)
    engine = _engine(model, ds_config(window=2, resident=1, lr=LR, clip=0.5))
    run_steps(engine, data[:2])
    engine.stronghold_runtime.promote(3, 2, background=True)
    engine.save_checkpoint(tmp_path, tag="t")
    resumed = _engine(tiny_gpt2(4, seed=5), ds_config(window=2, resident=1, lr=LR, clip=0.5))
    resumed.load_checkpoint(tmp_path, tag="t")
    run_steps(resumed, data[2:])
    assert relative_error(resumed.module, reference) <= TOL
    engine.destroy()
    resumed.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("staged", [True, False])
def test_on_a_gpu_the_copies_land_on_the_training_threads_stream(staged):
    """The fill's own stream, then each block's wait on the training thread's stream: what that stream reads after
    `wait` is the host's values, staged or by the driver, with the cast to bf16 after its master's copy; the host
    buffers are handed to the release callback once every copy is done."""
    from stronghold.streaming.staging import STAGED_MIN_BYTES

    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    blocks = {i: torch.nn.Linear(2, 2) for i in range(3)}
    fills, want = [], {}
    for index in blocks:
        fill = promotion_fill.BlockFill(index)
        for numel in (STAGED_MIN_BYTES // 2 + 5, 7):
            source = torch.randn(numel, generator=generator)
            master = torch.empty(numel, device=device)
            param = torch.empty(numel, device=device, dtype=torch.bfloat16)
            fill.copies.append((source, master))
            fill.casts.append((master, param))
            want[index] = want.get(index, []) + [(source.clone(), master, param)]
        fills.append(fill)
    released = []
    fill = promotion_fill.PromotionFill(device, blocks, fills, staged=staged,
                                        release=lambda objects, then: released.append(len(objects)),
                                        left_behind=[object(), object()])
    for index in blocks:
        fill.wait(index)
        for source, master, param in want[index]:
            assert torch.equal(master.cpu(), source) and torch.equal(param.cpu(), source.to(torch.bfloat16))
    fill.finish()
    assert released == [2] and fill.report()["error"] is None and fill.report()["fill_s"] is not None
