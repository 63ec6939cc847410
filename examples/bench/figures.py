"""The seed paper's evaluation, one sweep per figure (stronghold-ae.md), plus the core-engine check.

Each sweep asks its Sweep for points; points already in the store for this commit come back at
once, so a sweep cut by its budget resumes when the same command is run again.
- fig6a: largest trainable layer count per system, by search, under each cap.
- fig7a (also Fig. 8a): throughput at each baseline's largest size, every system that fits it and
  stronghold beside it.
- fig8b: stronghold's iteration time against layers.
- fig9: stronghold at 1.72 B against window size, and against resident blocks.
- engine: stronghold and ZeRO-Offload at 1.72 B, stronghold at 5.14 B, under 32 GiB.
- seqlen (issue 13): the longest trainable sequence of stronghold with and without activation
  offload and of ZeRO-Infinity with DeepSpeed's cpu_checkpointing, by search; then stronghold on and
  off timed at the longest sequence both train.
- kernels (issue 10): stronghold's step time with all kernels, none and each alone, per family.
"""
from __future__ import annotations

import argparse
from typing import Callable

from .kernels import kernels_points
from .point import OFFLOAD_BASELINES, PLAIN_BASELINE, SYSTEMS, Point, knobs_from_args, point_from_args
from .queries import latest, search_answer
from .search import IntSearch, SearchPlan, SearchResult, largest_trainable
from .sweep import SearchAborted, Sweep

# First probe of the Fig. 6a search, per system, near the peers' limits on an H200 (126 GiB host) under the 32 GiB
# cap: no_offload OOMs at 32 layers, ZeRO-Offload trains 100, ZeRO-Infinity 78 (120: host OOM).
# Starting near the answer saves GPU minutes; the search is correct from any start.
SEARCH_START_LAYERS = {"no_offload": 24, "zero_offload": 100, "zero_infinity": 80, "stronghold": 100}
SEED_LAYERS = 32  # 1.72 B: the seed's Megatron-LM limit, where Fig. 9 and the engine check run
ENGINE_LARGE_LAYERS = 100  # 5.14 B: the seed's STRONGHOLD limit


def base_point(args: argparse.Namespace, system: str, cap: float | None, layers: int = 1) -> Point:
    return point_from_args(args, system=system, layers=layers, gpu_cap_GB=cap)


def fig6a(sweep: Sweep, args: argparse.Namespace) -> None:
    for cap in args.caps:
        for system in args.systems:
            plan = SearchPlan(
                start_layers=args.start.get(system, SEARCH_START_LAYERS[system]), step_layers=args.step_layers,
                growth=args.growth, max_layers=args.max_layers,
            )
            base = base_point(args, system, cap)
            try:
                result = largest_trainable(lambda layers: sweep.fits(base.with_(layers=layers)), plan)
            except SearchAborted as e:
                print(f"[bench] fig6a {system} cap {cap}: search aborted: {e}", flush=True)
                continue
            print(f"[bench] fig6a {system} cap {cap}: largest trainable {result.largest_fit} layers "
                  f"(first failure: {result.smallest_failure}; probes {list(result.probes)})", flush=True)


def baseline_sizes(sweep: Sweep, args: argparse.Namespace, cap: float | None) -> dict[str, int]:
    """Each baseline's largest trainable layer count from a finished Fig. 6a search (this commit's
    records if they have one, else any commit's: a baseline's limit does not depend on our code)."""
    sizes = {}
    # This commit's records first; any commit's only where this commit has no finished search.
    by_commit = (latest(sweep.store.records, sweep.store.provenance.commit), latest(sweep.store.records))
    for system in (PLAIN_BASELINE, *OFFLOAD_BASELINES):
        base = base_point(args, system, cap)
        for records in by_commit:
            fit, failure = search_answer(records, base)
            if failure is not None:  # finished; fit None: it trains no size at all, nothing to compare
                if fit is not None:
                    sizes[system] = fit["layers"]
                break
        else:
            raise ValueError(
                f"no finished Fig. 6a search for {system} under cap {cap}: run `python -m examples.bench fig6a` "
                "(same shape and cap) until it says complete, or give the sizes with --layers"
            )
    return sizes


def fig7a(sweep: Sweep, args: argparse.Namespace) -> None:
    for cap in args.caps:
        if args.layers:
            plan = {layers: [s for s in SYSTEMS if s != "stronghold"] for layers in args.layers}
        else:
            sizes = baseline_sizes(sweep, args, cap)
            print(f"[bench] fig7a cap {cap}: baseline largest sizes {sizes}", flush=True)
            # At each baseline's limit, every baseline that can train that size, as in the seed.
            plan = {size: [s for s, limit in sizes.items() if limit >= size] for size in sizes.values()}
        for layers in sorted(plan):
            for system in (*plan[layers], "stronghold"):
                sweep.point(base_point(args, system, cap, layers))


def fig8b(sweep: Sweep, args: argparse.Namespace) -> None:
    for cap in args.caps:
        for layers in args.layers or (16, 32, 48, 64, 80, 96):
            sweep.point(base_point(args, "stronghold", cap, layers))


def fig9(sweep: Sweep, args: argparse.Namespace) -> None:
    layers = (args.layers or [SEED_LAYERS])[0]
    for cap in args.caps:
        base = base_point(args, "stronghold", cap, layers)
        for window in args.windows:
            sweep.point(base.with_(stronghold={**base.stronghold, "window_size": window}))
        for resident in args.residents:
            sweep.point(base.with_(stronghold={**base.stronghold, "resident_blocks": resident}))


