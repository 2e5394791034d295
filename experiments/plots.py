"""The Gantt chart: one row per device, ops coloured by kind, odd chunks in a darker shade, gradient all-reduce
buckets as a thin bar under each row's ops, and (with a routed network) the busiest links' busy spans below."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pipescope.simulator.files import write_atomic  # noqa: E402
from pipescope.simulator.result import SimResult  # noqa: E402
from pipescope.simulator.units import format_time  # noqa: E402

COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
ODD_CHUNK_COLORS = {"F": "#27406B", "B": "#9A5424", "I": "#7E2A2D", "W": "#2F6B3D"}  # darker: readable at any size
LABELS = {"F": "forward", "B": "backward (I+W)", "I": "input-grad", "W": "weight-grad"}
COLLECTIVE_COLOR = "#8172B3"
LINK_COLOR = "#64666B"
MAX_LABELLED_OPS = 600  # beyond this, microbatch numbers turn into noise
MAX_ROWS = 32  # beyond this many devices, rows are too thin to read: draw replica 0 only
MAX_LINKS = 16


def gantt_figure(result: SimResult, title: str | None = None) -> plt.Figure:
    """The familiar pipeline picture; time in ms on x, device 0 at the top."""
    p = _rows(result)
    frame = result.timeline[result.timeline["device"] < p]
    compute, collective = frame[frame["stream"] == "compute"], frame[frame["stream"] == "collective"]
    links = dict(list(result.link_spans.items())[:MAX_LINKS])
    fig, axes = _axes(p, len(links))
    ax = axes[0]
    drawn = pd.concat([compute, collective])
    origin = drawn["start_ns"].min()
    unit, scale = _time_unit(drawn["end_ns"].max() - origin)
    _draw_compute(ax, result, compute, origin, scale, thin=not collective.empty)
    _draw_collectives(ax, collective, origin, scale)
    ax.set_yticks(range(p), [f"device {d}" for d in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.legend(handles=_legend(result, compute, collective), loc="center left", bbox_to_anchor=(1.0, 0.5),
              frameon=False)
    ax.set_title(_title(result, title, p))
    if links:
        ax.set_xlabel("")
        _draw_links(axes[1], links, origin, scale)
        axes[1].set_xlabel(f"time ({unit})")
    fig.tight_layout()
    return fig


def _rows(result: SimResult) -> int:
    """How many device rows to draw: all of them, or replica 0's when there are too many to read."""
    p = result.records.num_devices
    return result.schedule.num_devices if p > MAX_ROWS and result.data_parallel > 1 else p


def _axes(p: int, links: int) -> tuple[plt.Figure, list[Axes]]:
    """One axes for the devices, and one below it sharing x for the links (rows a little thinner) if any."""
    if not links:
        fig, ax = plt.subplots(figsize=(14, 1.2 + 0.32 * p))
        return fig, [ax]
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(14, 1.6 + 0.32 * p + 0.22 * links),
                             gridspec_kw={"height_ratios": [0.32 * p + 0.6, 0.22 * links + 0.4]})
    return fig, list(axes)


def _draw_compute(ax: Axes, result: SimResult, frame: pd.DataFrame, origin: int, scale: float, thin: bool) -> None:
    """Ops as bars centred on the device's row; ``thin`` leaves the row's bottom to the collectives' bar."""
    label = len(frame) <= MAX_LABELLED_OPS
    # The chunk from the pipeline's own device count: the frame's column divides by every replica's devices.
    frame = frame.assign(x=(frame["start_ns"] - origin) / scale, w=(frame["end_ns"] - frame["start_ns"]) / scale,
                         odd=frame["stage"] // max(1, result.schedule.num_devices) % 2)
    height = 0.68 if thin else 0.8  # thin: ends at y + 0.28, clear of the collectives' bar at y + 0.3
    # One collection per (device, kind, chunk parity): a Rectangle per op takes 20 s at p=32, m=128 with V chunks.
    # Edges separate neighbouring ops when they are wide enough to see; at thousands of ops they only wash out.
    edge = {"edgecolor": "white", "linewidth": 0.3} if label else {"linewidth": 0}
    for (device, kind, odd), group in frame.groupby(["device", "kind", "odd"]):
        color = (ODD_CHUNK_COLORS if odd else COLORS).get(kind, "grey")
        ax.broken_barh(list(zip(group["x"], group["w"])), (device - 0.4, height), facecolors=color, **edge)
    if label:
        for y, x, w, mb in zip(frame["device"], frame["x"], frame["w"], frame["microbatch"]):
            ax.text(x + w / 2, y - 0.4 + height / 2, str(mb), ha="center", va="center", fontsize=6, color="white")


def _draw_collectives(ax: Axes, frame: pd.DataFrame, origin: int, scale: float) -> None:
    """Each device's collectives (all-reduce buckets, often overlapping) as one thin bar under its ops."""
    for device, group in frame.groupby("device"):
        spans = list(zip((group["start_ns"] - origin) / scale, (group["end_ns"] - group["start_ns"]) / scale))
        ax.broken_barh(spans, (device + 0.3, 0.15), facecolors=COLLECTIVE_COLOR, linewidth=0)


def _draw_links(ax: Axes, links: dict[str, list[tuple[int, int]]], origin: int, scale: float) -> None:
    """One row per link, busiest first (the order ``link_spans`` keeps), a bar wherever it carried a flow."""
    for row, spans in enumerate(links.values()):
        bars = [((start - origin) / scale, (end - start) / scale) for start, end in spans]
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=LINK_COLOR, linewidth=0)
    ax.set_yticks(range(len(links)), list(links), fontsize=7)
    ax.set_ylim(len(links) - 0.5, -0.5)  # busiest link at the top, like device 0 above
    ax.set_title("busiest links (busy while carrying a flow)", fontsize=9, loc="left")


