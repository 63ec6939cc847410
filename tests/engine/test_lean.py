"""The lean tier (store.py, planner Tier.LEAN): a streamed block whose gradients land in its working copy.

A lean block does the same arithmetic as a buffered one, only later (at step(), never speculatively), so
against the same run with `lean_blocks` 0 the results are bit-identical wherever that run has no early
update to redo: without clipping (its early updates are final), and with clipping that holds every step
(the forecast defers every block there too). With clipping that a block's early update only sometimes
meets, the buffered run redoes early updates (an fp32 inversion, ~1 rounding per element): 1e-6, as
test_step_state.py. The buffered run itself matches plain PyTorch (test_equivalence.py, test_exactness.py).
bf16 throughout: the lean tier needs a separate 2-byte working copy.
"""
import copy

import pytest
import torch

import stronghold

from .helpers import batches, ds_config, relative_error, tiny_llama
from .test_step_state import Boom, _nan_loss, _raise_in_backward_of

LR = 3e-3


def _engine(model, **cfg):
    cfg = ds_config(lr=LR, window=2, resident=1, bf16=True, **cfg)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=cfg)
    return engine


def _train(engine, data):
    for batch in data:
        engine.backward(engine(**batch).loss)
        engine.step()
    engine.synchronize_host()


def _masters(engine) -> dict[str, torch.Tensor]:
    by_id = engine.stronghold_runtime.master_params()
    return {n: by_id[id(p)].detach().clone() for n, p in engine.module.named_parameters()}


def _assert_same(a, b, tol: float = 0.0):
    ma, mb = _masters(a), _masters(b)
    if tol == 0.0:
        for name in ma:
            assert torch.equal(ma[name], mb[name]), name
        for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
            assert torch.equal(pa.detach(), pb.detach()), name
    else:
        assert relative_error(a.module, b.module) <= tol


@pytest.mark.parametrize("clip,tol", [(0.0, 0.0), (1e-4, 0.0), (1.0, 1e-6)])
def test_lean_blocks_train_like_buffered_ones(clip, tol):
    model, data = tiny_llama(4), batches(4)
    lean, buffered = _engine(model, clip=clip, lean_blocks=2), _engine(model, clip=clip, lean_blocks=0)
    stores = lean.stronghold_runtime.stores
    assert [i for i in sorted(stores) if stores[i].lean] == [1, 2]  # the first streamed blocks
    _train(lean, data)
    _train(buffered, data)
    _assert_same(lean, buffered, tol)
    assert lean.stronghold_report()["lean_blocks"] == 2


def test_lean_store_keeps_its_gradients_in_the_working_copy():
    """No gradient buffer: the host holds exactly 2 bytes per trainable parameter less per lean block."""
    model = tiny_llama(4)
    lean, buffered = _engine(model, lean_blocks=3), _engine(model, lean_blocks=0)
    for index, store in lean.stronghold_runtime.stores.items():
        assert store.lean and store.grad.data_ptr() == store.working.data_ptr()
        assert store.grad.numel() == store.trainable_numel
    saved = sum(s.trainable_numel * 2 for s in lean.stronghold_runtime.stores.values())
    assert buffered.stronghold_runtime.host_bytes.live - lean.stronghold_runtime.host_bytes.live == saved


@pytest.mark.parametrize("where", ["lean", "buffered", "resident"])
def test_exception_in_backward_restores_the_lean_weights(where):
    """Backward fails after (or before) some lean blocks' gradients overwrote their weights: the step is
    discarded and the weights come back from the masters, bit for bit (clip 1e-4 defers every update)."""
    model, data = tiny_llama(4), batches(5)
    layer = {"lean": 1, "buffered": 3, "resident": 0}[where]
    engine = _engine(model, clip=1e-4, lean_blocks=2)
    _train(engine, data[:1])
    handle = _raise_in_backward_of(engine.module.model.layers[layer])
    loss = engine(**data[1]).loss
    with pytest.raises(Boom):
        engine.backward(loss)
    handle.remove()
    _train(engine, data[2:])
    clean = _engine(model, clip=1e-4, lean_blocks=2)
    _train(clean, data[:1] + data[2:])
    _assert_same(engine, clean)


def test_non_finite_step_restores_the_lean_weights():
    model, data = tiny_llama(4), batches(4)
    engine = _engine(model, clip=0.0, lean_blocks=3)
    _train(engine, data[:2])
    before = _masters(engine)
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.backward(_nan_loss(engine, data[2], "everywhere"))
    engine.step()
    engine.synchronize_host()
    assert engine.skipped_steps == 1
    after = _masters(engine)
    for name, param in engine.module.named_parameters():
        assert torch.equal(param.detach(), weights[name]) and torch.equal(after[name], before[name]), name
    _train(engine, data[3:])
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


@pytest.mark.parametrize("cfg,why", [(dict(bf16=False), "float32"), (dict(gas=2), "accumulation 2")])
def test_lean_blocks_need_bf16_without_accumulation(cfg, why):
    settings = dict(window=2, resident=1, lean_blocks=1, bf16=True, lr=LR)
    settings.update(cfg)
    with pytest.raises(ValueError, match=rf"lean_blocks 1 needs bf16.*{why}.*\"auto\" or 0"):
        stronghold.initialize(model=tiny_llama(4), config=ds_config(**settings))
