"""PNG plots of the figures (matplotlib, Agg backend: no display needed).

Each function takes the numbers report.py already pulled out of the records and writes one PNG.
They return False, and write nothing, where matplotlib is not installed (requirements.txt pins it,
but the report must not need it), so tables and claims are still produced.
"""
from __future__ import annotations

from pathlib import Path

SYSTEM_COLORS = {"stronghold": "tab:red", "no_offload": "tab:gray", "zero_offload": "tab:blue",
                 "zero_infinity": "tab:green"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, caption: str) -> None:
    fig.text(0.01, 0.01, caption, fontsize=6, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)


def grouped_bars(groups: dict[str, dict[str, float]], ylabel: str, title: str, path: Path, caption: str) -> bool:
    """One group of bars per key of `groups` (a cap, a model size), one bar per system in it."""
    plt = _pyplot()
    if plt is None or not groups:
        return False
    systems = [s for s in SYSTEM_COLORS if any(s in bars for bars in groups.values())]
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, system in enumerate(systems):
        xs = [g + i * width for g, bars in enumerate(groups.values()) if system in bars]
        ys = [bars[system] for bars in groups.values() if system in bars]
        rects = ax.bar(xs, ys, width, label=system, color=SYSTEM_COLORS[system])
        ax.bar_label(rects, fmt="%.2f", fontsize=7)
    ax.set_xticks([g + width * (len(systems) - 1) / 2 for g in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path, caption)
    plt.close(fig)
    return True


def line_fit(points: list[tuple[int, float]], fit: tuple[float, float, float] | None, title: str, path: Path,
             caption: str) -> bool:
    """Iteration time against layers, with the least-squares line (slope, intercept, R^2)."""
    plt = _pyplot()
    if plt is None or not points:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    xs, ys = [x for x, _ in points], [y for _, y in points]
    ax.plot(xs, ys, "o", color=SYSTEM_COLORS["stronghold"], label="stronghold")
    if fit is not None:
        slope, intercept, r2 = fit
        ax.plot(xs, [intercept + slope * x for x in xs], "--", color="black",
                label=f"fit: {slope * 1e3:.1f} ms/layer + {intercept:.2f} s, R²={r2:.4f}")
    ax.set_xlabel("layers")
    ax.set_ylabel("s / iteration")
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path, caption)
    plt.close(fig)
    return True


def knob_sweeps(panels: dict[str, dict[str, list[tuple[int, float]]]], title: str, path: Path, caption: str) -> bool:
    """One panel per knob (window_size, resident_blocks): samples/s against its value, one line per
    setting of the other knobs (the line's label)."""
    plt = _pyplot()
    panels = {name: {label: pts for label, pts in lines.items() if pts} for name, lines in panels.items()}
    panels = {name: lines for name, lines in panels.items() if lines}
    if plt is None or not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (name, lines) in zip(axes[0], panels.items()):
        for label, pts in lines.items():
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=label)
        ax.set_xlabel(name)
        ax.set_ylabel("samples / s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    _save(fig, path, caption)
    plt.close(fig)
    return True
