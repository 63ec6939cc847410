"""Engine checkpoints (stronghold/checkpoint/save.py): exact resume, across window sizes and residency,
atomic saves under an injected failure, and loads that never unpickle code."""
import copy
import pickle

import pytest
import torch

import stronghold
from stronghold.checkpoint import save as checkpoint
from stronghold.checkpoint import load as checkpoint_load
from stronghold.checkpoint.files import write_manifest
from tests.engine.helpers import batches, ds_config, relative_error, run_steps, tiny_gpt2, tiny_llama

LR = 3e-3
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4,
                                         "warmup_type": "linear"}}


def make_engine(model, **config):
    cfg = ds_config(lr=LR, scheduler=WARMUP, **config)
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=cfg)
    return engine


def train(engine, data):
    run_steps(engine, data)
    return engine


def snapshot(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("saved,loaded", [
    ({"window": 2, "resident": 1}, {"window": 2, "resident": 1}),
    ({"window": 2, "resident": 0}, {"window": 3, "resident": 2}),
    ({"window": 3, "resident": 1}, {"window": 2, "resident": 4}),
])
def test_resume_is_exact_across_window_and_residency(tmp_path, saved, loaded):
    model, data = tiny_gpt2(4), batches(8)
    common = {"gas": 2, "clip": 0.05}
    whole = train(make_engine(model, **saved, **common), data)
    first = train(make_engine(model, **saved, **common), data[:4])
    # Every `saved` layout streams blocks, so there is a CPU optimizer whose choice must carry over.
    cpu = first.stronghold_runtime.cpu
    assert cpu is not None and cpu.forecast.block_sq and sum(cpu.forecast.block_sq.values()) + cpu.forecast.other_sq > \
        0.05 ** 2, "the test must save after a clipped step, so the resumed run must defer its next update"
    first.save_checkpoint(tmp_path, client_state={"note": "mid", "seen": 4})
    written = checkpoint_load.saved_config(tmp_path)
    assert written["stronghold"]["window_size"] == saved["window"] and written["resident_blocks"] == saved["resident"]
    resumed = make_engine(model, **loaded, **common)
    path, client = resumed.load_checkpoint(tmp_path)
    assert path.endswith("global_step2") and client == {"note": "mid", "seen": 4}
    assert resumed.global_steps == 2 and resumed.get_lr() == first.get_lr()
    if resumed.stronghold_runtime.cpu is not None:
        assert resumed.stronghold_runtime.cpu.forecast.state_dict() == cpu.forecast.state_dict(), \
            "the resumed run takes the uninterrupted run's path"
    train(resumed, data[4:])
    assert relative_error(resumed.module, whole.module) <= 1e-6


def test_bf16_load_refreshes_working_copies(tmp_path):
    model, data = tiny_llama(4), batches(3)
    first = train(make_engine(model, window=2, resident=1, bf16=True), data[:2])
    first.save_checkpoint(tmp_path)
    masters = {n: t.clone() for n, t in ((n, first.stronghold_runtime.master_params()[id(p)])
                                         for n, p in first.module.named_parameters())}
    resumed = make_engine(model, window=3, resident=0, bf16=True)
    resumed.load_checkpoint(tmp_path)
    resumed.synchronize_host()
    got = resumed.stronghold_runtime.master_params()
    for name, param in resumed.module.named_parameters():
        assert torch.equal(got[id(param)].cpu(), masters[name].cpu()), name
        assert torch.equal(param.detach().cpu(), masters[name].to(torch.bfloat16).cpu()), name


def test_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    model, data = tiny_gpt2(4), batches(4)
    engine = train(make_engine(model), data[:2])
    engine.save_checkpoint(tmp_path)
    at_save = snapshot(engine)
    train(engine, data[2:])
    calls = []

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return real(tensors, path, metadata=metadata)

    real = checkpoint.save_file
    monkeypatch.setattr(checkpoint, "save_file", failing)
    with pytest.raises(OSError, match="injected"):
        engine.save_checkpoint(tmp_path)
    assert len(calls) == 2
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "latest"], "no partial directory left"
    fresh = make_engine(model)
    fresh.load_checkpoint(tmp_path)
    fresh.synchronize_host()
    for name, param in fresh.module.named_parameters():
        assert torch.equal(param.detach(), at_save[name]), name


def test_failed_resave_of_the_same_tag_keeps_the_old_copy(tmp_path, monkeypatch):
    model, data = tiny_gpt2(4), batches(3)
    engine = train(make_engine(model), data[:2])
    engine.save_checkpoint(tmp_path, tag="best")
    at_save = snapshot(engine)
    train(engine, data[2:])
    real_replace = checkpoint.os.replace

    def crash_after_moving_the_old_copy(src, dst):
        real_replace(src, dst)
        if str(dst).endswith(".best.previous"):
            raise KeyboardInterrupt("killed between the two renames (injected)")

    monkeypatch.setattr(checkpoint.os, "replace", crash_after_moving_the_old_copy)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path, tag="best")
    monkeypatch.undo()
    fresh = make_engine(model)
    with pytest.warns(UserWarning, match="previous copy"):
        path, _ = fresh.load_checkpoint(tmp_path, tag="best")
    assert path.endswith(".best.previous")
    fresh.synchronize_host()
    for name, param in fresh.module.named_parameters():
        assert torch.equal(param.detach(), at_save[name]), name