def _legend(result: SimResult, compute: pd.DataFrame, collective: pd.DataFrame) -> list[Patch]:
    kinds = [k for k in COLORS if k in set(compute["kind"])]
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in kinds]
    if result.schedule.chunks > 1:
        handles += [Patch(color=ODD_CHUNK_COLORS[k], label=f"{LABELS[k]}, odd chunk") for k in kinds]
    if not collective.empty:
        label = "gradient all-reduce" if set(collective["kind"]) == {"ALL_REDUCE"} else "collectives"
        handles.append(Patch(color=COLLECTIVE_COLOR, label=label))
    return handles


def _time_unit(span_ns: float) -> tuple[str, float]:
    """The axis unit that keeps tick labels short: s, ms or us."""
    for unit, scale in (("s", 1e9), ("ms", 1e6)):
        if span_ns >= 10 * scale:
            return unit, scale
    return "us", 1e3


def _default_title(result: SimResult) -> str:
    s = result.schedule
    replicas = f" x{result.data_parallel} replicas" if result.data_parallel > 1 else ""
    return (f"{s.name}: p={s.num_devices}{replicas} m={s.num_microbatches} v={s.chunks}  "
            f"iteration {format_time(result.iteration_time_s)}, bubble {result.bubble_rate:.1%}")


def _title(result: SimResult, title: str | None, rows: int) -> str:
    """The given or default title; says when only replica 0 is drawn, whoever wrote the rest."""
    text = title or _default_title(result)
    return text if rows == result.records.num_devices else f"{text}  (replica 0 of {result.data_parallel})"


def write_gantt(result: SimResult, path: str, title: str | None = None) -> None:
    """Render the Gantt chart to ``path`` (PNG, SVG or PDF by extension), atomically."""
    fig = gantt_figure(result, title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.rsplit(".", 1)[-1].lower() if "." in path else "png", dpi=150)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def write_overlay_gantt(predicted, measured, path: str, name: str) -> None:
    """Predicted (top) and measured (bottom) compute rows of one iteration on one time axis (``pipescope validate``).

    Both frames have device, kind, start_ns, end_ns; ``measured`` may hold several iterations (the first is drawn).
    """
    if "iteration" in measured:
        measured = measured[measured["iteration"] == measured["iteration"].min()]
    devices = int(max(predicted["device"].max(), measured["device"].max())) + 1
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(14, 1.6 + 0.6 * devices))
    origin = predicted["start_ns"].min()
    span = max(predicted["end_ns"].max() - origin, measured["end_ns"].max())
    unit, scale = _time_unit(span)
    for ax, frame, label, shift in ((axes[0], predicted, "predicted", origin), (axes[1], measured, "measured", 0)):
        for (device, kind), group in frame.groupby(["device", "kind"]):
            bars = list(zip((group["start_ns"] - shift) / scale, (group["end_ns"] - group["start_ns"]) / scale))
            ax.broken_barh(bars, (device - 0.4, 0.8), facecolors=COLORS.get(kind, "grey"), edgecolor="white",
                           linewidth=0.3)
        ax.set_yticks(range(devices), [f"device {d}" for d in range(devices)])
        ax.invert_yaxis()
        ax.set_ylabel(label)
    kinds = [k for k in COLORS if k in set(predicted["kind"]) | set(measured["kind"])]
    axes[0].legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in kinds], loc="center left",
                   bbox_to_anchor=(1.0, 0.0), frameon=False)
    axes[1].set_xlabel(f"time ({unit})")
    axes[0].set_title(f"{name}: predicted (top) and measured (bottom)")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.rsplit(".", 1)[-1].lower() if "." in path else "png", dpi=150)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
