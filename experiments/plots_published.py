"""``pipescope validate --published --plot FILE``: predicted against measured on log-log axes, one marker per
source, the y = x line and a ±10% band; iteration time on the left, peak memory on the right when scored."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from pipescope.experiments.plots_charts import MARKERS
from pipescope.experiments.plots_style import save_figure

BAND = 0.10
PANELS = {"time": ("iteration time", 1.0, "s"), "memory": ("peak memory per GPU", 1 / (1 << 30), "GiB")}


def published_figure(rows: list[dict[str, Any]]) -> Figure:
    """One panel per quantity of measurement the rows hold (runs that failed are left out)."""
    ok = [row for row in rows if row["status"] == "ok"]
    shown = [quantity for quantity in PANELS if any(row["quantity"] == quantity for row in ok)]
    if not shown:
        raise ValueError("--plot: no run was simulated, expected at least one to draw")
    sources = sorted({row["source"] for row in ok})
    fig, axes = plt.subplots(1, len(shown), figsize=(6.2 * len(shown), 5.6), squeeze=False)
    for ax, quantity in zip(axes[0], shown):
        _panel(ax, [row for row in ok if row["quantity"] == quantity], quantity, sources)
    fig.suptitle("pipescope against published measurements", fontsize=11)
    fig.tight_layout()
    return fig


def _panel(ax, rows: list[dict[str, Any]], quantity: str, sources: list[str]) -> None:
    what, scale, unit = PANELS[quantity]
    measured = np.array([row["measured"] for row in rows]) * scale
    predicted = np.array([row["predicted"] for row in rows]) * scale
    low, high = min(measured.min(), predicted.min()) / 1.3, max(measured.max(), predicted.max()) * 1.3
    line = np.geomspace(low, high, 50)
    ax.fill_between(line, line * (1 - BAND), line * (1 + BAND), color="0.88", label=f"\u00b1{BAND:.0%}")
    ax.plot(line, line, color="0.4", linewidth=1, label="y = x")
    for i, source in enumerate(sources):
        mine = [j for j, row in enumerate(rows) if row["source"] == source]
        if mine:
            ax.scatter(measured[mine], predicted[mine], marker=MARKERS[i % len(MARKERS)], s=36, label=source,
                       zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    for axis in (ax.xaxis, ax.yaxis):  # 40 and 60, not 4 x 10^1; under a decade only minor ticks have labels
        axis.set_major_formatter(FuncFormatter(_number))
        if high / low < 10:
            axis.set_minor_formatter(FuncFormatter(_number))
    ax.set_aspect("equal")
    ax.set_xlabel(f"measured {what} ({unit})")
    ax.set_ylabel(f"predicted {what} ({unit})")
    errors = [abs(row["error_rel"]) for row in rows]
    ax.set_title(f"{what}: {len(rows)} runs, mean |error| {np.mean(errors):.1%}, worst {max(errors):.1%}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)


def write_published_plot(rows: list[dict[str, Any]], path: str) -> None:
    """Draw ``published_figure`` to ``path`` (.png, .svg or .pdf), atomically."""
    save_figure(published_figure(rows), path)


def _number(value: float, _position: int) -> str:
    return f"{value:g}"
