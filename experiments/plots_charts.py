"""The figures besides the Gantt: memory per device over time, bubble rate against m and throughput against GPUs
from a sweep's table, and predicted against measured from ``pipescope validate``."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogFormatter, PercentFormatter

from pipescope.experiments.palette import schedule_color, schedule_marker
from pipescope.experiments.plots_data import SWEEP_COLUMNS, RunData, run_data, sweep_table
from pipescope.experiments.plots_gantt import draw_memory
from pipescope.experiments.plots_style import COLORS, LABELS, UNKNOWN_COLOR, byte_unit, plain, time_unit
from pipescope.simulator.result import SimResult

SCHEDULE, MICROBATCHES, STAGES, REPLICAS = ("schedule.name", "schedule.microbatches", "schedule.stages",
                                            "cluster.data_parallel")
PREDICTED_COLOR, MEASURED_COLOR = "#4C72B0", "#DD8452"
GPUS = "gpus"  # a sweep's table: every GPU the run used (pipeline devices x tensor x context, all replicas)
SPLITS = (STAGES, REPLICAS, "parallel.tensor", "parallel.context")  # the ways one GPU count is split
SWEEP_TABLE = "a sweep's table (pipescope sweep's results)"
MAX_LINES = 40  # a legend beyond this is unreadable
MAX_PLOT_GPUS = 10**7  # GPUs on the throughput chart's axis: far beyond any cluster, short of float trouble
MODEL_KEYS = ("model.preset", "model.layers", "model.hidden", "model.heads", "model.seq", "model.vocab")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", ":", "-.")


def memory_figure(result: SimResult | RunData, title: str | None = None) -> Figure:
    """Each device's bytes in use over the run (replica 0's devices: every replica holds the same)."""
    data = run_data(result)
    if not data.memory:
        raise ValueError("memory: the run holds no memory timeline, expected a simulated run or a Chrome trace")
    if not data.counted_bytes:  # an empty chart would say nothing
        raise ValueError("memory: the run counted no bytes (uniform costs have no model to count), expected a run "
                         "under analytic or profile costs")
    origin = int(data.ops["start_ns"].min()) if len(data.ops) else 0
    unit, scale = time_unit(int(data.ops["end_ns"].max()) - origin if len(data.ops) else 0)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    draw_memory(ax, data, origin, scale)
    ax.set_xlabel(f"time ({unit})")
    drawn = "" if title or data.replicas < 2 else f"  (replica 0 of {data.replicas}: each holds the same)"
    fig.suptitle(plain((title or data.title) + drawn), fontsize=10)  # the axes title says what is drawn
    fig.tight_layout()
    return fig


def sweep_lines(frame: pd.DataFrame, x: str, y: str, folded: tuple[str, ...], how: str
                ) -> dict[tuple[str, str], pd.Series]:
    """``y`` against ``x``, one line per schedule and per value of the other config columns that vary on their own.

    Config columns are the dotted ones (``schedule.stages``). Taken in order, a column splits lines only if it still
    varies once the schedule, ``x``, ``folded`` and the columns chosen before it are fixed: a resolved
    ``schedule.chunks`` follows the schedule, ``model.layers_per_stage`` the stages, and neither splits anything.
    Columns named ``folded`` are neither lines nor the x axis: rows that differ only in them share a point, which
    takes ``how`` (``mean`` or ``max``) of their ``y``. A model column that varies always splits lines: a point
    must not take the best of two models. Keyed by (schedule, legend label).
    """
    given = [SCHEDULE, x, *(c for c in folded if c in frame)]
    labels = frame[given + [c for c in frame.columns if "." in c and c not in given]].map(_text)
    fixed = [labels[c] for c in given]
    # another model is another line, even where it follows a folded key (a sweep zipping the model with the stages)
    keys: list[str] = []
    for column in (c for c in MODEL_KEYS if c in labels and c != x):  # a preset's own layers split nothing more
        if _varies(labels[column], [labels[k] for k in keys]):
            keys.append(column)
    for column in labels.columns[len(given):]:
        if column not in keys and _varies(labels[column], fixed + [labels[k] for k in keys]):
            keys.append(column)
    groups = frame.groupby([labels[SCHEDULE], *(labels[k] for k in keys)]).ngroups
    if groups > MAX_LINES:
        raise ValueError(f"{y}: {groups} lines (schedules x {', '.join(keys) or 'nothing else'}), expected at most "
                         f"{MAX_LINES}: filter the table first")
    lines = {}
    grouped = frame.groupby([labels[SCHEDULE], *(labels[k] for k in keys)], sort=False)
    for name, group in sorted(grouped, key=lambda item: _in_order(item[0])):
        values = name if isinstance(name, tuple) else (name,)
        extra = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, values[1:]))
        label = plain(values[0] + (f" ({extra})" if extra else ""))
        lines[values[0], label] = group.groupby(x)[y].agg(how).sort_index()
    return lines


def _in_order(name: str | tuple[str, ...]) -> tuple:
    """A line's key values in reading order: numbers by value (4, 8, 16, not '16', '4', '8'), then words."""
    def one(value: str) -> tuple:
        try:
            return 0, float(value), ""
        except ValueError:
            return 1, 0.0, value
    return tuple(one(v) for v in (name if isinstance(name, tuple) else (name,)))


