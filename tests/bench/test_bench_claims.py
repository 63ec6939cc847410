"""Verdicts on the seed's claims from plain numbers, and the line fit behind Fig. 8b."""
import pytest

from examples.bench import claims
from examples.bench.claims import CONFIRMED, NOT_CONFIRMED, NOT_MEASURED, Largest


def test_linear_fit_recovers_a_line_and_scores_noise():
    slope, intercept, r2 = claims.linear_fit([16, 32, 48, 64], [1.5, 2.5, 3.5, 4.5])
    assert (slope, intercept, r2) == pytest.approx((1 / 16, 0.5, 1.0))
    assert claims.linear_fit([1, 2, 3, 4], [1, 3, 1, 3])[2] < 0.5
    with pytest.raises(ValueError, match="all x are equal"):
        claims.linear_fit([2, 2], [1, 3])


@pytest.mark.parametrize("stronghold, offload, infinity, status", [
    (Largest(params_B=5.1, complete=True), Largest(params_B=2.5, complete=True), Largest(params_B=2.5, complete=True), CONFIRMED),
    (Largest(params_B=5.1, complete=True), Largest(params_B=5.1, complete=True), Largest(params_B=2.5, complete=True), NOT_CONFIRMED),
    # stronghold's search unfinished: 1.2x is only a lower bound
    (Largest(params_B=3.0, complete=False), Largest(params_B=2.5, complete=True), Largest(params_B=2.5, complete=True), NOT_MEASURED),
    # a baseline's search unfinished: 2x is only an upper bound
    (Largest(params_B=5.1, complete=True), Largest(params_B=2.5, complete=False), Largest(params_B=2.5, complete=True), NOT_MEASURED),
    (Largest(params_B=None, complete=False), Largest(params_B=2.5, complete=True), Largest(params_B=2.5, complete=True), NOT_MEASURED),
])
def test_larger_model(stronghold, offload, infinity, status):
    claim = claims.larger_model(stronghold, {"zero_offload": offload, "zero_infinity": infinity})
    assert claim.status == status


def test_throughput():
    good = [("32 layers", "zero_offload", 0.37, 0.66), ("48 layers", "zero_offload", 0.25, 0.40)]
    assert claims.throughput(good).status == CONFIRMED
    assert "1.78x zero_offload" in claims.throughput(good).evidence
    assert claims.throughput(good + [("48 layers", "zero_infinity", 0.5, 0.4)]).status == NOT_CONFIRMED
    assert claims.throughput(good + [("48 layers", "zero_infinity", 0.2, 0.0)]).status == NOT_CONFIRMED, "stronghold failed"
    assert claims.throughput(good + [("48 layers", "zero_infinity", 0.2, None)]).status == NOT_MEASURED
    assert claims.throughput([]).status == NOT_MEASURED


def test_near_plain():
    assert claims.near_plain("32 layers", 0.75, 0.66).status == CONFIRMED
    assert claims.near_plain("32 layers", 0.75, 0.5).status == NOT_CONFIRMED
    assert claims.near_plain("32 layers", None, 0.5).status == NOT_MEASURED


def test_linear_scaling_and_window_sweep():
    assert claims.linear_scaling([(16, 1.0), (32, 2.0), (48, 3.01)]).status == CONFIRMED
    assert claims.linear_scaling([(16, 1.0), (32, 4.0), (48, 4.1)]).status == NOT_CONFIRMED
    assert claims.linear_scaling([(16, 1.0), (32, 2.0)]).status == NOT_MEASURED
    assert claims.window_sweep([(2, 0.3), (4, 0.5), (8, 0.6), (16, 0.61)]).status == CONFIRMED
    assert claims.window_sweep([(2, 0.6), (4, 0.6), (8, 0.6)]).status == NOT_CONFIRMED, "no rise"
    assert claims.window_sweep([(2, 0.3), (4, 0.4), (8, 0.6)]).status == NOT_CONFIRMED, "no plateau"
