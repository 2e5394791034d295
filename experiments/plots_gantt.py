"""The Gantt chart: one row per device (and, if asked, a lane per send, receive and collective stream under it), ops
coloured by kind with odd chunks darker, dashed lines where iterations end, the busiest links' busy spans and each
device's memory in panels below; in time or in unit steps (every op one cell)."""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pipescope.experiments.plots_data import LANES, RunData, iteration_ends, run_data, unit_steps
from pipescope.experiments.plots_style import (COLLECTIVE_COLOR, COLORS, COMM_COLORS, COMM_LABELS, LABELS, LINK_COLOR,
                                               ODD_CHUNK_COLORS, STALL_COLOR, UNKNOWN_COLOR, byte_unit, plain,
                                               time_unit)
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.result import SimResult
from pipescope.simulator.readers.units import format_bytes

MAX_LABELLED_OPS = 600  # beyond this, microbatch numbers turn into noise
MAX_DRAWN_MICROBATCHES = 256  # beyond this, a device's row of ops is a barcode: draw its busy share per kind instead
SUMMARY_BINS = 240  # time slices at most; fewer when a slice would hold under 8 microbatches' ops
MICROBATCHES_PER_SLICE = 8  # a slice over a few microbatches aliases with the schedule's period (a sawtooth)
MIN_VISIBLE_SHARE = 0.1  # a lane or link that carried anything in a slice shows at least this sliver of its row
MAX_ROWS = 32  # beyond this many devices, rows are too thin to read: draw replica 0 only
MAX_LINKS = 16
MAX_DRAWN_ROWS = 512  # 0.32 inch each at 150 dpi: near matplotlib's 2^16-pixel limit on an image's side
MODES = ("time", "steps")
BOUNDARY_STYLE = {"color": "black", "linestyle": "--", "linewidth": 0.8}


@dataclass(frozen=True)
class Axis:
    """The x axis: what an op's columns are read as, where it starts and how many of them make one unit."""

    start: str
    end: str
    origin: float
    scale: float
    label: str