def _varies(column: pd.Series, within: list[pd.Series]) -> bool:
    """Whether ``column`` takes two values or more among rows equal in every one of ``within`` (or at all)."""
    return (column.groupby(within).nunique().max() if within else column.nunique()) > 1


def _same(a: pd.Series, b: pd.Series) -> bool:
    return a.index.equals(b.index) and bool(np.allclose(a.to_numpy(float), b.to_numpy(float), rtol=1e-3))


def _text(value: object) -> str:
    """A config value for a legend: 4, not 4.0 (a column with a failed run's gap reads as floats); a key left unset
    (null, as a shard group over every replica) reads ``unset``, not pandas' ``<NA>``."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "unset"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _line_figure(lines: dict[tuple[str, str], pd.Series], xlabel: str, ylabel: str, title: str
                 ) -> tuple[Figure, plt.Axes]:
    """A line per (schedule, label): the schedule's colour and marker (``palette``), hollow; a line equal to one
    drawn before (GPipe's and 1F1B's bubble) dashed, so that neither hides the other; a schedule's further lines
    dashed, dotted, ..."""
    fig, ax = plt.subplots(figsize=(9, 5.5))
    seen: dict[str, int] = {}
    drawn: list[pd.Series] = []
    for (schedule, label), series in lines.items():
        k = seen[schedule] = seen.get(schedule, -1) + 1
        style = LINESTYLES[k % len(LINESTYLES)]
        if any(_same(series, other) for other in drawn):
            style = (0, (3, 3))  # dashed over an equal line, so that the one beneath shows between the dashes
        ax.plot(series.index, series.to_numpy(), color=schedule_color(schedule), marker=schedule_marker(schedule),
                markerfacecolor="none", markersize=8, linestyle=style, linewidth=2.2, label=label, clip_on=False)
        drawn.append(series)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(plain(title))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    return fig, ax


def bubble_figure(frame: pd.DataFrame, title: str | None = None) -> Figure:
    """Bubble rate against microbatches m, a line per schedule (rows differing only in keys that are not config
    columns, such as ``seed``, are averaged)."""
    frame = sweep_table(frame, SWEEP_COLUMNS["bubble"], SWEEP_TABLE)
    lines = sweep_lines(frame, MICROBATCHES, "bubble_rate", (), "mean")
    fig, ax = _line_figure(lines, "microbatches per iteration m", "bubble rate (% of device time idle)",
                           title or "bubble rate against microbatches")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(frame[MICROBATCHES])), [str(m) for m in sorted(set(frame[MICROBATCHES]))])
    top = max(float(series.max()) for series in lines.values()) or 1.0
    ax.set_ylim(-0.03 * top, top * 1.06)  # room on both sides: a zero-bubble schedule's 0% markers stay whole too
    fig.tight_layout()
    return fig


def throughput_figure(frame: pd.DataFrame, title: str | None = None) -> Figure:
    """Throughput against GPUs (every GPU a run used: the table's ``gpus``), a line per schedule on log-log axes
    beside ideal linear scaling from the best run at the fewest GPUs; where several splits of the same GPUs ran (4
    stages x 2 replicas, 8 x 1, tensor 2 x 4 replicas), the best one's among those that fit in memory. A sweep of
    one GPU count is a bar per line."""
    frame = sweep_table(frame, SWEEP_COLUMNS["throughput"], SWEEP_TABLE)
    if "oom" in frame:  # a run that does not fit is no split anyone can use, however fast it would be
        frame = frame[~frame["oom"].astype(bool)]
        if frame.empty:
            raise ValueError("INPUT: every run is out of memory (oom), expected some that fit")
    frame = frame.assign(**{GPUS: _gpus(frame)})
    lines = sweep_lines(frame, GPUS, "throughput_samples_per_s", SPLITS, "max")
    counts = sorted(set(frame[GPUS]))
    if len(counts) == 1:
        return _bars_at_one_count(lines, counts[0], title)
    fig, ax = _line_figure(lines, "GPUs", "throughput (samples/s)",
                           title or "throughput against GPUs (best split of each GPU count)")
    fewest = min(series.index.min() for series in lines.values())
    start = max(series.get(fewest, 0.0) for series in lines.values())
    ax.plot(counts, [start * g / fewest for g in counts], color="0.55", linestyle=(0, (4, 3)), linewidth=1,
            label=f"ideal: linear from the best at {fewest} GPUs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(_plain_log_labels(ax, LogFormatter(labelOnlyBase=False)))
    ax.yaxis.set_minor_formatter(_plain_log_labels(ax, LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4))))
    ax.set_xticks(counts, [str(g) for g in counts])
    ax.margins(x=0.06, y=0.08)  # markers at the ends stay inside the frame
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def _gpus(frame: pd.DataFrame) -> pd.Series:
    """Each run's GPUs: the table's own ``gpus`` where every row has it, else (a table without the column) the
    product of the parallel widths it has."""
    if GPUS in frame and frame[GPUS].notna().all():
        gpus, named = pd.to_numeric(frame[GPUS], errors="coerce"), GPUS
    else:
        gpus, named = pd.to_numeric(frame[STAGES], errors="coerce"), " x ".join(c for c in SPLITS if c in frame)
        for column in SPLITS[1:]:
            if column in frame:
                gpus = gpus * pd.to_numeric(frame[column], errors="coerce").fillna(1)
    bad = ~(gpus.between(1, MAX_PLOT_GPUS) & (gpus == gpus.round()))  # 0 GPUs would divide the ideal line by 0
    if bad.any():
        raise ValueError(f"INPUT: {named}: got {str(gpus[bad].iloc[0])[:40]!r}, expected a whole number of GPUs "
                         f"from 1 to {MAX_PLOT_GPUS:,}")
    return gpus.astype(int)


def _plain_log_labels(ax: plt.Axes, chooser: LogFormatter) -> FuncFormatter:
    """A log axis' labels as plain numbers (400, 0.2), not matplotlib's 4×10² and 2e−01, on the ticks ``chooser``
    (matplotlib's own choice of which log ticks to label) labels."""
    chooser.set_axis(ax.yaxis)
    return FuncFormatter(lambda value, pos: f"{value:g}" if chooser(value, pos) else "")


def _bars_at_one_count(lines: dict[tuple[str, str], pd.Series], gpus: int, title: str | None) -> Figure:
    """The sweep did not vary the GPUs: one horizontal bar per line, in its schedule's colour, its label beside it,
    rather than a stack of markers on one vertical."""
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.32 * len(lines)))
    values = [float(series.iloc[0]) for series in lines.values()]
    ax.barh(range(len(lines)), values, color=[schedule_color(schedule) for schedule, _ in lines])
    ax.set_yticks(range(len(lines)), [label for _, label in lines], fontsize=8)
    ax.invert_yaxis()  # the legend's order, top to bottom
    ax.set_xlabel("throughput (samples/s)")
    ax.set_title(plain(title or f"throughput at {gpus} GPUs (the sweep does not vary the GPU count)"))
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def validate_figure(report: dict, title: str | None = None) -> Figure:
    """``pipescope validate --json``: iteration time, each device's busy time and (where the report has it) peak
    memory, predicted beside measured."""
    devices = report["per_device"]
    memory = all("predicted_peak_memory_bytes" in d and "measured_peak_memory_bytes" in d for d in devices)
    fig, axes = plt.subplots(1, 3 if memory else 2, figsize=(16 if memory else 12, 4.5),
                             gridspec_kw={"width_ratios": [1, 3, 3] if memory else [1, 3]})
    times = [report["predicted_iteration_time_s"] * 1e3, report["measured_iteration_time_s"] * 1e3]
    axes[0].bar(["predicted", "measured"], times, color=[PREDICTED_COLOR, MEASURED_COLOR])
    axes[0].set_ylabel("iteration time (ms)")
    _paired_bars(axes[1], devices, "busy_s", 1e3, "busy time per iteration (ms)")
    if memory:
        unit, unit_bytes = byte_unit(max(d[f"{side}_peak_memory_bytes"] for d in devices
                                         for side in ("predicted", "measured")))
        _paired_bars(axes[2], devices, "peak_memory_bytes", 1 / unit_bytes, f"peak memory ({unit})")
    fig.suptitle(plain(title or f"{report['schedule']}: p={report['stages']} m={report['microbatches']}, predicted "
                 f"vs measured (iteration time error {report['iteration_time_error']:+.1%})"))
    fig.tight_layout()
    return fig