def engine(sweep: Sweep, args: argparse.Namespace) -> None:
    for cap in args.caps:
        sweep.point(base_point(args, "stronghold", cap, SEED_LAYERS))
        sweep.point(base_point(args, "zero_offload", cap, SEED_LAYERS))
        sweep.point(base_point(args, "stronghold", cap, ENGINE_LARGE_LAYERS))


# The seqlen search only asks "does it train": one warm-up step (allocations settle) and one timed.
SEARCH_WARMUP_STEPS = 1
SEARCH_TIMED_STEPS = 1


def seqlen_variants(args: argparse.Namespace, cap: float | None) -> dict[str, Point]:
    """The three systems of issue 13's acceptance, at the shape flags (seq set by the search)."""
    layers = (args.layers or [SEED_LAYERS])[0]
    steps = dict(warmup_steps=SEARCH_WARMUP_STEPS, timed_steps=SEARCH_TIMED_STEPS)
    # Both stronghold variants with the same kernels, all of them unless given: "auto" would apply them with
    # offload on only (long_context.py), and the comparison is of the offload alone. All is also what the stored
    # seqlen records ran with (the default then).
    knobs = {"kernels": True, **knobs_from_args(args)}
    stronghold = base_point(args, "stronghold", cap, layers).with_(**steps)
    variants = {
        "stronghold offload on": stronghold.with_(stronghold={**knobs, "offload_activations": True}),
        "stronghold offload off": stronghold.with_(stronghold={**knobs, "offload_activations": False}),
    }
    if args.arch == "llama":  # DeepSpeed's partitioned checkpoint fails on GPT-2 (systems.CPU_CHECKPOINTING)
        variants["zero_infinity cpu_checkpointing"] = base_point(args, "zero_infinity", cap, layers).with_(
            cpu_checkpointing=True, **steps)
    return variants


def _failure_text(sweep: Sweep, point: Point, seq: int | None) -> str:
    """What stopped `point` at `seq`: its error kind and peak memories, from the store."""
    if seq is None:
        return "none up to --max-seq"
    record = sweep.store.lookup(point.with_(seq=seq), sweep.config.point_timeout_s) or {}
    return (f"seq {seq}: {record.get('error')} (peak GPU {record.get('peak_gpu_GB')}, peak host "
            f"{record.get('peak_host_GB')} GiB; {str(record.get('error_detail') or '')[-160:]})")


def seqlen(sweep: Sweep, args: argparse.Namespace) -> None:
    """Longest trainable seq per variant (stronghold's two first: the acceptance, and the timed pair
    needs only them; ZeRO-Infinity's path is the least tried), then the timed pair."""
    plan = IntSearch(field="seq", start=args.start_seq, step=args.step_seq, growth=args.seq_growth,
                     maximum=args.max_seq)
    for cap in args.caps:
        variants = seqlen_variants(args, cap)
        results: dict[str, SearchResult] = {}

        def search(name: str) -> None:
            point = variants.get(name)
            if point is None:
                print(f"[bench] seqlen {name}: not run for arch {args.arch} (Llama only)", flush=True)
                return
            try:
                result = largest_trainable(lambda seq: sweep.fits(point.with_(seq=seq)), plan)
            except SearchAborted as e:
                print(f"[bench] seqlen {name} cap {cap}: search aborted: {e}", flush=True)
                return
            results[name] = result
            print(f"[bench] seqlen {name} cap {cap}: longest trainable seq {result.largest_fit} (limit: "
                  f"{_failure_text(sweep, point, result.smallest_failure)}; probes {list(result.probes)})", flush=True)

        search("stronghold offload on")
        search("stronghold offload off")
        on, off = results.get("stronghold offload on"), results.get("stronghold offload off")
        if on and off and min(on.largest_fit, off.largest_fit) > 0:
            both = min(on.largest_fit, off.largest_fit)
            timed = {name: sweep.point(variants[name].with_(seq=both, warmup_steps=args.warmup_steps,
                                                            timed_steps=args.timed_steps))
                     for name in ("stronghold offload on", "stronghold offload off")}
            on_s, off_s = (timed[n].get("step_s") for n in ("stronghold offload on", "stronghold offload off"))
            cost = f"{on_s / off_s - 1:+.1%}" if on_s and off_s else "n/a (a point failed)"
            print(f"[bench] seqlen cap {cap}: at seq {both}, step s offload on {on_s}, off {off_s}: "
                  f"offload costs {cost} (issue 13: <= +10%)", flush=True)
        search("zero_infinity cpu_checkpointing")
        if on:
            for name in ("stronghold offload off", "zero_infinity cpu_checkpointing"):
                other = results.get(name)
                ratio = f"{on.largest_fit / other.largest_fit:.2f}x" if other and other.largest_fit else "n/a"
                print(f"[bench] seqlen cap {cap}: offload on / {name}: {ratio} (issue 13: >= 2x)", flush=True)


def kernels(sweep: Sweep, args: argparse.Namespace) -> None:
    for cap in args.caps:
        for arch in args.archs:
            for point in kernels_points(args, arch, cap):
                sweep.point(point)


FIGURES: dict[str, Callable[[Sweep, argparse.Namespace], None]] = {
    "fig6a": fig6a, "fig7a": fig7a, "fig8b": fig8b, "fig9": fig9, "engine": engine, "seqlen": seqlen,
    "kernels": kernels,
}
