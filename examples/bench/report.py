"""`python -m examples.bench report`: every table, PNG and claim, regenerated from results/bench/*.jsonl.

For each figure it writes <figure>.md (tables captioned with device, commits and dates, the seed's
claim for that figure judged from our numbers) and <figure>.png; report.md gathers them all, and
headline.md holds the table for the README (stronghold against the best peer). The newest record
per point is used, whatever its commit; captions list the commits behind each table. Claims are
judged under the seed's 32 GiB cap.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from . import claims, plots
from .claims import Claim, Largest
from .figures import ENGINE_LARGE_LAYERS, SEED_LAYERS, base_point
from .markdown import cap_label, fmt, outcome, table
from .point import OFFLOAD_BASELINES, PLAIN_BASELINE, SEED_CAP_GB, SYSTEMS, Point, knobs_from_args
from .queries import at, knob_groups, latest, ok, search_answer, series, with_any_knobs
from .store import read_records

PEERS = (PLAIN_BASELINE, *OFFLOAD_BASELINES)
# stronghold-ae.md, V100 32 GB: (params B, layers) of Fig. 6a and samples/s of Fig. 7a/8a by layers.
SEED_LARGEST = {"no_offload": (1.717, 32), "zero_offload": (2.522, 48), "zero_infinity": (2.522, 48),
                "stronghold": (5.141, 100)}
SEED_SAMPLES_PER_S = {32: {"no_offload": 0.7496, "zero_offload": 0.3711, "zero_infinity": 0.3587, "stronghold": 0.6647},
                      48: {"zero_offload": 0.2523, "zero_infinity": 0.2439, "stronghold": 0.3999}}


@dataclass
class Section:
    name: str
    title: str
    parts: list[str] = field(default_factory=list)
    used: list[dict[str, Any]] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)

    def add_table(self, heading: str, header: list[str], rows: list[list[Any]], used: list[dict[str, Any]]) -> None:
        self.used += used
        self.parts += [f"### {heading}", caption(used), table(header, rows)]

    def markdown(self) -> str:
        body = [f"## {self.title}", *self.parts]
        if self.claims:
            body += ["Seed claims:", "\n".join(c.markdown() for c in self.claims)]
        return "\n\n".join(body) + "\n"


def caption(records: list[dict[str, Any]]) -> str:
    if not records:
        return "_No measurements yet._"
    devices = sorted({str(r.get("device")) for r in records})
    commits = sorted({str(r.get("commit", "?"))[:12] + ("+dirty" if r.get("dirty") else "") for r in records})
    dates = sorted(str(r.get("date", "?"))[:10] for r in records)
    span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} .. {dates[-1]}"
    return f"_Device: {'; '.join(devices)}. Commit: {', '.join(commits)}. Date: {span}. {len(records)} runs._"


def _size(record: dict[str, Any]) -> str:
    return f"{record['params_B']:.3f} B ({record['layers']} layers)"


def _png_name(figure: str, cap: float | None) -> str:
    suffix = "" if cap == SEED_CAP_GB else ("-uncapped" if cap is None else f"-cap{cap:g}")
    return f"{figure}{suffix}.png"


def _overlap(record: dict[str, Any]) -> str:
    """The engine's overlap breakdown, seconds per step, as `name=value` (whatever keys it reports)."""
    overlap = (record.get("stronghold") or {}).get("overlap") or {}
    items = [f"{k.removesuffix('_s_per_step')}={v:.3f}" for k, v in overlap.items()
             if k.endswith("_s_per_step") and isinstance(v, (int, float))]
    return ", ".join(items) or "-"


def _knobs_label(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(knobs.items())) or "engine defaults"


def _sps(record: dict[str, Any] | None) -> float | None:
    """samples/s of a run; 0.0 if it failed, None if it was not run."""
    if record is None:
        return None
    return record.get("samples_per_s") if ok(record) else 0.0


