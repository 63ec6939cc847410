"""The seed paper's evaluation, one sweep per figure (stronghold-ae.md), plus the core-engine check.

Each sweep asks its Sweep for points; points already in the store for this commit come back at
once, so a sweep cut by its budget resumes when the same command is run again.
- fig6a: largest trainable layer count per system, by search, under each cap.
- fig7a (also Fig. 8a): throughput at each baseline's largest size, every system that fits it and
  stronghold beside it.
- fig8b: stronghold's iteration time against layers.
- fig9: stronghold at 1.72 B against window size, and against resident blocks.
- engine: stronghold and ZeRO-Offload at 1.72 B, stronghold at 5.14 B, under 32 GiB.
"""
from __future__ import annotations

import argparse
from typing import Callable

from .point import OFFLOAD_BASELINES, PLAIN_BASELINE, SYSTEMS, Point, point_from_args
from .queries import latest, search_answer
from .search import SearchPlan, largest_trainable
from .sweep import SearchAborted, Sweep

# First probe of the Fig. 6a search, per system, from peers-h200.md under the 32 GiB cap:
# no_offload OOMs at 32 layers, ZeRO-Offload trains 100, ZeRO-Infinity 78 (120: host OOM).
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


FIGURES: dict[str, Callable[[Sweep, argparse.Namespace], None]] = {
    "fig6a": fig6a, "fig7a": fig7a, "fig8b": fig8b, "fig9": fig9, "engine": engine,
}
