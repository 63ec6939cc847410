"""Markdown tables and number formatting, shared by sweep summaries and the report."""
from __future__ import annotations

from typing import Any, Iterable, Sequence


def fmt(value: Any, digits: int = 2) -> str:
    """A number with `digits` decimals; '-' for missing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return str(value)


def cap_label(cap: float | None) -> str:
    return "uncapped" if cap is None else f"{cap:g} GiB cap"


def outcome(record: dict[str, Any] | None) -> str:
    if record is None:
        return "not run"
    return "ok" if record.get("error") is None else str(record["error"])


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