class Payload:
    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_loading_never_unpickles_objects(tmp_path):
    model = tiny_gpt2(2)
    engine = train(make_engine(model), batches(1))
    engine.save_checkpoint(tmp_path, tag="t")
    meta = tmp_path / "t" / checkpoint.META
    torch.save({"format": 2, "evil": Payload()}, meta)
    # Checksums catch corruption, not a forger who rewrites the manifest too: re-seal, so the
    # weights_only load is what must refuse the payload.
    write_manifest(tmp_path / "t")
    with pytest.raises(pickle.UnpicklingError, match="meta.pt"):
        make_engine(model).load_checkpoint(tmp_path, tag="t")


def test_unstorable_client_state_fails_before_writing(tmp_path):
    engine = train(make_engine(tiny_gpt2(2)), batches(1))
    with pytest.raises(ValueError, match="client_state cannot be stored"):
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"callback": Payload()})
    assert not (tmp_path / "ckpt").exists(), "the check runs before the save directory is even created"


def test_mismatched_checkpoint_fails_and_changes_nothing(tmp_path):
    small = train(make_engine(tiny_gpt2(2)), batches(1))
    small.save_checkpoint(tmp_path)
    other = make_engine(tiny_gpt2(4, seed=3))
    before = snapshot(other)
    # The 2-layer checkpoint lacks the 4-layer model's blocks 2 and 3 (12 tensors each), and the error
    # names them.
    with pytest.raises(ValueError, match=r"24 missing \(e\.g\. \['transformer\.h\.2\..*0 unexpected"):
        other.load_checkpoint(tmp_path)
    other.synchronize_host()
    assert all(torch.equal(p.detach(), before[n]) for n, p in other.module.named_parameters())


def _named(message: str, kind: str) -> set:
    """The names listed after `<kind> key(s) in state_dict: ` in torch's format ("a", "b".); none if absent."""
    head = f"{kind} key(s) in state_dict: "
    if head not in message:
        return set()
    listed = message.split(head, 1)[1].split('".', 1)[0]  # up to the closing quote and full stop
    return {name.lstrip('"') for name in listed.split('", ')}


@pytest.mark.parametrize("direction", ["into_bigger", "into_smaller"])
def test_non_strict_load_warns_with_torchs_missing_and_unexpected_names(tmp_path, direction):
    """The issue's case: a 2-layer checkpoint into a 4-layer model with load_module_strict=False loaded with no word
    about the 24 tensors it lacks. It warns now, naming every missing and unexpected tensor as torch's
    load_state_dict reports them, and still loads the tensors that match."""
    small, big = tiny_gpt2(2), tiny_gpt2(4, seed=3)
    saved, into = (small, big) if direction == "into_bigger" else (big, small)
    source = train(make_engine(saved), batches(1))
    source.save_checkpoint(tmp_path)
    engine = make_engine(into)
    with pytest.warns(UserWarning, match="load_module_strict=False") as caught:
        engine.load_checkpoint(tmp_path, load_module_strict=False)
    message = str(next(w.message for w in caught if "load_module_strict=False" in str(w.message)))
    torchs = copy.deepcopy(into).load_state_dict(copy.deepcopy(saved).state_dict(), strict=False)
    assert _named(message, "Missing") == set(torchs.missing_keys)
    assert _named(message, "Unexpected") == set(torchs.unexpected_keys)
    assert torchs.missing_keys or torchs.unexpected_keys
    engine.synchronize_host()
    source.synchronize_host()
    theirs = dict(source.module.named_parameters())
    for name, param in engine.module.named_parameters():
        if name in theirs:
            assert torch.equal(param.detach(), theirs[name].detach()), name


def _diverged(tmp_path, kind: str, where: str):
    """A checkpoint whose run diverged: one streamed block's (or the resident embedding's) fp32 `kind` tensor holds a
    NaN and an inf, saved with a valid manifest. Returns the key that names it."""
    model = tiny_gpt2(4)
    engine = train(make_engine(model, window=2, resident=1), batches(2))
    engine.synchronize_host()
    runtime = engine.stronghold_runtime
    if where == "streamed":
        store = runtime.stores[2]
        entry = store.trainable[0]
        tensor, name = {"master": store.master, "exp_avg": store.exp_avg}[kind], entry.name
        tensor[entry.offset], tensor[entry.offset + 1] = float("nan"), float("inf")
    else:
        name = "transformer.wte.weight"
        param = dict(engine.module.named_parameters())[name]
        optimizer = next(c.optimizer for c in runtime.resident.chunks if any(p is param for p in c.params))
        tensor = param.data if kind == "master" else optimizer.state[param]["exp_avg"]
        tensor.view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
    engine.save_checkpoint(tmp_path)
    return model, f"{kind}/{name}"