def _paired_bars(ax: plt.Axes, devices: list[dict], field: str, scale: float, ylabel: str) -> None:
    """``predicted_FIELD`` beside ``measured_FIELD`` for each device, times ``scale``."""
    x = np.arange(len(devices))
    for offset, side, color in ((-0.2, "predicted", PREDICTED_COLOR), (0.2, "measured", MEASURED_COLOR)):
        ax.bar(x + offset, [d[f"{side}_{field}"] * scale for d in devices], 0.4, color=color, label=side)
    ax.set_xticks(x, [f"device {d['device']:g}" for d in devices])
    ax.set_ylabel(ylabel)
    ax.legend(frameon=False)


def overlay_figure(predicted: pd.DataFrame, measured: pd.DataFrame, name: str, title: str | None = None) -> Figure:
    """Predicted (top) and measured (bottom) compute rows of one iteration on one time axis.

    Both frames have device, kind, start_ns, end_ns; ``measured`` may hold several iterations (the first is drawn).
    Each is drawn from its own first op, so two runs that started at different clock times line up.
    """
    if "iteration" in measured:
        measured = measured[measured["iteration"] == measured["iteration"].min()]
    devices = int(max(predicted["device"].max(), measured["device"].max())) + 1
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(14, 1.6 + 0.6 * devices))
    span = max(predicted["end_ns"].max() - predicted["start_ns"].min(),
               measured["end_ns"].max() - measured["start_ns"].min())
    unit, scale = time_unit(span)
    for ax, frame, label in ((axes[0], predicted, "predicted"), (axes[1], measured, "measured")):
        origin = frame["start_ns"].min()
        for (device, kind), group in frame.groupby(["device", "kind"]):
            bars = list(zip((group["start_ns"] - origin) / scale, (group["end_ns"] - group["start_ns"]) / scale))
            ax.broken_barh(bars, (device - 0.4, 0.8), facecolors=COLORS.get(kind, UNKNOWN_COLOR), edgecolor="white",
                           linewidth=0.3)
        ax.set_yticks(range(devices), [f"device {d}" for d in range(devices)])
        ax.set_ylim(devices - 0.5, -0.5)
        ax.set_ylabel(label)
    kinds = [k for k in COLORS if k in set(predicted["kind"]) | set(measured["kind"])]
    axes[0].legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in kinds], loc="center left",
                   bbox_to_anchor=(1.0, 0.0), frameon=False)
    axes[1].set_xlabel(f"time ({unit})")
    axes[0].set_title(plain(title or f"{name}: predicted (top) and measured (bottom)"))
    fig.tight_layout()
    return fig
