"""``pipescope plot vocab``: MFU and peak memory per device against the vocabulary size, from a sweep over
``model.vocab`` and ``schedule.vocab`` (docs/plots.md, "vocab"; the picture of docs/schedules.md section 7)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from pipescope.experiments.palette import schedule_color
from pipescope.experiments.plots_charts import LINESTYLES, MARKERS
from pipescope.experiments.plots_data import sweep_table
from pipescope.experiments.plots_style import byte_unit, plain

VOCAB, METHOD, STAGES, SEQ = "model.vocab", "schedule.vocab", "schedule.stages", "model.seq"
NEEDED = ("schedule.name", VOCAB, METHOD, STAGES, SEQ, "mfu", "peak_memory_bytes")
MAX_PANELS = 12  # columns of the figure: (stages, seq) pairs


def vocab_figure(frame: pd.DataFrame, title: str | None = None) -> Figure:
    """Two rows of panels (MFU; peak memory per device in the unit it reads best in, the device's capacity dashed
    where a peak comes within half of it, else in the label), a column per
    (stages, sequence length), a line per method (schedule and ``schedule.vocab``), against the vocabulary."""
    frame = sweep_table(frame, NEEDED, "a sweep over model.vocab and schedule.vocab")
    frame = frame.assign(method=frame["schedule.name"].astype(str) + " " + frame[METHOD].astype(str))
    _check_one_point_per_mark(frame)
    panels = sorted({(int(stages), int(seq)) for stages, seq in zip(frame[STAGES], frame[SEQ])})
    if len(panels) > MAX_PANELS:
        raise ValueError(f"INPUT: {len(panels)} (stages, seq) pairs, expected at most {MAX_PANELS}: filter the table")
    # at least 6 inches wide, so that one panel's title and legend are not cut
    fig, axes = plt.subplots(2, len(panels), figsize=(max(6.0, 2.7 * len(panels) + 1), 6.5), squeeze=False,
                             sharex=True)
    peak = float(frame["peak_memory_bytes"].max())
    unit, scale = byte_unit(peak)  # a small model's MiB read as MiB, not as 0.00 GiB
    capacity = frame["memory_capacity_bytes"].max() if "memory_capacity_bytes" in frame else None
    near = bool(pd.notna(capacity) and peak >= capacity / 2)  # a line far above the peaks would flatten them
    methods = sorted(frame["method"].unique(), key=_order)
    placements = sorted(frame[METHOD].astype(str).unique(), key=_order)
    for col, (stages, seq) in enumerate(panels):
        part = frame[(frame[STAGES] == stages) & (frame[SEQ] == seq)]
        for method in methods:
            rows = part[part["method"] == method].groupby(VOCAB)
            schedule, placement = method.split(" ", 1)
            # the schedule's colour (as in every figure), a line style and marker per placement: "v-half vocab-2"
            # reads as both
            k = placements.index(placement)
            style = {"color": schedule_color(schedule), "marker": MARKERS[k % len(MARKERS)], "markerfacecolor": "none",
                     "linestyle": LINESTYLES[k % len(LINESTYLES)], "label": plain(method)}
            axes[0, col].plot(rows["mfu"].mean(), **style)
            axes[1, col].plot(rows["peak_memory_bytes"].max() / scale, **style)
        if near and part["memory_capacity_bytes"].notna().any():
            axes[1, col].axhline(part["memory_capacity_bytes"].max() / scale, color="grey", linestyle="--",
                                 linewidth=1, label="device memory")
        axes[0, col].set_title(f"{stages} GPUs, seq {seq}", fontsize=10)
        axes[1, col].set_xlabel("vocabulary")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ticks = sorted(frame[VOCAB].unique())
        ax.set_xticks(ticks, [f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in ticks])
        ax.grid(True, alpha=0.3)
        tops = [float(np.nanmax(line.get_ydata())) for line in ax.get_lines() if len(line.get_ydata())]
        ax.set_ylim(0, max(tops) * 1.08 if tops and max(tops) > 0 else None)  # the highest markers inside the frame
    axes[0, 0].yaxis.set_major_formatter(PercentFormatter(1.0))
    for ax in axes[0, 1:]:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    axes[0, 0].set_ylabel("MFU")
    far = "" if near or not pd.notna(capacity) else f"; device {capacity / 2**30:.0f} GiB"
    axes[1, 0].set_ylabel(f"peak memory per device ({unit}{far})")
    handles, labels = axes[1, -1].get_legend_handles_labels()
    fig.suptitle(plain(title or "vocabulary placement: MFU and peak memory against the vocabulary size"))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), frameon=False, fontsize=9)
    return fig


def _check_one_point_per_mark(frame: pd.DataFrame) -> None:
    """ValueError unless the table varies the vocabulary and nothing else beside the panels' and the lines' axes:
    runs that differ in another key would be averaged into one mark, silently."""
    sizes = sorted(frame[VOCAB].dropna().unique())
    if len(sizes) < 2:
        raise ValueError(f"INPUT: {VOCAB} takes {len(sizes)} value(s) {[int(v) for v in sizes]}, expected a sweep over "
                         f"{VOCAB} (two sizes at least)")
    axes = [c for c in frame.columns if ("." in c or c in ("iterations", "seed")) and c not in NEEDED]
    groups = frame.groupby([STAGES, SEQ, "method", VOCAB], dropna=False)
    for column in axes:
        if (groups[column].nunique(dropna=False) > 1).any():
            values = sorted(frame[column].dropna().astype(str).unique())[:4]
            raise ValueError(f"INPUT: {column} varies ({', '.join(values)}) between runs of one mark (stages, seq, "
                             "method and vocabulary alike), expected one run per mark: filter the table")


ORDER = ("1f1b", "v-half", "naive", "redistribute", "vocab-1", "vocab-2", "interlaced")


def _order(text: str) -> tuple[int, ...]:
    """Methods in the order of docs/schedules.md section 7 (unknown names last, as they come)."""
    return tuple(ORDER.index(part) if part in ORDER else len(ORDER) for part in text.split(" "))