@pytest.mark.parametrize("where", ["streamed", "resident"])
@pytest.mark.parametrize("kind", ["master", "exp_avg"])
def test_non_finite_checkpoint_is_refused_by_name_unless_allowed(tmp_path, kind, where):
    """The issue's case: a checkpoint with NaN weights loaded silently, after which every step was skipped. It is
    refused now, naming the tensor, before anything changes; `allow_non_finite=True` loads it as it is."""
    model, key = _diverged(tmp_path, kind, where)
    fresh = make_engine(model, window=3, resident=0)
    fresh.synchronize_host()
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=rf"inf or NaN in 1 tensor\(s\): {key.replace('.', '[.]')}; .*allow_non_finite=True"):
        fresh.load_checkpoint(tmp_path)
    fresh.synchronize_host()
    assert fresh.global_steps == 0 and all(torch.equal(p.detach(), before[n]) for n, p in fresh.module.named_parameters())
    fresh.load_checkpoint(tmp_path, allow_non_finite=True)
    fresh.synchronize_host()
    assert fresh.global_steps == 2
    if kind == "master":
        value = dict(fresh.module.named_parameters())[key.split("/", 1)[1]].detach().reshape(-1)[:2]
        assert value[0].isnan() and value[1].isinf()


def test_missing_checkpoint_returns_none(tmp_path):
    engine = make_engine(tiny_gpt2(2))
    with pytest.warns(UserWarning, match="no checkpoint found"):
        assert engine.load_checkpoint(tmp_path / "nothing") == (None, None)


@pytest.mark.parametrize("exclude", [False, True])
def test_frozen_parameters(tmp_path, exclude):
    from safetensors import safe_open
    model = tiny_llama(4)
    frozen = ["model.layers.2.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    engine = train(make_engine(model, window=2, resident=1), batches(2))
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=exclude)
    keys = set()
    for path in (tmp_path / "global_step2").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    assert all((f"frozen/{name}" in keys) != exclude for name in frozen)
    assert not any(f"exp_avg/{name}" in keys for name in frozen)
    fresh = make_engine(model, window=3, resident=0)
    fresh.load_checkpoint(tmp_path)
    fresh.synchronize_host()
    assert relative_error(fresh.module, engine.module) == 0.0


def test_load_module_only_takes_the_weights_and_nothing_else(tmp_path):
    model = tiny_gpt2(4)
    engine = train(make_engine(model), batches(2))
    engine.save_checkpoint(tmp_path)
    fresh = make_engine(model, window=3, resident=0)
    path, _ = fresh.load_checkpoint(tmp_path, load_module_only=True)
    fresh.synchronize_host()
    assert path.endswith("global_step2") and relative_error(fresh.module, engine.module) == 0.0
    assert fresh.global_steps == 0 and all(e.step == 0 for s in fresh.stronghold_runtime.stores.values()
                                           for e in s.entries)
    assert all(float(s.exp_avg.abs().sum()) == 0.0 for s in fresh.stronghold_runtime.stores.values())


def tiny_gpt2_with_dropout(n_layer: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel
    from tests.engine.helpers import SEQ, VOCAB
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1,
                                      attn_pdrop=0.1))


def test_resume_with_dropout_is_bit_exact(tmp_path):
    """Dropout draws from torch's RNG every step, so this checks that the checkpoint restores the RNG
    state: the resumed run must draw the same masks as the uninterrupted one (same layout, fp32, CPU:
    bit-equal; a different layout changes which AdamW rounds which block)."""
    model, data = tiny_gpt2_with_dropout(), batches(8)
    common = {"window": 2, "resident": 1, "gas": 2, "clip": 0.05}
    whole = make_engine(model, **common)
    torch.manual_seed(7)
    whole_losses = run_steps(whole, data)

    first = make_engine(model, **common)
    torch.manual_seed(7)
    assert run_steps(first, data[:4]) == whole_losses[:4]
    first.save_checkpoint(tmp_path)
    torch.manual_seed(99)  # what a new process would have: a different RNG state until the load

    resumed = make_engine(model, **common)
    resumed.load_checkpoint(tmp_path)
    assert run_steps(resumed, data[4:]) == whole_losses[4:]
    assert relative_error(resumed.module, whole.module) == 0.0

    # The masks matter: the same resume with the RNG left as it was does not reproduce the run.
    unseeded = make_engine(model, **common)
    unseeded.load_checkpoint(tmp_path)
    torch.manual_seed(99)
    assert run_steps(unseeded, data[4:]) != whole_losses[4:]
