"""Questions asked of stored records by the sweeps and the report (pure functions over dicts)."""
from __future__ import annotations

import json
from typing import Any, Iterable

from .point import Point


def _key_without(key: str, *names: str) -> dict[str, Any]:
    fields = json.loads(key)
    for name in names:
        fields.pop(name, None)
    return fields


def same_series(record: dict[str, Any], point: Point) -> bool:
    """`record` is `point` at some layer count (same system, shape, cap and knobs)."""
    return _key_without(record["key"], "layers") == _key_without(point.key(), "layers")


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
    want = _key_without(point.key(), "layers")  # parsed once, not per record
    return sorted((r for r in records.values() if _key_without(r["key"], "layers") == want), key=lambda r: r["layers"])


def at(records: dict[str, dict[str, Any]], point: Point) -> dict[str, Any] | None:
    return records.get(point.key())


def ok(record: dict[str, Any] | None) -> bool:
    return record is not None and record.get("error") is None


def _largest_fit(found: list[dict[str, Any]]) -> dict[str, Any] | None:
    fits = [r for r in found if ok(r)]
    return fits[-1] if fits else None


def _first_failure_above(found: list[dict[str, Any]], layers: int) -> dict[str, Any] | None:
    failures = [r for r in found if not ok(r) and r["layers"] > layers]
    return failures[0] if failures else None


def largest_fit(records: dict[str, dict[str, Any]], point: Point) -> dict[str, Any] | None:
    """The successful record of `point`'s series with the most layers (the Fig. 6a answer)."""
    return _largest_fit(series(records, point))


def search_answer(records: dict[str, dict[str, Any]], point: Point) -> tuple[dict | None, dict | None]:
    """Fig. 6a's answer for `point`'s series: (largest fit, first failure above it). Without the
    failure the search has not finished and the fit is only a lower bound."""
    found = series(records, point)
    fit = _largest_fit(found)
    return fit, _first_failure_above(found, fit["layers"] if fit else 0)


def first_failure_above(records: dict[str, dict[str, Any]], point: Point, layers: int) -> dict[str, Any] | None:
    """The failed record of `point`'s series with the fewest layers above `layers`: it bounds the
    Fig. 6a answer from above; without it the search has not finished."""
    return _first_failure_above(series(records, point), layers)


def with_any_knobs(records: dict[str, dict[str, Any]], point: Point) -> list[dict[str, Any]]:
    """Records of `point` whatever their stronghold knobs."""
    want = _key_without(point.key(), "stronghold")
    return [r for r in records.values() if _key_without(r["key"], "stronghold") == want]


def knob_groups(records: dict[str, dict[str, Any]], point: Point, knob: str) -> dict[str, list[tuple[Any, dict]]]:
    """Records of `point` (any stronghold knobs) that set `knob`, grouped by their other knobs:
    {json of the other knobs: [(knob value, record), ...] by value}. Each group is one sweep of
    `knob` with everything else held."""
    groups: dict[str, list[tuple[Any, dict]]] = {}
    for record in with_any_knobs(records, point):
        knobs = dict(record.get("stronghold_knobs") or {})
        if knob not in knobs:
            continue
        value = knobs.pop(knob)
        groups.setdefault(json.dumps(knobs, sort_keys=True), []).append((value, record))
    return {held: sorted(found, key=lambda item: item[0]) for held, found in groups.items()}
