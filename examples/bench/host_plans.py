"""The start-up plan stronghold would make for real-model shapes, computed on the CPU: no GPU, no allocation (the
models are built on the meta device), so the record is planner arithmetic, not a measurement.

    python3 -m examples.bench.host_plans --models llama3-8b --out results/hf/llama3_8b.jsonl --hosts GIB[,GIB...] \
        [--caps 24,16] [--local-ranks 1,2] [--blockwise]

For each shape (Llama-3-8B, Qwen2.5-7B: micro-batch 1, seq 2048, GA 8, bf16, untied), GPU cap and host budget (GiB,
the `Budgets.host_bytes` the planner gets: available memory plus the model's own CPU bytes) and number of
data-parallel ranks on the node (each with that GPU cap, sharing the host) it runs
`initial_plan.initial_plan` with the no-knob settings and appends one JSON line: the plan's tiers, its savers
(spares, compact masters, pooled gradient buffers), its host and GPU bytes by part, or the refusal's text. What a
GPU run measures against it (host peak, GPU peak) is the bench's HF point (examples/bench/peers.sh llama8b).
`--blockwise`: with `"blockwise_backward": true`, and its kept inputs' page-locked host slots (every block's input but
the first's, of every micro-batch) off the host budget, as the plans from the first forward on take them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from examples.bench.store import current_provenance, now_iso  # noqa: E402

GIB = 2 ** 30
SHAPES = {
    "llama3-8b": dict(cls="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=5e5),
    "qwen2.5-7b": dict(cls="Qwen2ForCausalLM", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
}
ACCUMULATION = 8
SEQ = 2048


def kept_input_bytes(shape: dict, accumulation: int = ACCUMULATION) -> int:
    """The blockwise backward's kept inputs a step in host slots (planning/schedule_choice.kept_bytes): micro-batch 1
    of SEQ tokens, bf16 hidden states."""
    from stronghold.planning import schedule_choice
    return schedule_choice.kept_bytes(_spec(shape, accumulation), SEQ * shape["hidden_size"] * 2, True)


def _spec(shape: dict, accumulation: int = ACCUMULATION, dtype: torch.dtype = torch.bfloat16):
    """The planner's ModelSpec of `shape` ("cls": a transformers class name, the rest its config's fields; untied
    unless the fields say otherwise), from a model built on the meta device."""
    import transformers
    from stronghold.integrations.discovery import find_blocks
    from stronghold.planning import plan_inputs
    fields = {"tie_word_embeddings": False, **shape}
    cls = getattr(transformers, fields.pop("cls"))
    with torch.device("meta"):
        model = cls(cls.config_class(**fields))
    parts = find_blocks(model, None, None)
    trainable = {id(p) for p in model.parameters()}
    return plan_inputs.model_spec(model, parts, trainable, dtype, accumulation)


def plan_record(name: str, spec, cap_gb: float, host_gb: float, local_ranks: int = 1,
                drive: Optional[tuple[float, float, float]] = None, kept_bytes: Optional[int] = None) -> dict:
    """`drive`: (free GiB, read GB/s, write GB/s) of a drive under "nvme_path", as the start-up log reports them.
    `kept_bytes`: plan with the blockwise backward, its kept inputs' host slots (`kept_input_bytes`) off the budget."""
    from stronghold.planning.schedule_choice import beside_kept_inputs
    from stronghold.config import parse_stronghold_section, resolve
    from stronghold.planning.initial_plan import initial_plan
    from stronghold.planning.planner import Budgets, Drive
    from stronghold.planning.plan_inputs import drive_slots
    section = ({} if drive is None else {"nvme_path": "<drive>"}) | (
        {} if kept_bytes is None else {"blockwise_backward": True})
    settings = resolve(parse_stronghold_section({"stronghold": section}), torch.device("cuda"))
    disk = None if drive is None else Drive(free_bytes=int(drive[0] * GIB), read_bytes_per_s=drive[1] * 1e9,
                                            write_bytes_per_s=drive[2] * 1e9, **drive_slots(settings))
    record = {"kind": "planned", "script": "examples/bench/host_plans.py", "model": name, "date": now_iso(),
              "commit": current_provenance().commit, "device": "none: planner arithmetic on the CPU",
              "config": {"gpu_cap_GB": cap_gb, "host_budget_GB": host_gb, "local_ranks": local_ranks,
                         "micro_batch": 1, "seq": SEQ,
                         "accumulation": ACCUMULATION, "bf16": True, "stronghold": section,
                         **({} if kept_bytes is None else {"kept_inputs_GB": kept_bytes / GIB}),
                         **({} if drive is None else {"drive": {"free_GB": drive[0], "read_GB_s": drive[1],
                                                               "write_GB_s": drive[2]}})},
              "params": sum(b.numel for b in spec.blocks) + spec.rest_numel}
    try:
        budget = Budgets(gpu_bytes=int(cap_gb * GIB), host_bytes=int(host_gb * GIB), local_ranks=local_ranks,
                         drive=disk)
        plan = initial_plan(spec, beside_kept_inputs(budget, kept_bytes) if kept_bytes else budget, settings)
    except MemoryError as err:
        return {**record, "fits": False, "refusal": str(err)}
    host, gpu = plan.host, plan.gpu
    return {**record, "fits": True, "resident_blocks": plan.resident_blocks, "window_size": plan.window_size,
            "rest_tiers": {part: tier.value for part, tier in plan.rest_tiers},
            "gradient_spares": plan.gradient_spares, "compact_master": plan.compact_master,
            "pooled_grads": plan.pooled_grads, "nvme_blocks": plan.nvme_blocks,
            "predicted_nvme_s": plan.floor.nvme_s,
            "nvme_buffers": min(plan.drive.slots, plan.nvme_blocks) if plan.drive is not None else 0,
            "host_GB": {"needed": host.needed / GIB, "master_and_moments": host.master_and_moments / GIB,
                        "working": host.working / GIB, "grads": host.grads / GIB,
                        "accumulators": host.accumulators / GIB, "margin": host.margin / GIB},
            "gpu_GB": {"needed": gpu.needed / GIB, "rest": gpu.rest / GIB, "window": gpu.window / GIB,
                       "activations": gpu.activations / GIB, "margin": gpu.margin / GIB}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m examples.bench.host_plans", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines appended here")
    parser.add_argument("--caps", default="24,16", help="GPU caps, GiB")
    parser.add_argument("--hosts", required=True,
                        help="host budgets, GiB: what the planner would get on the machines in question (the "
                             "start-up log's host budget)")
    parser.add_argument("--models", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--local-ranks", default="1", help="data-parallel ranks on the node, each with the cap")
    parser.add_argument("--drive", default=None, metavar="FREE_GB,READ_GB_S,WRITE_GB_S",
                        help="plan with a drive under \"nvme_path\": its free GiB and rates (the start-up log's)")
    parser.add_argument("--blockwise", action="store_true",
                        help="plan with \"blockwise_backward\": true, its kept inputs' host slots off the budget")
    args = parser.parse_args(argv)
    drive = None
    if args.drive is not None:
        drive = tuple(float(v) for v in args.drive.split(","))
        if len(drive) != 3 or min(drive) <= 0:
            parser.error(f"--drive {args.drive!r}: three positive numbers, free GiB, read and write GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for name in args.models.split(","):
            spec = _spec(SHAPES[name])
            for cap in (float(c) for c in args.caps.split(",")):
                for host in (float(h) for h in args.hosts.split(",")):
                    for ranks in (int(r) for r in args.local_ranks.split(",")):
                        record = plan_record(name, spec, cap, host, ranks, drive,
                                             kept_input_bytes(SHAPES[name]) if args.blockwise else None)
                        out.write(json.dumps(record) + "\n")
                        what = (f"{record['host_GB']['needed']:.2f} GiB host, compact {record['compact_master']}, "
                                f"pooled {record['pooled_grads']}, nvme blocks {record['nvme_blocks']} "
                                f"({record['nvme_buffers']} staging buffers), "
                                f"rest {record['rest_tiers']}" if record["fits"]
                                else "refused")
                        print(f"[host_plans] {name} cap {cap:g} GiB, host {host:g} GiB, {ranks} rank(s): {what}",
                              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
