"""A measured run's placement choice replayed through the planner on the CPU: what it would pick from that run's
own measurements (the first step's activations, the rates after placement, the budgets) with the residency left to
it, fixed at what the run built, and one block more. Planner arithmetic, not a measurement: it says which placement
to measure next, e.g. where the residency the first forward built rules out a faster layout (blocks only move onto
the GPU during a run). Beside them, the built placement's floor terms as the engine sums gradients (on the host, a
pass per micro-step) and as they would be if each block's micro-batches were summed on the GPU and went down once a
step (`gpu_sums`): the host side of a schedule that runs each block's backward for every micro-batch in turn.

    python3 -m examples.bench.replay_plan --records results/placement/data_parallel.jsonl --same-call NAME \
        [--label stronghold:1] [--out FILE]

With the choice under `"blockwise_backward": "auto"` made again from the run's first step (`"choice"`) where the run
made it, and the blockwise backward's plan at each residency up to one more than built (`"blockwise_residencies"`).
Reads the `kind: config` records of `examples.bench.data_parallel` (their shape fields and the engine's report under
"stronghold"); appends one JSON line per record to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from examples.bench import host_plans  # noqa: E402
from examples.bench.store import current_provenance, now_iso  # noqa: E402
from examples.llama import default_intermediate  # noqa: E402

GIB = 2 ** 30


def spec_of(record: dict):
    """The planner's ModelSpec of a record's shape (host_plans._spec, on the meta device)."""
    if record["arch"] in ("llama", "qwen2"):
        # A record of Llama's rule for the MLP width may leave it out (older run_one merges did).
        intermediate = record.get("intermediate") or default_intermediate(record["hidden"])
        shape = dict(cls="LlamaForCausalLM" if record["arch"] == "llama" else "Qwen2ForCausalLM",
                     hidden_size=record["hidden"], intermediate_size=intermediate,
                     num_hidden_layers=record["layers"], num_attention_heads=record["heads"],
                     num_key_value_heads=record.get("kv_heads") or record["heads"], vocab_size=record["vocab"])
    else:
        shape = dict(cls="GPT2LMHeadModel", n_embd=record["hidden"], n_layer=record["layers"], n_head=record["heads"],
                     n_positions=record["seq"], vocab_size=record["vocab"], tie_word_embeddings=True)
    dtype = torch.float32 if record.get("dtype") == "fp32" else torch.bfloat16
    return host_plans._spec(shape, record.get("accumulation", 1), dtype)


def measured_activations(measured: dict):
    """The first step's activations as the placement planned with them, with the allocator's gap (reserved beyond
    allocated at the peak): recorded by the placement, or for older records taken from its peaks."""
    from stronghold.planning import planner
    gap = measured.get("allocator_gap_bytes",
                       max(0, measured.get("peak_reserved_bytes", 0) - measured.get("peak_allocated_bytes", 0)))
    return planner.Activations(fixed_peak_bytes=measured["activations_bytes"], per_block_bytes=0,
                               allocator_gap_bytes=min(gap, measured["activations_bytes"]))


def _budgets(plan: dict):
    """The budgets a recorded plan was made against."""
    from stronghold.planning import planner
    return planner.Budgets(gpu_bytes=plan["gpu_budget_bytes"], host_bytes=plan["host_budget_bytes"],
                           local_ranks=plan["host"]["local_ranks"])


def _placed_rates(measured: dict):
    """The rates after placement (refreshed by the steps after it where the record has them)."""
    from stronghold.planning import planner
    return planner.Rates(**measured.get("rates_refreshed", measured["rates"]))


def _cached(plan: dict) -> frozenset:
    """The parts outside the blocks that a recorded plan put in the cached tier."""
    from stronghold.planning import planner
    return frozenset(name for name, tier in plan["rest_tiers"].items() if tier == planner.Tier.CACHED.value)


def _variant(spec, record: dict, resident: Optional[int]) -> dict:
    from stronghold.planning import planner
    placement = record["stronghold"]["placement"]
    plan, measured = placement["plan"], placement["measured"]
    budgets = _budgets(plan)
    activations = measured_activations(measured)
    rates = _placed_rates(measured)
    tiers = {name: planner.Tier(tier) for name, tier in plan["rest_tiers"].items()}
    n = len(spec.blocks)
    try:
        found = planner.plan(spec, activations, budgets, rates, resident_blocks=resident, activation_blocks=0,
                             lean_until=0, nvme_from=n, gpu_accumulation=None if budgets.local_ranks == 1 else False,
                             rest_tiers=tiers, gradient_spares=plan["gradient_spares"],
                             compact_master=plan["compact_master"], pooled_grads=plan["pooled_grads"])
    except MemoryError as err:
        return {"resident_blocks_asked": resident, "fits": False, "refusal": str(err)}
    return {"resident_blocks_asked": resident, "fits": True, "resident_blocks": found.resident_blocks,
            "window_size": found.window_size, "gpu_accumulation": found.gpu_accumulation,
            "predicted_step_s": found.predicted_step_s, "gpu_needed_GiB": found.gpu.needed / GIB,
            "floor_s": {k: v for k, v in found.as_dict()["floor"].items() if v}}


def gpu_sums(spec, record: dict) -> dict:
    """The built placement's floor terms with the streamed gradients summed on the host (as run, unless the run
    accumulated on the GPU) and summed on the GPU, sent down once a step in fp32 (plan_floor.floor_terms's
    `gpu_accumulation`), the latter also with no update deferred by clipping (`early`: the gradient norm under
    0.9 max_norm, so each block's update overlaps backward). Only the host's and the links' terms: where the fp32
    sums would live on the GPU is not planned, and the cached parts (embeddings, head) still sum on the host."""
    from stronghold.planning import plan_floor
    placement = record["stronghold"]["placement"]
    plan, measured = placement["plan"], placement["measured"]
    rates, cached = _placed_rates(measured), _cached(plan)
    out = {}
    for name, on_gpu, share in (("host_sums", plan.get("gpu_accumulation", False), rates.deferred_share),
                                ("gpu_sums", True, rates.deferred_share), ("gpu_sums_early", True, 0.0)):
        terms, _, _ = plan_floor.floor_terms(spec, dataclasses.replace(rates, deferred_share=share),
                                             plan["resident_blocks"], plan["window_size"],
                                             gpu_accumulation=on_gpu, cached=cached)
        out[name] = {"step_floor_s": terms.step_s, "deferred_share": share,
                     "terms_s": {k: v for k, v in dataclasses.asdict(terms).items() if v}}
    return out


def block_input_bytes(record: dict) -> int:
    """One block's input of a micro-batch (hidden states in the compute dtype), as the placement measures it."""
    return record["batch"] * record["seq"] * record["hidden"] * (4 if record.get("dtype") == "fp32" else 2)


def kept_bytes(spec, record: dict) -> int:
    """The blockwise backward's kept inputs a step, each way (planning/schedule_choice.kept_bytes)."""
    from stronghold.planning import schedule_choice
    return schedule_choice.kept_bytes(spec, block_input_bytes(record), True)


def schedules(spec, record: dict) -> dict:
    """The built placement's floor with host accumulation (plan_floor.py, the default's schedule) and with the
    blockwise backward (plan_blockwise.py), from the record's own measured rates: the planner's view of which schedule
    is faster at the placement the run built, beside the step it measured."""
    from stronghold.planning import plan_blockwise, plan_floor
    placement = record["stronghold"]["placement"]
    plan, measured = placement["plan"], placement["measured"]
    rates, cached = _placed_rates(measured), _cached(plan)
    resident, window = plan["resident_blocks"], plan["window_size"]
    host, _, _ = plan_floor.floor_terms(spec, rates, resident, window, cached=cached)
    blockwise, h2d, d2h = plan_blockwise.floor_terms(spec, rates, resident, window, cached, kept_bytes(spec, record),
                                                     block_input_bytes(record))
    return {"host_accumulation_s": host.step_s, "blockwise_s": blockwise.step_s,
            "blockwise_terms_s": {k: v for k, v in dataclasses.asdict(blockwise).items() if v},
            "blockwise_h2d_GB": h2d / 1e9, "blockwise_d2h_GB": d2h / 1e9,
            "measured_step_s": record.get("step_s"), "measured_blockwise": bool(_blockwise_on(record)),
            "deferred_share": rates.deferred_share}


def blockwise_residencies(spec, record: dict) -> list[dict]:
    """The blockwise backward's plan at each residency from none to one more than built, the window "auto" (with
    accumulation: the largest that fits), from the run's budgets (the host's less the kept inputs' slots), measured
    activations and rates: which residency the blockwise floor favours where the run built more (blocks only move onto
    the GPU, so a residency under the built one is out of the run's reach)."""
    from stronghold.planning import plan_blockwise, plan_inputs, planner, schedule_choice
    placement = record["stronghold"]["placement"]
    plan, measured = placement["plan"], placement["measured"]
    # The kept inputs' page-locked slots come off the host budget, as the engine's own blockwise plans take them.
    kept = kept_bytes(spec, record)
    rows = schedule_choice.window_rows_numel(spec, block_input_bytes(record))
    budgets = schedule_choice.beside_kept_inputs(_budgets(plan), kept, rows)
    activations = measured_activations(measured)
    rates, cached = _placed_rates(measured), _cached(plan)
    n, out = len(spec.blocks), []
    for resident in range(0, min(plan["resident_blocks"] + 1, n) + 1):
        try:
            found = planner.plan(spec, activations, budgets, rates, resident_blocks=resident,
                                 activation_blocks=0, lean_until=0, nvme_from=n, gpu_accumulation=False,
                                 rest_tiers=plan_inputs.built_tiers(spec, cached),
                                 gradient_spares=plan["gradient_spares"], compact_master=plan["compact_master"],
                                 pooled_grads=False, blockwise=True)
        except MemoryError as err:
            out.append({"resident_blocks": resident, "fits": False, "refusal": str(err)})
            continue
        terms = plan_blockwise.floor_terms(spec, rates, resident, found.window_size, cached, kept,
                                           block_input_bytes(record))[0]
        out.append({"resident_blocks": resident, "fits": True, "window_size": found.window_size,
                    "blockwise_s": terms.step_s, "gpu_needed_GiB": found.gpu.needed / GIB,
                    "host_needed_GiB": found.host.needed / GIB})
    return out


def choice(spec, record: dict) -> Optional[dict]:
    """The blockwise backward's choice under "auto" (planning/schedule_choice.weigh) made again from what the run's
    placement had after its first step: the start-up plan's budgets and savers, the first step's measured activations
    and rates, the residency built by then. None where the run did not weigh it (no `schedules` in its report)."""
    from stronghold.planning import plan_inputs, planner, schedule_choice
    placement = record["stronghold"]["placement"]
    measured, start = placement["measured"], placement.get("initial_plan")
    if "schedules" not in measured or start is None:
        return None
    budget = _budgets(start)
    rates = planner.Rates(**measured["rates"])
    activations = measured_activations(measured)
    cached = _cached(start)
    built = measured.get("first_forward", {}).get("resident_blocks", start["resident_blocks"])
    fixed = dict(window_size=None, activation_blocks=0, lean_until=0, nvme_from=len(spec.blocks), nvme_shrink=True,
                 gpu_accumulation=None, gradient_spares=start["gradient_spares"],
                 compact_master=start["compact_master"], pooled_grads=start["pooled_grads"], blockwise=False,
                 rest_tiers=plan_inputs.built_tiers(spec, cached))
    host = planner.plan(spec, activations, budget, rates, **fixed)
    if host.resident_blocks < built:  # blocks only move onto the GPU
        host = planner.plan(spec, activations, budget, rates, resident_blocks=built, **fixed)
    _, _, weighed = schedule_choice.weigh(spec, budget, rates, host, activations, block_input_bytes(record), True,
                                          fixed, None, built)
    return {"recorded": measured["schedules"], "now": dataclasses.asdict(weighed), "margin": schedule_choice.MARGIN}


def _blockwise_on(record: dict) -> bool:
    """The engine report says it; records from before it did, their configuration (the one line's) or the script."""
    report, config = record["stronghold"], (record.get("config") or {}).get("stronghold") or {}
    if "blockwise_backward" in report:  # what ran, whatever the configuration asked
        return bool(report["blockwise_backward"])
    return bool(config.get("blockwise_backward") or "blockwise_backward" in str(record.get("script", "")))


def replay(record: dict) -> dict:
    """The planner's choice from one measured run, beside the residency it built and one block more."""
    spec = spec_of(record)
    built = record["stronghold"]["placement"]["plan"]
    variants = [_variant(spec, record, r) for r in (None, built["resident_blocks"], built["resident_blocks"] + 1)]
    return {"kind": "replanned", "script": "examples/bench/replay_plan.py", "date": now_iso(),
            "commit": current_provenance().commit, "device": "none: planner arithmetic on the CPU",
            "source": {"same_call": record.get("same_call"), "label": record.get("label"),
                       "commit": record.get("commit"), "step_s": record.get("step_s")},
            "built": {"resident_blocks": built["resident_blocks"], "window_size": built["window_size"],
                      "predicted_step_s": built["predicted_step_s"]},
            "variants": variants, "floors": gpu_sums(spec, record), "schedules": schedules(spec, record),
            "choice": choice(spec, record), "blockwise_residencies": blockwise_residencies(spec, record)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m examples.bench.replay_plan", description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=Path, required=True,
                        help="JSON lines of examples.bench.data_parallel or examples.bench.run_one")
    parser.add_argument("--same-call", required=True, help="the records' `same_call`")
    parser.add_argument("--label", default=None, help="only the records of this configuration (e.g. stronghold:1)")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines appended here (default: print only)")
    args = parser.parse_args(argv)
    records = [r for r in map(json.loads, args.records.read_text().splitlines())
               if (r.get("kind") == "config" or r.get("event") == "result") and r.get("same_call") == args.same_call
               and (args.label is None or r.get("label") == args.label) and r.get("stronghold")]
    if not records:
        parser.error(f"no config record with an engine report and same_call {args.same_call!r} in {args.records}")
    for record in records:
        result = replay(record)
        if args.out is not None:
            with args.out.open("a") as out:
                out.write(json.dumps(result) + "\n")
        for v in result["variants"]:
            what = (f"R{v['resident_blocks']} W{v['window_size']}: {v['predicted_step_s']:.3f} s predicted, "
                    f"{v['gpu_needed_GiB']:.2f} GiB" if v["fits"] else "does not fit")
            built = result["built"]
            print(f"[replay_plan] {record.get('commit')} {record.get('label')} (built R{built['resident_blocks']}"
                  f" W{built['window_size']}, measured {record.get('step_s')} s) resident "
                  f"{v['resident_blocks_asked'] if v['resident_blocks_asked'] is not None else 'auto'}: {what}",
                  flush=True)
        floors = result["floors"]
        print(f"[replay_plan] {record.get('commit')} {record.get('label')} step floor with the gradients summed on "
              f"the host {floors['host_sums']['step_floor_s']:.3f} s, on the GPU "
              f"{floors['gpu_sums']['step_floor_s']:.3f} s ({floors['gpu_sums_early']['step_floor_s']:.3f} s with no "
              f"update deferred by clipping)", flush=True)
        ways = result["schedules"]
        print(f"[replay_plan] {record.get('commit')} {record.get('tag') or record.get('label')} measured "
              f"{ways['measured_step_s']} s ({'blockwise' if ways['measured_blockwise'] else 'host accumulation'}): "
              f"floor {ways['host_accumulation_s']:.3f} s with host accumulation, {ways['blockwise_s']:.3f} s "
              "blockwise", flush=True)
        for v in result["blockwise_residencies"]:
            print(f"[replay_plan] {record.get('commit')} {record.get('tag') or record.get('label')} blockwise at "
                  f"R{v['resident_blocks']}: " + (f"W{v['window_size']}, floor {v['blockwise_s']:.3f} s, GPU "
                                                 f"{v['gpu_needed_GiB']:.2f} GiB, host {v['host_needed_GiB']:.2f} GiB"
                                                 if v["fits"] else "does not fit"), flush=True)
        if result["choice"] is not None:
            then, now = result["choice"]["recorded"], result["choice"]["now"]
            print(f"[replay_plan] {record.get('commit')} {record.get('tag') or record.get('label')} choice after the "
                  f"first step: host accumulation {now['host_accumulation_s']:.3f} s against blockwise "
                  f"{now['blockwise_s'] or float('nan'):.3f} s, {'blockwise' if now['blockwise'] else 'stays'} "
                  f"(the run: {then['blockwise_s'] or float('nan'):.3f} s, "
                  f"{'blockwise' if then['blockwise'] else 'stayed'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