def most_used_knobs(records: Iterable[dict[str, Any]], figures: tuple[str, ...] = (),
                    cap: float | None | str = "any") -> dict[str, Any]:
    """The stronghold knobs most runs of `figures` under `cap` used (all figures if none are named,
    every cap by default; Fig. 9's one-knob variations are one run each), so the report finds each
    figure's comparison without being told the sweeps' knob flags, even when figures or caps ran with
    different knobs (more blocks stay resident on an uncapped GPU)."""
    counts = Counter(json.dumps(r.get("stronghold_knobs") or {}, sort_keys=True)
                     for r in records if r.get("system") == "stronghold"
                     and (not figures or r.get("figure") in figures) and (cap == "any" or r.get("gpu_cap_GB") == cap))
    return json.loads(counts.most_common(1)[0][0]) if counts else {}


# Which sweeps' knobs each section compares at: Fig. 7a measures stronghold at the sizes Fig. 6a
# found, with the same knobs; Fig. 8b and Fig. 9 are their own sweeps.
KNOB_SOURCES = {"fig6a": ("fig6a", "fig7a"), "fig8b": ("fig8b",), "fig9": ("fig9",)}


class Report:
    def __init__(self, records: list[dict[str, Any]], args: argparse.Namespace, out_dir: Path) -> None:
        self.records = latest(records)
        self.args = args
        self.out_dir = out_dir
        self.flags = knobs_from_args(args)
        self._knobs: dict[tuple[str, float | None], dict[str, Any]] = {}
        self._largest: dict[tuple[str, float | None], tuple[dict | None, dict | None]] = {}
        # The seed's samples/s are comparable only at the seed's shape.
        seed = Point(system="no_offload", layers=1)
        self.seed_shape = self.point("no_offload", SEED_CAP_GB).key() == seed.key()
        caps = {r.get("gpu_cap_GB") for r in self.records.values()}
        self.caps = sorted((c for c in caps if c is not None), key=lambda c: (c != SEED_CAP_GB, c))
        self.caps += [None] if None in caps else []

    def knobs(self, section: str, cap: float | None) -> dict[str, Any]:
        """The knobs given as flags, else those most used by `section`'s sweeps under `cap`, else by
        them under any cap, else by any sweep (memoised: the records do not change)."""
        if (section, cap) not in self._knobs:
            records, figures = self.records.values(), KNOB_SOURCES[section]
            self._knobs[section, cap] = (self.flags or most_used_knobs(records, figures, cap)
                                         or most_used_knobs(records, figures) or most_used_knobs(records))
        return self._knobs[section, cap]

    def point(self, system: str, cap: float | None, layers: int = 1, section: str = "fig6a") -> Point:
        """The point `section` compares at; stronghold's knobs are that section's sweep's."""
        point = base_point(self.args, system, cap, layers)
        return point.with_(stronghold=self.knobs(section, cap)) if system == "stronghold" else point

    def largest(self, system: str, cap: float | None) -> tuple[dict | None, dict | None]:
        """Fig. 6a's (largest fit, first failure above it) for `system` under `cap` (memoised)."""
        if (system, cap) not in self._largest:
            self._largest[system, cap] = search_answer(self.records, self.point(system, cap))
        return self._largest[system, cap]

    def _plot(self, section: Section, cap: float | None, used: list[dict[str, Any]], draw) -> None:
        """draw(path, caption) writes one PNG; link it from the section if it did."""
        name = _png_name(section.name, cap)
        if draw(self.out_dir / name, caption(used).strip("_")):
            section.parts.append(f"![{section.name} {cap_label(cap)}]({name})")

    # Fig. 6a -----------------------------------------------------------------------------------
    def fig6a(self) -> Section:
        section = Section("fig6a", "Fig. 6a: largest trainable model")
        groups: dict[str, dict[str, float]] = {}
        for cap in self.caps:
            rows, used, bars = [], [], {}
            for system in SYSTEMS:
                fit, failure = self.largest(system, cap)
                used += [r for r in (fit, failure) if r]
                bound = f"{outcome(failure)} at {failure['layers']}" if failure else "not found yet (search unfinished)"
                seed = SEED_LARGEST[system]
                rows.append([system, _size(fit) if fit else "none trained", bound, fmt(_sps(fit), 3),
                             fmt(fit and fit.get("peak_gpu_GB"), 1), fmt(fit and fit.get("peak_host_GB"), 1),
                             f"{seed[0]} B ({seed[1]})"])
                if fit:
                    bars[system] = fit["params_B"]
            section.add_table(cap_label(cap), ["system", "largest trainable", "next probe failed", "samples/s",
                                               "peak GPU GiB", "peak host GiB", "seed (V100 32 GB)"], rows, used)
            groups[cap_label(cap)] = bars
        self._plot(section, SEED_CAP_GB, section.used, lambda path, cap_text: plots.grouped_bars(
            {k: v for k, v in groups.items() if v}, "largest trainable params (B)", "Fig. 6a: largest trainable model",
            path, cap_text))
        section.claims.append(self.larger_model_claim())
        return section

    def larger_model_claim(self) -> Claim:
        def largest(system: str) -> Largest:
            fit, failure = self.largest(system, SEED_CAP_GB)
            return Largest(params_B=fit["params_B"] if fit else None, complete=failure is not None)

        return claims.larger_model(largest("stronghold"), {s: largest(s) for s in OFFLOAD_BASELINES})

    # Fig. 7a / 8a ------------------------------------------------------------------------------
    def baseline_sizes(self, cap: float | None) -> dict[str, int]:
        """Layer counts of the peers whose Fig. 6a search has finished."""
        sizes = {}
        for system in PEERS:
            fit, failure = self.largest(system, cap)
            if fit and failure:
                sizes[system] = fit["layers"]
        return sizes

    def fig7a(self) -> Section:
        section = Section("fig7a", "Fig. 7a / 8a: throughput at each baseline's largest size")
        for cap in self.caps:
            rows, used, groups = [], [], {}
            for layers in sorted(set(self.baseline_sizes(cap).values())):
                stronghold_sps = _sps(at(self.records, self.point("stronghold", cap, layers)))
                bars = {}
                for system in SYSTEMS:
                    record = at(self.records, self.point(system, cap, layers))
                    if record is None:
                        continue
                    used.append(record)
                    speedup = stronghold_sps / record["samples_per_s"] if ok(record) and stronghold_sps is not None else None
                    seed = SEED_SAMPLES_PER_S.get(layers, {}).get(system) if self.seed_shape else None
                    rows.append([_size(record), system, outcome(record), fmt(record.get("samples_per_s"), 3),
                                 fmt(record.get("step_s"), 3), fmt(record.get("tflops"), 1), fmt(record.get("mfu"), 3),
                                 fmt(record.get("peak_gpu_GB"), 1), fmt(record.get("peak_host_GB"), 1),
                                 fmt(speedup, 2), fmt(seed, 4)])
                    if ok(record):
                        bars[system] = record["samples_per_s"]
                if bars:
                    groups[f"{layers} layers"] = bars
            section.add_table(cap_label(cap), ["size", "system", "outcome", "samples/s", "s/iter", "TFLOP/s", "MFU",
                                               "peak GPU GiB", "peak host GiB", "stronghold / system",
                                               "seed samples/s (V100)"], rows, used)
            self._plot(section, cap, used, lambda path, cap_text, groups=groups, cap=cap: plots.grouped_bars(
                groups, "samples / s", f"Fig. 7a/8a: throughput, {cap_label(cap)}", path, cap_text))
        section.claims += self.throughput_claims()
        return section

    def throughput_claims(self) -> list[Claim]:
        sizes = self.baseline_sizes(SEED_CAP_GB)
        unfinished = [s for s in PEERS if self.largest(s, SEED_CAP_GB)[1] is None]
        if unfinished:
            why = f"Fig. 6a's search has not finished for {', '.join(unfinished)}, so their largest sizes are unknown."
            return [claims.throughput([], why), claims.near_plain("no_offload's largest size", None, None)]
        pairs = []
        for layers in sorted(set(sizes.values())):
            stronghold = _sps(at(self.records, self.point("stronghold", SEED_CAP_GB, layers)))
            for system in OFFLOAD_BASELINES:
                baseline = at(self.records, self.point(system, SEED_CAP_GB, layers))
                if ok(baseline):
                    pairs.append((f"{layers} layers", system, baseline["samples_per_s"], stronghold))
        plain = sizes.get(PLAIN_BASELINE)  # None: plain training fits no layer count at all
        if plain is None:
            return [claims.throughput(pairs), claims.near_plain("no_offload's largest size (none trains)", None, None)]
        plain_sps = _sps(at(self.records, self.point(PLAIN_BASELINE, SEED_CAP_GB, plain)))
        stronghold_sps = _sps(at(self.records, self.point("stronghold", SEED_CAP_GB, plain)))
        return [claims.throughput(pairs), claims.near_plain(f"{plain} layers", plain_sps, stronghold_sps)]

    # Fig. 8b -----------------------------------------------------------------------------------
    def fig8b(self) -> Section:
        section = Section("fig8b", "Fig. 8b: stronghold's iteration time against layers")
        for cap in self.caps:
            records = series(self.records, self.point("stronghold", cap, section="fig8b"))
            if not records:
                continue
            points = [(r["layers"], r["step_s"]) for r in records if ok(r)]
            fit = claims.linear_fit([float(x) for x, _ in points], [y for _, y in points]) if len(points) >= 2 else None
            rows = [[_size(r), outcome(r), fmt(r.get("step_s"), 3), fmt(r.get("samples_per_s"), 3),
                     fmt(r.get("floor_s"), 3), fmt(r.get("peak_gpu_GB"), 1), fmt(r.get("peak_host_GB"), 1), _overlap(r)]
                    for r in records]
            section.add_table(cap_label(cap), ["size", "outcome", "s/iter", "samples/s", "floor s", "peak GPU GiB",
                                               "peak host GiB", "overlap (s/step)"], rows, records)
            self._plot(section, cap, records, lambda path, cap_text, points=points, fit=fit, cap=cap: plots.line_fit(
                points, fit, f"Fig. 8b: stronghold, {cap_label(cap)}", path, cap_text))
            if cap == SEED_CAP_GB:
                section.claims.append(claims.linear_scaling(points))
        if not section.claims:
            section.claims.append(claims.linear_scaling([]))
        return section

    # Fig. 9 ------------------------------------------------------------------------------------
    def fig9(self) -> Section:
        layers = getattr(self.args, "fig9_layers", SEED_LAYERS)
        section = Section("fig9", f"Fig. 9: stronghold at {layers} layers against its knobs")
        for cap in self.caps:
            base = self.point("stronghold", cap, layers, section="fig9")
            panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
            used: list[dict[str, Any]] = []
            for knob in ("window_size", "resident_blocks"):
                # Sweeps of two values or more, largest first: the claim is judged on it.
                groups = sorted(((held, found) for held, found in knob_groups(self.records, base, knob).items()
                                 if len(found) >= 2), key=lambda item: -len(item[1]))
                for held, found in groups:
                    label = _knobs_label(json.loads(held))
                    rows = [[value, outcome(r), fmt(r.get("samples_per_s"), 3), fmt(r.get("step_s"), 3),
                             fmt(r.get("floor_s"), 3), fmt(r.get("peak_gpu_GB"), 1), _overlap(r)] for value, r in found]
                    records = [r for _, r in found]
                    used += records
                    section.add_table(f"{knob} ({label}), {cap_label(cap)}", [knob, "outcome", "samples/s", "s/iter",
                                      "floor s", "peak GPU GiB", "overlap (s/step)"], rows, records)
                    panels.setdefault(knob, {})[label] = [(value, r["samples_per_s"]) for value, r in found if ok(r)]
            self._plot(section, cap, used, lambda path, cap_text, panels=panels, cap=cap: plots.knob_sweeps(
                panels, f"Fig. 9: stronghold, {layers} layers, {cap_label(cap)}", path, cap_text))
            if cap == SEED_CAP_GB:
                windows = list(panels.get("window_size", {}).values())
                section.claims.append(claims.window_sweep(windows[0] if windows else []))
        if not section.claims:
            section.claims.append(claims.window_sweep([]))
        return section

    # Core-engine check -------------------------------------------------------------------------
    def engine(self) -> Section:
        section = Section("engine", "Core-engine check: stronghold vs ZeRO-Offload under the 32 GiB cap")
        baseline = at(self.records, self.point("zero_offload", SEED_CAP_GB, SEED_LAYERS))
        found = [baseline] if baseline else []
        for layers in (SEED_LAYERS, ENGINE_LARGE_LAYERS):  # stronghold: every knob setting measured there
            found += with_any_knobs(self.records, self.point("stronghold", SEED_CAP_GB, layers))
        rows = []
        for r in found:
            floor = r.get("floor") or {}
            rows.append([r["system"], _size(r), _knobs_label(r.get("stronghold_knobs") or {}), outcome(r),
                         fmt(r.get("samples_per_s"), 3), fmt(r.get("tokens_per_s"), 0), fmt(r.get("step_s"), 3),
                         fmt(r.get("mfu"), 3), fmt(r.get("peak_gpu_GB"), 1), fmt(r.get("peak_host_GB"), 1),
                         fmt(r.get("floor_s"), 3),
                         " / ".join(fmt(floor.get(k), 3) for k in ("gpu_compute_s", "h2d_s", "d2h_s", "cpu_optim_s"))])
        section.add_table(cap_label(SEED_CAP_GB), ["system", "size", "knobs", "outcome", "samples/s", "tokens/s",
                                                   "s/iter", "MFU", "peak GPU GiB", "peak host GiB", "floor s",
                                                   "GPU / H2D / D2H / CPU optim s"], rows, found)
        return section

    # README headline ---------------------------------------------------------------------------
    def headline(self) -> str:
        answers = {s: self.largest(s, SEED_CAP_GB) for s in (*PEERS, "stronghold")}
        sizes = {s: fit for s, (fit, _) in answers.items()}
        peers = [s for s in PEERS if sizes[s]]
        if not peers or not sizes["stronghold"]:
            return "_Headline: not yet measured (run fig6a and fig7a under the 32 GiB cap)._\n"
        unfinished = [s for s, (fit, failure) in answers.items() if fit and not failure]
        best = max(peers, key=lambda s: (sizes[s]["params_B"], sizes[s].get("samples_per_s") or 0))
        mine, peer = sizes["stronghold"], sizes[best]
        at_peer = at(self.records, self.point("stronghold", SEED_CAP_GB, peer["layers"]))
        used = [mine, peer] + ([at_peer] if at_peer else [])
        ratio = _sps(at_peer) / peer["samples_per_s"] if _sps(at_peer) is not None else None
        rows = [["largest trainable model", _size(mine), _size(peer), fmt(mine["params_B"] / peer["params_B"], 2) + "x"],
                [f"samples/s at {_size(peer)}", fmt(_sps(at_peer), 3), fmt(peer["samples_per_s"], 3),
                 fmt(ratio, 2) + ("x" if ratio is not None else "")]]
        note = f" Fig. 6a's search has not finished for {', '.join(unfinished)}: sizes are lower bounds." if unfinished else ""
        return "\n\n".join([f"Stronghold against the best peer ({best}), {cap_label(SEED_CAP_GB)}.{note}", caption(used),
                            table(["", "stronghold", best, "stronghold / peer"], rows)]) + "\n"

    def build(self) -> list[Section]:
        return [self.fig6a(), self.fig7a(), self.fig8b(), self.fig9(), self.engine()]


def write_report(args: argparse.Namespace) -> Path:
    out_dir = Path(args.out_dir or args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(read_records(args.results_dir), args, out_dir)
    sections = report.build()
    headline = report.headline()
    for section in sections:
        (out_dir / f"{section.name}.md").write_text(section.markdown())
    (out_dir / "headline.md").write_text(headline)
    everything = [c for s in sections for c in s.claims]
    index = ["# Benchmarks: stronghold against DeepSpeed's offload modes (the seed's evaluation)",
             "Regenerate with `python -m examples.bench report`.", "## Headline", headline,
             "## Seed claims", "\n".join(c.markdown() for c in everything), *[s.markdown() for s in sections]]
    path = out_dir / "report.md"
    path.write_text("\n\n".join(index))
    print(f"[bench] report: {path} ({len(report.records)} points)")
    for claim in everything:
        print(f"[bench] {claim.status}: {claim.claim}")
    return path
