"""The seed paper's claims, judged from our numbers: confirmed, not confirmed, or not yet measured.

Each function takes plain numbers pulled from the records (report.py does the pulling), so the
verdicts are unit-tested without any files. Thresholds are the low ends of the seed's own ranges.
"""
from __future__ import annotations

from dataclasses import dataclass

CONFIRMED, NOT_CONFIRMED, NOT_MEASURED = "confirmed", "not confirmed", "not yet measured"

# "1.9x-6.5x larger trainable model than the offloading baselines" (stronghold-ae.md).
LARGER_MODEL_MIN = 1.9
# "1.2x-3.7x their throughput".
THROUGHPUT_MIN = 1.2
# "Close to Megatron-LM's throughput at Megatron's largest size": the seed had 0.6647 / 0.7496 =
# 0.89 of it; we call >= 0.85 close.
NEAR_PLAIN_MIN = 0.85
# Fig. 8b "iteration time grows linearly with layers": a straight line explains >= 98% of the variance.
LINEAR_R2_MIN = 0.98
LINEAR_MIN_POINTS = 3
# Fig. 9 "throughput rises with window size, then flattens": the largest window beats the smallest
# by >= 5%, and the two largest windows are within 5% of each other.
WINDOW_RISE_MIN = 1.05
WINDOW_FLAT_MAX = 0.05


@dataclass(frozen=True)
class Claim:
    claim: str
    """The seed's claim, in its words."""
    status: str
    """CONFIRMED, NOT_CONFIRMED or NOT_MEASURED."""
    evidence: str
    """Our numbers behind the verdict."""

    def markdown(self) -> str:
        return f"- **{self.claim}**: {self.status}. {self.evidence}"


@dataclass(frozen=True)
class Largest:
    """One system's Fig. 6a answer."""

    params_B: float | None
    """Largest trainable size; None if nothing trained or not searched."""
    complete: bool
    """A failure one search step above was recorded, so params_B is the answer, not a lower bound."""


def larger_model(stronghold: Largest, baselines: dict[str, Largest]) -> Claim:
    text = f"{LARGER_MODEL_MIN}x-6.5x larger trainable model than the offloading baselines"
    if stronghold.params_B is None or not baselines or any(b.params_B is None for b in baselines.values()):
        return Claim(text, NOT_MEASURED, "Fig. 6a lacks stronghold or an offloading baseline.")
    ratios = {name: stronghold.params_B / b.params_B for name, b in baselines.items()}
    evidence = "; ".join(f"stronghold {stronghold.params_B:.2f} B / {name} {baselines[name].params_B:.2f} B = {r:.2f}x"
                         for name, r in ratios.items())
    low = min(ratios.values())
    if low >= LARGER_MODEL_MIN and all(b.complete for b in baselines.values()):
        status = CONFIRMED
    elif low < LARGER_MODEL_MIN and stronghold.complete:
        status = NOT_CONFIRMED
    else:
        status, evidence = NOT_MEASURED, evidence + " (a search has not finished: these are bounds)"
    return Claim(text, status, evidence + f"; the claim needs >= {LARGER_MODEL_MIN}x against each.")


def throughput(pairs: list[tuple[str, str, float | None, float | None]], missing: str = "") -> Claim:
    """pairs: (size label, baseline, baseline samples/s, stronghold samples/s) at a baseline's
    largest size; samples/s is 0.0 for a run that failed, None for one not run. `missing` says
    why there are no pairs yet."""
    text = f"{THROUGHPUT_MIN}x-3.7x the offloading baselines' throughput"
    measured = [(size, name, s / b) for size, name, b, s in pairs if b and s is not None]
    if not measured:
        return Claim(text, NOT_MEASURED, missing or "Fig. 7a/8a has no offloading baseline measured beside stronghold.")
    evidence = "; ".join(f"{size}: {r:.2f}x {name}" for size, name, r in measured)
    low = min(r for *_, r in measured)
    if low < THROUGHPUT_MIN:
        status = NOT_CONFIRMED
    elif len(measured) == len(pairs):
        status = CONFIRMED
    else:
        status, evidence = NOT_MEASURED, evidence + f" ({len(pairs) - len(measured)} comparisons not run yet)"
    return Claim(text, status, evidence + f"; the claim needs >= {THROUGHPUT_MIN}x at each (0.00x: stronghold failed).")


def near_plain(size: str, plain_sps: float | None, stronghold_sps: float | None) -> Claim:
    text = "close to Megatron-LM's throughput at Megatron-LM's largest size (no_offload stands in)"
    if plain_sps is None or stronghold_sps is None:
        return Claim(text, NOT_MEASURED, f"no_offload or stronghold is missing at {size}.")
    ratio = stronghold_sps / plain_sps
    status = CONFIRMED if ratio >= NEAR_PLAIN_MIN else NOT_CONFIRMED
    return Claim(text, status, f"{size}: stronghold {stronghold_sps:.3f} vs no_offload {plain_sps:.3f} samples/s "
                               f"= {ratio:.2f} (seed: 0.89; we call >= {NEAR_PLAIN_MIN} close).")


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = intercept + slope * x: (slope, intercept, R^2)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a line needs >= 2 points of (x, y), got {len(xs)} x and {len(ys)} y")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x are equal: a line through them has no slope; measure more layer counts")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return slope, intercept, r2


def linear_scaling(points: list[tuple[int, float]]) -> Claim:
    """points: (layers, seconds per iteration) of stronghold's successful runs."""
    text = "iteration time grows linearly with the layer count (Fig. 8b)"
    if len(points) < LINEAR_MIN_POINTS:
        return Claim(text, NOT_MEASURED, f"{len(points)} layer counts measured, {LINEAR_MIN_POINTS} needed.")
    slope, intercept, r2 = linear_fit([float(x) for x, _ in points], [y for _, y in points])
    status = CONFIRMED if r2 >= LINEAR_R2_MIN else NOT_CONFIRMED
    return Claim(text, status, f"{len(points)} points, {points[0][0]}-{points[-1][0]} layers: "
                               f"{slope * 1e3:.1f} ms/layer + {intercept:.3f} s, R^2 = {r2:.4f} (needs >= {LINEAR_R2_MIN}).")


def window_sweep(points: list[tuple[int, float]]) -> Claim:
    """points: (window size, samples/s) of stronghold's successful runs, by window."""
    text = "throughput rises with window size and flattens once transfers are hidden (Fig. 9)"
    if len(points) < 3:
        return Claim(text, NOT_MEASURED, f"{len(points)} window sizes measured, 3 needed.")
    points = sorted(points)
    rise = points[-1][1] / points[0][1]
    flat = abs(points[-1][1] - points[-2][1]) / points[-2][1]
    rises, flattens = rise >= WINDOW_RISE_MIN, flat <= WINDOW_FLAT_MAX
    status = CONFIRMED if rises and flattens else NOT_CONFIRMED
    return Claim(text, status, f"window {points[0][0]} -> {points[-1][0]}: {rise:.2f}x samples/s "
                               f"(rises: needs >= {WINDOW_RISE_MIN}x); last two windows differ by {flat:.1%} "
                               f"(flat: needs <= {WINDOW_FLAT_MAX:.0%}).")
