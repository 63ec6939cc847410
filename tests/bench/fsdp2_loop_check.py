"""Run by test_bench_peers.py in its own process (it initialises a process group): the fsdp2_offload system's
sharding and loop (peer_engines.apply_fsdp2 + LoopEngine) in fp32 on the CPU against plain torch AdamW in the
textbook loop, on the bench's tiny Llama. Prints one JSON line: the largest relative parameter difference after the
steps, the losses of both and the last step's gradient norms (above the clipping limit: clipping applied)."""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from examples.bench.model import build_model, random_batches  # noqa: E402
from examples.bench.peer_engines import LoopEngine, adamw_kwargs, apply_fsdp2, init_one_rank_group  # noqa: E402
from examples.bench.point import Point  # noqa: E402
from stronghold.engine.launch import single_process_env  # noqa: E402

STEPS = 3
# A limit below the tiny model's gradient norm (about 1.3 at init) so that clipping scales every step.
CLIPPING = 0.5


def train(engine: LoopEngine, batches: list[dict]) -> list[float]:
    losses = []
    for step in range(STEPS):
        for m in range(engine.accumulation):
            loss = engine(**batches[(step * engine.accumulation + m) % len(batches)]).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def train_plain(model: torch.nn.Module, accumulation: int, batches: list[dict]) -> tuple[list[float], float]:
    """The reference: the textbook loop (mean over micro-batches, torch's global-norm clipping, AdamW)."""
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **adamw_kwargs())
    losses = []
    for step in range(STEPS):
        for m in range(accumulation):
            loss = model(**batches[(step * accumulation + m) % len(batches)]).loss
            (loss / accumulation).backward()
            losses.append(float(loss))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIPPING)
        optimizer.step()
        optimizer.zero_grad()
    return losses, float(norm)


def main() -> None:
    single_process_env()
    point = Point(system="fsdp2_offload", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, seq=32, batch=2,
                  accumulation=2, vocab=300, gpu_cap_GB=None, checkpointing=True, clipping=CLIPPING)
    cpu = torch.device("cpu")
    batches = random_batches(point, 4, cpu)
    plain = build_model(point, cpu, torch.float32)
    sharded = build_model(point, cpu, torch.float32)
    apply_fsdp2(sharded, init_one_rank_group(cpu), param_dtype=torch.float32, reduce_dtype=torch.float32)
    engine = LoopEngine(module=sharded, optimizer=torch.optim.AdamW(sharded.parameters(), fused=True, **adamw_kwargs()),
                        accumulation=point.accumulation, clipping=CLIPPING)
    losses_ref, norm_ref = train_plain(plain, point.accumulation, batches)
    losses = train(engine, batches)
    worst = 0.0
    for (name, a), (_, b) in zip(plain.named_parameters(), sharded.named_parameters()):
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        worst = max(worst, float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)))
    print(json.dumps({"max_rel_diff": worst, "losses_ref": losses_ref, "losses": losses,
                      "last_norm_ref": norm_ref, "last_norm": engine.get_global_grad_norm(),
                      "steps": engine.global_steps, "fsdp_on_cpu": str(next(sharded.parameters()).to_local().device)}))


if __name__ == "__main__":
    main()
