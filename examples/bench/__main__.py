"""`python -m examples.bench COMMAND`: one command per figure, one point, or the report.

    fig6a | fig7a (= fig8a) | fig8b | fig9 | engine   run (or resume) that figure's sweep
    seqlen | kernels                                 issue 13's and issue 10's sweeps
    one --system S --layers N                        one point through the harness
    report                                           tables, PNGs and claims from the JSON
    kernels-report                                   results/kernels/e2e_ab.md from the kernels sweep
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from .figures import FIGURES, SEED_LAYERS
from .harness import RunnerConfig
from .kernels import KERNEL_SHAPES
from .point import SEED_CAP_GB, SYSTEMS, add_point_args, add_shape_args, parse_cap, point_from_args
from .run_one import add_peak_args
from .store import DEFAULT_RESULTS_DIR, REPO_ROOT, ResultStore, current_provenance
from .sweep import BudgetExhausted, Sweep, SweepConfig, make_runner

ALIASES = {"fig8a": "fig7a", "fig7": "fig7a", "fig8": "fig7a"}


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 16,32,48") from None


def _cap_list(text: str) -> list[float | None]:
    try:
        return [parse_cap(x) for x in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _choices(kind: str, allowed) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names from `allowed` (`kind` names them in the error)."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {kind} {unknown}: pick from {', '.join(allowed)}")
        return names
    return parse


_system_list = _choices("systems", SYSTEMS)
_arch_list = _choices("archs", KERNEL_SHAPES)


def _starts(text: str) -> dict[str, int]:
    """`100` (every system) or `zero_offload=100,no_offload=24`."""
    if "=" not in text:
        return {s: int(text) for s in SYSTEMS}
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in SYSTEMS or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"--start item {item!r}: write SYSTEM=LAYERS with SYSTEM in {SYSTEMS}")
        out[name.strip()] = int(value)
    return out


def _results_dir_arg(parser: argparse.ArgumentParser) -> None:
    env_dir = os.environ.get("BENCH_RESULTS_DIR")
    parser.add_argument("--results-dir", type=Path, default=Path(env_dir) if env_dir else DEFAULT_RESULTS_DIR,
                        help="JSONL results (default results/bench, or $BENCH_RESULTS_DIR)")


def _runner_args(parser: argparse.ArgumentParser) -> None:
    _results_dir_arg(parser)
    parser.add_argument("--log-dir", type=Path, default=REPO_ROOT / "runs" / "bench" / "logs",
                        help="each point's stdout/stderr")
    defaults = SweepConfig(figure="defaults")
    parser.add_argument("--budget-s", type=float, default=defaults.budget_s,
                        help="seconds this command may spend on points; stops cleanly, resumable")
    parser.add_argument("--point-timeout-s", type=float, default=defaults.point_timeout_s,
                        help="wall-clock limit of one point (init included); longer is recorded as a timeout")
    parser.add_argument("--min-start-s", type=float, default=defaults.min_start_s,
                        help="start no point with less than this left of the budget")
    parser.add_argument("--any-commit", action="store_true", help="reuse points measured at any commit")
    parser.add_argument("--retry-errors", action="store_true", help="rerun points recorded as 'error'")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip stronghold's floor-term probes after each point (seconds a point)")
    parser.add_argument("--profile", action="store_true",
                        help="GPU: profile one more step after each point's timed ones (the record's 'profile')")
    add_peak_args(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.bench", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in FIGURES:
        sub = commands.add_parser(name, help=f"run or resume the {name} sweep")
        add_shape_args(sub)
        _runner_args(sub)
        sub.add_argument("--caps", type=_cap_list, default=[SEED_CAP_GB], help="GiB list, e.g. 32,none")
        sub.add_argument("--layers", type=_int_list, default=None, help="layer counts (fig7a, fig8b, fig9)")
        sub.add_argument("--systems", type=_system_list, default=list(SYSTEMS), help="fig6a: which systems")
        sub.add_argument("--start", type=_starts, default={}, help="fig6a: first probe, N or SYSTEM=N,...")
        sub.add_argument("--step-layers", type=int, default=4, help="fig6a: search resolution")
        sub.add_argument("--growth", type=float, default=1.5, help="fig6a: factor between probes")
        sub.add_argument("--max-layers", type=int, default=512, help="fig6a: stop growing here")
        sub.add_argument("--windows", type=_int_list, default=[2, 4, 8, 12, 16], help="fig9: window sizes")
        sub.add_argument("--residents", type=_int_list, default=[0, 1, 4, 8, 16], help="fig9: resident blocks")
        sub.add_argument("--start-seq", type=int, default=16384, help="seqlen: first probe")
        sub.add_argument("--step-seq", type=int, default=2048, help="seqlen: search resolution (tokens)")
        sub.add_argument("--seq-growth", type=float, default=2.0, help="seqlen: factor between probes")
        sub.add_argument("--max-seq", type=int, default=262144, help="seqlen: stop growing here")
        sub.add_argument("--archs", type=_arch_list, default=list(KERNEL_SHAPES),
                         help="kernels: families, each at its acceptance shape (--layers to make it cheaper)")
        sub.add_argument("--kernel-sets", choices=("all", "defaults"), default="all",
                         help="kernels: every set (none, all, each alone) or the engine's defaults against none and all")
    one = commands.add_parser("one", help="run one point through the harness and store it")
    add_point_args(one)
    _runner_args(one)
    one.add_argument("--figure", default="adhoc", help="results file name (results/bench/<figure>.jsonl)")
    report = commands.add_parser("report", help="markdown tables, PNG plots and claims from the JSON")
    add_shape_args(report)
    _results_dir_arg(report)
    report.add_argument("--out-dir", type=Path, default=None, help="default: the results dir")
    report.add_argument("--fig9-layers", type=int, default=SEED_LAYERS, help="layer count of the Fig. 9 sweeps")
    kernels_report = commands.add_parser("kernels-report", help="the kernels sweep's A/B table (issue 10)")
    _results_dir_arg(kernels_report)
    kernels_report.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "kernels" / "e2e_ab.md")
    return parser


def run_sweep(args: argparse.Namespace, figure: str) -> int:
    provenance = current_provenance()
    store = ResultStore(args.results_dir, provenance, any_commit=args.any_commit, retry_errors=args.retry_errors)
    runner = RunnerConfig(log_dir=args.log_dir, peak_tflops=args.peak_tflops, peak_tflops_source=args.peak_tflops_source,
                          floor=args.floor, profile=args.profile)
    config = SweepConfig(figure=figure, budget_s=args.budget_s, point_timeout_s=args.point_timeout_s,
                         min_start_s=args.min_start_s)
    sweep = Sweep(config=config, store=store, run=make_runner(runner, store))
    print(f"[bench] {figure}: commit {provenance.commit} (dirty: {provenance.dirty}); results in {args.results_dir}",
          flush=True)
    status = "complete"
    try:
        if args.command == "one":
            sweep.point(point_from_args(args))
        else:
            FIGURES[figure](sweep, args)
    except BudgetExhausted as e:
        status = f"incomplete ({e}): run the same command again to continue"
    print(sweep.summary())
    print(f"[bench] {figure}: {status}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ALIASES:
        argv[0] = ALIASES[argv[0]]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "report":
            from .report import write_report

            write_report(args)
            return 0
        if args.command == "kernels-report":
            from .kernels_report import write_kernels_report

            write_kernels_report(args.results_dir, args.out)
            return 0
        return run_sweep(args, args.figure if args.command == "one" else args.command)
    except ValueError as e:  # a user mistake: the message names it and the fix
        parser.exit(2, f"python -m examples.bench {args.command}: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