def gantt_figure(result: SimResult | RunData, title: str | None = None, *, mode: str = "time",
                 comm_lanes: bool = False, memory: bool = False) -> Figure:
    """The familiar pipeline picture, device 0 at the top.

    Args:
        result: a run (``pipescope.run``'s result, or a ``RunData`` read from a trace or timeline file).
        title: replaces the default (schedule, p, m, v, iteration time, bubble).
        mode: ``time`` (x in s, ms or us) or ``steps`` (every op one unit, transfers free; compute rows only).
        comm_lanes: a lane per send, receive and collective stream under each device (time mode); without it, a
            device's collectives are a thin bar under its ops.
        memory: a panel of each device's bytes in use below (time mode, when the run counted bytes: uniform costs
            count none).
    """
    if mode not in MODES:
        raise ValueError(f"mode: got {mode!r}, expected one of {', '.join(MODES)}")
    data = run_data(result)
    shown = data.pipeline_devices if data.devices > MAX_ROWS and data.replicas > 1 else data.devices
    ops = data.ops[data.ops["device"] < shown]
    timed = mode == "time"
    if not timed:  # the schedule's own ops, as `check` counts its unit steps: no optimizer step takes one
        ops = ops[(ops["lane"] == "compute") & (ops["kind"].astype(str) != ActionKind.OPT.value)]
        ops = ops.assign(step=unit_steps(ops, data.pipeline_devices), step_end=lambda f: f["step"] + 1)
    lanes = [lane for lane in LANES if lane in set(ops["lane"])] if comm_lanes and timed else ["compute"]
    if shown * len(lanes) > MAX_DRAWN_ROWS:
        raise ValueError(f"gantt: {shown} devices x {len(lanes)} lanes, expected at most {MAX_DRAWN_ROWS} rows "
                         f"(a taller figure is past what an image can hold)")
    rows = {(d, lane): i for i, (d, lane) in enumerate((d, lane) for d in range(shown) for lane in lanes)}
    links = dict(list(data.links.items())[:MAX_LINKS]) if timed else {}
    panels = [p for p, on in (("links", links), ("memory", memory and timed and data.counted_bytes)) if on]
    fig, axes = _axes(len(rows), len(links), panels)
    axis = _axis(ops, timed)
    ax = axes[0]
    thin = not comm_lanes and bool((ops["lane"] == "collective").any())
    microbatches = int(ops.loc[ops["lane"] == "compute", "microbatch"].nunique())  # over every iteration drawn
    summary = timed and microbatches > MAX_DRAWN_MICROBATCHES
    slices = _slices(ops, axis, microbatches) if summary else None
    if slices is not None:
        _draw_busy_shares(ax, ops[ops["lane"] == "compute"], rows, axis, slices, 0.68 if thin else 0.8)
    else:
        _draw_compute(ax, ops, rows, axis, data, thin)
        if timed:
            _draw_stalls(ax, data.stalls[data.stalls[:, 0] < shown], rows, axis, 0.68 if thin else 0.8)
    if comm_lanes and timed:
        _draw_comm(ax, ops, rows, axis, slices)
    elif timed:
        _draw_collectives(ax, ops[ops["lane"] == "collective"], rows, axis, slices)
    _label_rows(ax, rows, lanes)
    boundaries = [(e - axis.origin) / axis.scale for e in iteration_ends(ops, data.microbatches, axis.end)]
    for a in axes:
        for x in boundaries:
            a.axvline(x, **BOUNDARY_STYLE)
    handles = _legend(ops, 1 if summary else data.chunks, comm_lanes and timed, bool(boundaries),
                      data.pipeline_devices)
    if timed and slices is None and len(data.stalls):
        handles.append(Patch(facecolor="white", edgecolor=STALL_COLOR, hatch="////",
                             label="waits for its unit's gather"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    steps = None if timed else int(ops[axis.end].max()) if len(ops) else 0
    ax.set_title(plain(_title(data, title, shown, steps) + (
        f"\n{microbatches} microbatches, more than {MAX_DRAWN_MICROBATCHES}: each row is the device's busy "
        f"share per kind in {len(slices) - 1} time slices, not its ops"
        + ("; memory its range in each" if "memory" in panels else "") if summary else "")))
    for name, panel in zip(panels, axes[1:]):
        if name == "links":
            _draw_links(panel, links, axis, slices)
        else:
            draw_memory(panel, data, axis.origin, axis.scale, slices)
    axes[-1].set_xlabel(axis.label)
    fig.tight_layout()
    return fig


def _axis(ops: pd.DataFrame, timed: bool) -> Axis:
    if not timed:
        return Axis("step", "step_end", 0, 1, "step (every op one unit; transfers free)")
    origin = int(ops["start_ns"].min()) if len(ops) else 0
    unit, scale = time_unit((ops["end_ns"].max() - origin) if len(ops) else 0)
    return Axis("start_ns", "end_ns", origin, scale, f"time ({unit})")


def _axes(rows: int, links: int, panels: list[str]) -> tuple[Figure, list[Axes]]:
    """The devices' axes, then a panel below for each of ``panels`` (links, memory), all sharing x."""
    heights = [0.32 * rows + 0.6] + [0.22 * links + 0.4 if p == "links" else 2.2 for p in panels]
    fig, axes = plt.subplots(len(heights), 1, sharex=True, figsize=(14, 1.0 + sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    return fig, list(axes[:, 0])


def _bars(frame: pd.DataFrame, axis: Axis) -> list[tuple[float, float]]:
    x = (frame[axis.start] - axis.origin) / axis.scale
    return list(zip(x, (frame[axis.end] - frame[axis.start]) / axis.scale))


def _draw_compute(ax: Axes, ops: pd.DataFrame, rows: dict, axis: Axis, data: RunData, thin: bool) -> None:
    """Ops as bars on their device's row; ``thin`` leaves the row's bottom to the collectives' bar."""
    frame = ops[ops["lane"] == "compute"]
    label = len(frame) <= MAX_LABELLED_OPS
    frame = frame.assign(odd=frame["stage"] // max(1, data.pipeline_devices) % 2)
    height = 0.68 if thin else 0.8  # thin: ends at y + 0.28, clear of the collectives' bar at y + 0.3
    # One collection per (device, kind, chunk parity): a Rectangle per op takes 20 s at p=32, m=128 with V chunks.
    # Edges separate neighbouring ops when they are wide enough to see; at thousands of ops they only wash out.
    edge = {"edgecolor": "white", "linewidth": 0.3} if label else {"linewidth": 0}
    for (device, kind, odd), group in frame.groupby(["device", "kind", "odd"]):
        color = (ODD_CHUNK_COLORS if odd else COLORS).get(kind, UNKNOWN_COLOR)
        ax.broken_barh(_bars(group, axis), (rows[(device, "compute")] - 0.4, height), facecolors=color, **edge)
    if label:
        numbered = frame[frame["kind"] != ActionKind.OPT]  # a step is no microbatch's, whatever its row says
        for (x, w), device, mb in zip(_bars(numbered, axis), numbered["device"], numbered["microbatch"]):
            ax.text(x + w / 2, rows[(device, "compute")] - 0.4 + height / 2, str(mb), ha="center", va="center",
                    fontsize=6, color="white")


def _draw_stalls(ax: Axes, stalls: np.ndarray, rows: dict, axis: Axis, height: float) -> None:
    """An op's waits between its units (ZeRO-3's gathers) hatched over its bar: the op holds its stream, idle."""
    for device in np.unique(stalls[:, 0]).tolist():
        mine = stalls[stalls[:, 0] == device]
        bars = list(zip((mine[:, 1] - axis.origin) / axis.scale, (mine[:, 2] - mine[:, 1]) / axis.scale))
        ax.broken_barh(bars, (rows[(device, "compute")] - 0.4, height), facecolors="white", edgecolor=STALL_COLOR,
                       hatch="////", linewidth=0)


def _slices(ops: pd.DataFrame, axis: Axis, microbatches: int) -> np.ndarray:
    """The edges of the time slices a summarised Gantt draws busy shares over: ``SUMMARY_BINS``, or one per
    ``MICROBATCHES_PER_SLICE`` microbatches when that is fewer."""
    bins = min(SUMMARY_BINS, max(1, microbatches // MICROBATCHES_PER_SLICE))
    return np.linspace(axis.origin, float(ops[axis.end].max()), bins + 1)


def _draw_busy_shares(ax: Axes, frame: pd.DataFrame, rows: dict, axis: Axis, slices: np.ndarray,
                      height: float) -> None:
    """Each device's row as stacked bands, one per kind, as high as the share of each time slice the device spent
    on that kind: fill, steady state and drain stay visible where thousands of ops would be a barcode."""
    for device, group in frame.groupby("device"):
        done = np.zeros(len(slices) - 1)
        for kind in [k for k in COLORS if k in set(group["kind"])]:
            done = _share_band(ax, group[group["kind"] == kind], axis, slices, rows[(device, "compute")] - 0.4,
                               height, COLORS[kind], done)


def _share_band(ax: Axes, frame: pd.DataFrame, axis: Axis, slices: np.ndarray, top: float, height: float,
                color: str, done: np.ndarray | None = None) -> np.ndarray:
    """A band in the row from ``top`` to ``top + height``, as high in each slice as the share of it ``frame``'s
    spans cover (overlapping spans, such as buckets' all-reduces, add up to the whole slice at most), stacked from the
    row's bottom
    on what ``done`` already holds; returns the new ``done``. Without ``done`` (a lane or a link, whose transfers
    are often a thousandth of a slice) a slice with any traffic shows at least ``MIN_VISIBLE_SHARE``."""
    sliver = done is None
    done = np.zeros(len(slices) - 1) if done is None else done
    busy = np.diff(_busy_until(frame[axis.start].to_numpy(float), frame[axis.end].to_numpy(float), slices))
    share = np.minimum(busy / np.diff(slices), 1.0 - done)
    if sliver:
        share = np.where(share > 0, np.maximum(share, MIN_VISIBLE_SHARE), 0.0)
    bottom = top + height  # y grows downwards: bands stack up from the row's bottom
    low, high = bottom - height * done, bottom - height * (done + share)
    x = (slices - axis.origin) / axis.scale
    ax.fill_between(x, np.append(low, low[-1]), np.append(high, high[-1]), step="post", color=color, linewidth=0)
    return done + share


def _busy_until(start: np.ndarray, end: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Time spent in the intervals [start, end) before each of ``at``: sum(clip(t - start, 0, end - start)), from
    sorted starts and ends with their running sums (no op x slice product)."""
    starts, ends = np.sort(start), np.sort(end)
    sum_starts, sum_ends = np.concatenate([[0.0], np.cumsum(starts)]), np.concatenate([[0.0], np.cumsum(ends)])
    began, ended = np.searchsorted(starts, at), np.searchsorted(ends, at)
    return (began * at - sum_starts[began]) - (ended * at - sum_ends[ended])


def _draw_comm(ax: Axes, ops: pd.DataFrame, rows: dict, axis: Axis, slices: np.ndarray | None) -> None:
    """Sends, receives and collectives on their device's lanes (transfers to two peers may overlap in a lane); with
    ``slices``, each lane's busy share per kind."""
    frame = ops[ops["lane"] != "compute"]
    for (device, lane, kind), group in frame.groupby(["device", "lane", "kind"]):
        color = COLLECTIVE_COLOR if lane == "collective" else COMM_COLORS.get(kind, UNKNOWN_COLOR)
        if slices is not None:
            _share_band(ax, group, axis, slices, rows[(device, lane)] - 0.3, 0.6, color)
            continue
        # An edge as wide as a hairline: a 10 us transfer on a 30 ms axis is narrower than a pixel and would vanish.
        ax.broken_barh(_bars(group, axis), (rows[(device, lane)] - 0.3, 0.6), facecolors=color, edgecolor=color,
                       linewidth=0.5)


def _draw_collectives(ax: Axes, frame: pd.DataFrame, rows: dict, axis: Axis, slices: np.ndarray | None) -> None:
    """Each device's collectives (all-reduce buckets, often overlapping) as one thin bar under its ops (with
    ``slices``, its busy share)."""
    for device, group in frame.groupby("device"):
        if slices is not None:
            _share_band(ax, group, axis, slices, rows[(device, "compute")] + 0.3, 0.15, COLLECTIVE_COLOR)
        else:
            ax.broken_barh(_bars(group, axis), (rows[(device, "compute")] + 0.3, 0.15), facecolors=COLLECTIVE_COLOR,
                           linewidth=0)


def _label_rows(ax: Axes, rows: dict, lanes: list[str]) -> None:
    """``device d`` on compute rows, the lane's name on the others; a rule between devices when there are lanes."""
    ax.set_yticks(list(rows.values()), [f"device {d}" if lane == "compute" else lane for d, lane in rows])
    for tick, (_, lane) in zip(ax.get_yticklabels(), rows):
        tick.set_fontsize(9 if lane == "compute" else 7)
    if len(lanes) > 1:
        for (_, lane), row in rows.items():
            if lane == "compute" and row:
                ax.axhline(row - 0.5, color="lightgrey", linewidth=0.6)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # device 0 at the top


def _draw_links(ax: Axes, links: dict[str, list[tuple[int, int]]], axis: Axis, slices: np.ndarray | None) -> None:
    """One row per link, busiest first (the order ``link_spans`` keeps), a bar wherever it carried a flow (with
    ``slices``, its busy share)."""
    for row, spans in enumerate(links.values()):
        if slices is not None:
            frame = pd.DataFrame(spans, columns=[axis.start, axis.end], dtype=float)
            _share_band(ax, frame, axis, slices, row - 0.35, 0.7, LINK_COLOR)
            continue
        bars = [((start - axis.origin) / axis.scale, (end - start) / axis.scale) for start, end in spans]
        # a hairline edge, as the transfer lanes have: a 19 us span on a 250 ms axis is under a pixel and vanished
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=LINK_COLOR, edgecolor=LINK_COLOR, linewidth=0.5)
    ax.set_yticks(range(len(links)), [plain(name) for name in links], fontsize=7)
    ax.set_ylim(len(links) - 0.5, -0.5)  # busiest link at the top, like device 0 above
    ax.set_title("busiest links (busy while carrying a flow)", fontsize=9, loc="left")


def draw_memory(ax: Axes, data: RunData, origin: float, scale: float, slices: np.ndarray | None = None) -> None:
    """Each device's bytes in use as a step line, held to the end of the run, in the unit its peak reads best in;
    the capacity as a dashed line when a peak comes within half of it (farther off, it would flatten every line: the
    title says it instead). With ``slices``, each device's lowest to highest bytes in each slice, as a band under
    its highest: hundreds of microbatches' rises and falls would fill the panel."""
    end = int(data.ops["end_ns"].max()) if len(data.ops) else 0
    peak = max((float(used.max()) for _, used in data.memory if len(used)), default=0.0)
    unit, unit_bytes = byte_unit(peak)
    for device, (times, used) in enumerate(data.memory):
        if not len(times):
            continue
        if slices is not None:
            low, high = _memory_range(np.asarray(times, float), np.asarray(used, float), slices)
            x = (slices - origin) / scale
            line, = ax.step(x, np.append(high, high[-1]) / unit_bytes, where="post", linewidth=1.0,
                            label=f"device {device}")
            ax.fill_between(x, np.append(low, low[-1]) / unit_bytes, np.append(high, high[-1]) / unit_bytes,
                            step="post", color=line.get_color(), alpha=0.25, linewidth=0)
            continue
        x = np.append(times, max(end, int(times[-1])))
        y = np.append(used, used[-1]) / unit_bytes
        ax.step((x - origin) / scale, y, where="post", linewidth=1.0, label=f"device {device}")
    cap = data.capacity_bytes or None
    if cap is not None and peak >= cap / 2:
        ax.axhline(cap / unit_bytes, color="black", linestyle=":", linewidth=1.0, label="capacity")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    text = "bytes in use per device" + (f" (capacity {format_bytes(cap)})" if cap is not None and peak < cap / 2
                                        else "")
    ax.set_title(text, fontsize=9, loc="left")
    if len(data.memory) <= 16:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)


def _memory_range(times: np.ndarray, used: np.ndarray, slices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lowest, highest) bytes in use in each slice of a step function that takes ``used[i]`` from ``times[i]``
    (its first value before the first time): the value a slice starts with and every one set inside it."""
    first = np.maximum(np.searchsorted(times, slices[:-1], side="right") - 1, 0)
    last = np.maximum(np.searchsorted(times, slices[1:], side="left"), first + 1)
    low = np.array([used[a:b].min() for a, b in zip(first, last)])
    high = np.array([used[a:b].max() for a, b in zip(first, last)])
    return low, high


def _legend(ops: pd.DataFrame, chunks: int, comm_lanes: bool, boundaries: bool, pipeline: int = 0) -> list:
    present = set(ops["kind"])
    kinds = [k for k in COLORS if k in present]
    handles: list = [Patch(color=COLORS[k], label=LABELS[k]) for k in kinds]
    if chunks > 1:  # only the kinds that run on an odd chunk (a device's vocabulary S and T are on its first)
        odd = set(ops.loc[(ops["lane"] == "compute") & (ops["stage"] // max(1, pipeline) % 2 == 1), "kind"])
        handles += [Patch(color=ODD_CHUNK_COLORS[k], label=f"{LABELS[k]}, odd chunk") for k in kinds if k in odd]
    if comm_lanes:
        seen = {COMM_LABELS[k]: COMM_COLORS[k] for k in COMM_LABELS if k in present}
        handles += [Patch(color=color, label=label) for label, color in seen.items()]
    lane = ops[ops["lane"] == "collective"]
    if len(lane):  # stage -1: clipping's norm, all a run without replicas reduces
        gradients = set(lane.loc[lane["stage"] >= 0, "kind"])
        label = ("clipping's norm all-reduce" if not gradients else
                 "gradient all-reduce" if gradients == {ActionKind.ALL_REDUCE} else "collectives")
        handles.append(Patch(color=COLLECTIVE_COLOR, label=label))
    if boundaries:
        handles.append(Line2D([], [], label="iteration ends", **BOUNDARY_STYLE))
    return handles


def _title(data: RunData, title: str | None, shown: int, steps: int | None) -> str:
    """The given or default title; says when only replica 0 is drawn, and in unit steps how many (the run's
    iteration time and bubble are its times', which the steps do not show)."""
    text = title or (data.title if steps is None else
                     f"{data.title.removesuffix(data.timed_measures)}  {steps} unit steps")
    return text if shown == data.devices else f"{text}  (replica 0 of {data.replicas})"
