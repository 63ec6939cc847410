"""Tiny models, data and the two training loops compared by the equivalence tests.

The reference is plain PyTorch: the same model and data, `torch.optim.AdamW`, loss / GAS summed
over micro-steps, `clip_grad_norm_` over the whole model, one optimizer step per boundary.
"""
from __future__ import annotations

import copy
import ctypes
import logging
import time
import warnings
from typing import Callable, Optional

import pytest
import torch
from torch import nn

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*torch.utils.checkpoint.*")

VOCAB, SEQ, BATCH = 96, 16, 2


def tiny_gpt2(n_layer: int = 4, seed: int = 0, tie: bool = True, n_embd: int = 32) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def tiny_llama(n_layer: int = 4, seed: int = 0, tie: bool = False, qwen2: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cls, cfg_cls = (Qwen2ForCausalLM, Qwen2Config) if qwen2 else (LlamaForCausalLM, LlamaConfig)
    cfg = cfg_cls(num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tie,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return cls(cfg)


def batches(n: int, seed: int = 1, batch: int = BATCH) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def ds_config(*, window: int = 2, resident: int = 1, gas: int = 1, clip: float = 0.0, lr: float = 1e-2,
              weight_decay: float = 0.1, bf16: bool = False, scheduler: Optional[dict] = None, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": weight_decay}},
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10 ** 9,
        # Kernels off: under TRITON_INTERPRET they are slow, and tests/ops covers them (one engine
        # test turns them on).
        "stronghold": {"window_size": window, "resident_blocks": resident, "kernels": False, **extra},
    }
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    return cfg


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainer-style groups: no decay on biases and norm weights."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_reference(model: nn.Module, data: list[dict], *, lr: float = 1e-2, weight_decay: float = 0.1,
                    gas: int = 1, clip: float = 0.0, groups: bool = False,
                    lrs: Optional[list[float]] = None) -> tuple[nn.Module, list[float]]:
    model = copy.deepcopy(model)
    model.train()
    params = param_groups(model, weight_decay) if groups else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    losses = []
    for i, batch in enumerate(data):
        loss = model(**batch).loss
        (loss / gas).backward()
        losses.append(loss.item())
        if (i + 1) % gas == 0:
            if lrs is not None:
                for group in opt.param_groups:
                    group["lr"] = lrs[i // gas]
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, losses


def train_stronghold(model: nn.Module, data: list[dict], config: dict, *, groups: bool = False,
                     weight_decay: float = 0.1, blocks=None):
    import stronghold
    model = copy.deepcopy(model)
    model.train()
    params = param_groups(model, weight_decay) if groups else None
    engine, _, _, _ = stronghold.initialize(model=model, model_parameters=params, config=config, blocks=blocks)
    losses, engine.lrs_used = [], []
    for batch in data:
        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            engine.lrs_used.append(engine.get_lr()[0])
        engine.step()
        losses.append(loss.item())
    engine.synchronize_host()
    return engine, losses


def deepspeed_reference(model: nn.Module, config: dict):
    """Plain DeepSpeed over a copy of `model`: the same ds.json less the "stronghold" section, with a
    `torch.optim.AdamW` of the ds.json optimizer's hyperparameters as the client optimizer (stage 0, fp32 on the
    CPU: DeepSpeed applies it as it is). The engine whose call sequences stronghold's must reproduce."""
    import deepspeed
    model = copy.deepcopy(model)
    model.train()
    params = config["optimizer"]["params"]
    config = {k: v for k, v in config.items() if k not in ("stronghold", "optimizer")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]),
                                  eps=params["eps"], weight_decay=params["weight_decay"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def caught_up(engine) -> None:
    """Wait until the CPU worker has run every job backward handed it, as on a host where it keeps up: step() then
    finds each early update begun, so it claims none (test_claims.py covers claims). For the tests of the early
    update path (speculation, redo), whose counts would otherwise depend on how fast the box schedules the worker."""
    cpu = engine.stronghold_runtime.cpu
    if cpu is not None:
        cpu.drain()


def train_caught_up(engine, data: list[dict], loss: Callable) -> object:
    """Each micro-batch's `loss(engine, batch, i)` backward, the worker caught up (`caught_up`), then step(); the
    final weights synchronized into the module. Returns the engine."""
    for i, batch in enumerate(data):
        engine.backward(loss(engine, batch, i))
        caught_up(engine)
        engine.step()
    engine.synchronize_host()
    return engine


def engine_for(model: nn.Module, **config) -> object:
    """A stronghold engine on a copy of `model`, configured by `ds_config(**config)`."""
    import stronghold
    engine, _, _, _ = stronghold.initialize(model=copy.deepcopy(model), config=ds_config(**config))
    return engine


def check_bit_identical_to_host(model: nn.Module, data: list[dict], **config) -> object:
    """Train on `data` with `config` and with `config` but its last setting false (host accumulation): every parameter
    ends bit for bit the same. Returns the engine with the setting."""
    setting = list(config)[-1]
    runs, engine = {}, None
    for on in (False, True):
        engine = engine_for(model, **{**config, setting: on})
        run_steps(engine, data)
        runs[on] = named_params(engine.module)
    for name in runs[False]:
        assert torch.equal(runs[False][name], runs[True][name]), name
    return engine


def check_against_host_and_reference(model: nn.Module, data: list[dict], *, lr: float, gas: int, clip: float,
                                     tol: float, reference_tol: float, **setting) -> None:
    """An engine with `setting` trained on `data` takes every optimizer step and ends within `tol` (relative) of the
    same engine without it (host accumulation) and within `reference_tol` of plain PyTorch."""
    reference, _ = train_reference(model, data, lr=lr, gas=gas, clip=clip)
    host = engine_for(model, lr=lr, gas=gas, clip=clip)
    run_steps(host, data)
    engine = engine_for(model, lr=lr, gas=gas, clip=clip, **setting)
    run_steps(engine, data)
    assert engine.global_steps == len(data) // gas
    assert relative_error(engine.module, host.module) <= tol
    assert relative_error(engine.module, reference) <= reference_tol


def train_loop(engine, data: list[dict]) -> None:
    """Forward, backward and step per micro-batch, as a user's loop (no host synchronization after)."""
    for batch in data:
        engine.backward(engine(**batch).loss)
        engine.step()


def spawn_ranks(worker: Callable, args: tuple, nprocs: int, timeout_s: float) -> None:
    """Run `worker(rank, out, port, *args[1:])` on `nprocs` spawned processes (`args[0]` is `out`); fail (and stop
    them) if they do not finish within `timeout_s`.

    The rendezvous store listens here, on a port the kernel picks and that stays taken: a port found free,
    closed and bound again by rank 0 seconds later (after spawn and imports) can be taken meanwhile, e.g. by
    rank 1's own connection attempts to it (a TCP self-connect), and every test of the file then errors in
    setup with EADDRINUSE."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = torch.multiprocessing.start_processes(worker, args=(args[0], store.port, *args[1:]), nprocs=nprocs,
                                                     join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {nprocs} ranks did not finish within {timeout_s} s (a collective hung?)")


def run_steps(engine, data: list[dict], before_step: Optional[Callable] = None) -> list[float]:
    """The engine's training loop (forward, backward, step per micro-batch), then `synchronize_host`
    so the module's parameters hold the final weights. `before_step(engine, i)` runs between backward
    and step of micro-batch i. Returns the losses."""
    losses = []
    for i, batch in enumerate(data):
        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        engine.backward(loss)
        if before_step is not None:
            before_step(engine, i)
        engine.step()
        losses.append(loss.item())
    engine.synchronize_host()
    return losses


def failing_call(number: int, error: int) -> tuple[Callable[..., int], list[tuple]]:
    """A stand-in for a C call through ctypes that returns 0 until its `number`th call, which sets errno to `error`
    and returns -1; with the list of each call's arguments."""
    calls: list[tuple] = []

    def call(*args) -> int:
        calls.append(args)
        if len(calls) == number:
            ctypes.set_errno(error)
            return -1
        return 0

    return call, calls


def on_device(engine, data: list[dict]) -> list[dict]:
    """The batches on the engine's device (the CUDA GPU where the tests run on one)."""
    return [{name: value.to(engine.device) for name, value in batch.items()} for batch in data]


def train_through_a_failed_walk(engine, data: list[dict], on_failure: Callable[[int], None] = lambda i: None,
                                after_step: Callable[[int], None] = lambda i: None) -> list[bool]:
    """The training loop of a blockwise engine (tiny_llama) whose first walk fails once (an error injected into block
    1's forward): the failed boundary micro-batch is run again. `on_failure(i)` runs after the failure at micro-batch
    i, `after_step(i)` after each step(). Returns the failures (one)."""
    runtime, failures = engine.stronghold_runtime, []

    def fail_once(module, args):
        if runtime.blockwise.walking and not failures:
            failures.append(True)
            raise RuntimeError("injected")

    engine.module.model.layers[1].register_forward_pre_hook(fail_once)
    for i, batch in enumerate(on_device(engine, data)):
        loss = engine(**batch).loss
        try:
            engine.backward(loss)
        except RuntimeError as err:
            assert "injected" in str(err)
            on_failure(i)
            loss = engine(**batch).loss  # the boundary micro-batch again; the window's earlier ones are kept
            engine.backward(loss)
        engine.step()
        after_step(i)
    return failures


def named_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of a model's parameters by name (to compare across processes)."""
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def relative_error(a, b) -> float:
    """Whole-model relative parameter error ||a - b|| / ||b|| (by parameter name), of two models or two
    `named_params` dicts."""
    pa, pb = (dict(m.named_parameters()) if isinstance(m, nn.Module) else m for m in (a, b))
    assert pa.keys() == pb.keys()
    num = sum(float((pa[k].detach().float().cpu() - pb[k].detach().float().cpu()).pow(2).sum()) for k in pa)
    den = sum(float(pb[k].detach().float().cpu().pow(2).sum()) for k in pb)
    return (num / den) ** 0.5


def cpu_window(n_blocks: int, window: int):
    """A streaming.window.Window over `n_blocks` one-parameter blocks (block i's 4 weights all i) with `window` slots,
    on the CPU."""
    from stronghold.streaming.schedule import WindowSchedule
    from stronghold.streaming.store import ParamEntry, build_block_store
    from stronghold.streaming.streams import Transfers
    from stronghold.streaming.window import Window
    stores = {}
    for i in range(n_blocks):
        param = torch.nn.Parameter(torch.full((4,), float(i)))
        stores[i] = build_block_store(i, [ParamEntry(f"b{i}", param, 0, 4, param.shape, 0)], torch.float32,
                                      pin=False, accumulate=False)
    transfers = Transfers(torch.device("cpu"))
    transfers.allocate_slots(window, 4, torch.float32)
    return Window(stores, WindowSchedule(tuple(range(n_blocks)), window), transfers)


def checkpoint_outside_forward() -> bool:
    """Whether transformers' GradientCheckpointingLayer checkpoints the layer's `__call__` (up to 5.23), so the
    checkpoint runs outside a compiled forward and compiled blocks go reentrant (integrations/reentrant.py); from
    5.24 it checkpoints `forward`, inside the compiled code, and Dynamo compiles the checkpoint itself."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    return "__call__" in vars(GradientCheckpointingLayer)
