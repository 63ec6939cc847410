"""Questions asked of stored records by the sweeps and the report (pure functions over dicts)."""
from __future__ import annotations

import json
from typing import Any, Iterable

from .point import Point


def _key_without_layers(key: str) -> dict[str, Any]:
    fields = json.loads(key)
    fields.pop("layers", None)
    return fields


def same_series(record: dict[str, Any], point: Point) -> bool:
    """`record` is `point` at some layer count (same system, shape, cap and knobs)."""
    return _key_without_layers(record["key"]) == _key_without_layers(point.key())


def latest(records: Iterable[dict[str, Any]], commit: str | None = None) -> dict[str, dict[str, Any]]:
    """The newest record per point key (only `commit`'s, if given), by its UTC ISO date."""
    out: dict[str, dict[str, Any]] = {}
    for record in records:
        if commit is not None and record.get("commit") != commit:
            continue
        held = out.get(record["key"])
        if held is None or str(record.get("date", "")) >= str(held.get("date", "")):
            out[record["key"]] = record
    return out


def series(records: dict[str, dict[str, Any]], point: Point) -> list[dict[str, Any]]:
    """`point`'s records at every layer count, by layers."""
    return sorted((r for r in records.values() if same_series(r, point)), key=lambda r: r["layers"])


def at(records: dict[str, dict[str, Any]], point: Point) -> dict[str, Any] | None:
    return records.get(point.key())


def ok(record: dict[str, Any] | None) -> bool:
    return record is not None and record.get("error") is None


def largest_fit(records: dict[str, dict[str, Any]], point: Point) -> dict[str, Any] | None:
    """The successful record of `point`'s series with the most layers (the Fig. 6a answer)."""
    fits = [r for r in series(records, point) if ok(r)]
    return fits[-1] if fits else None


def search_answer(records: dict[str, dict[str, Any]], point: Point) -> tuple[dict | None, dict | None]:
    """Fig. 6a's answer for `point`'s series: (largest fit, first failure above it). Without the
    failure the search has not finished and the fit is only a lower bound."""
    fit = largest_fit(records, point)
    return fit, first_failure_above(records, point, fit["layers"] if fit else 0)


def first_failure_above(records: dict[str, dict[str, Any]], point: Point, layers: int) -> dict[str, Any] | None:
    """The failed record of `point`'s series with the fewest layers above `layers`: it bounds the
    Fig. 6a answer from above; without it the search has not finished."""
    failures = [r for r in series(records, point) if not ok(r) and r["layers"] > layers]
    return failures[0] if failures else None


def knob_series(records: dict[str, dict[str, Any]], point: Point, knob: str) -> list[tuple[Any, dict[str, Any]]]:
    """(value, record) of `point` with its stronghold knobs plus `knob` set to each measured value."""
    base = json.loads(point.key())
    base["stronghold"] = {k: v for k, v in base["stronghold"].items() if k != knob}
    out = []
    for record in records.values():
        fields = json.loads(record["key"])
        knobs = dict(fields.get("stronghold") or {})
        if knob not in knobs:
            continue
        value = knobs.pop(knob)
        if {**fields, "stronghold": knobs} == base:
            out.append((value, record))
    return sorted(out, key=lambda item: item[0])
