"""What every pipescope figure shares: the colour of each action kind, the time unit of an axis, and writing a
figure to a file (PNG, SVG or PDF, atomically)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display: figures only go to files (and notebooks, which pick their own backend)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pipescope.experiments.figure_formats import format_of  # noqa: E402
from pipescope.simulator.readers.files import write_atomic  # noqa: E402
from pipescope.simulator.ir import ActionKind as K  # noqa: E402

# One table per fact, keyed by the enum (a StrEnum: the timeline's kind strings look them up as they are).
# The optimizer step is pink: brown sat beside the odd chunk's dark orange backward and read as the same colour.
COLORS = {K.F: "#4C72B0", K.B: "#DD8452", K.I: "#C44E52", K.W: "#55A868", K.OPT: "#E377C2",
          K.S: "#CCB974", K.T: "#64B5CD"}
ODD_CHUNK_COLORS = {K.F: "#27406B", K.B: "#9A5424", K.I: "#7E2A2D", K.W: "#2F6B3D",  # darker: readable at any size
                    K.OPT: "#9C3D86", K.S: "#8A7B3E", K.T: "#2E7A90"}
LABELS = {K.F: "forward", K.B: "backward (I+W)", K.I: "input-grad", K.W: "weight-grad", K.OPT: "optimizer step",
          K.S: "vocabulary S pass", K.T: "vocabulary T pass"}
# Transfers by what they carry: activations go down the pipeline, gradients come back up.
COMM_COLORS = {K.SEND_F: "#8DB0D9", K.RECV_F: "#8DB0D9", K.SEND_B: "#E8A3A5", K.RECV_B: "#E8A3A5"}
COMM_LABELS = {K.SEND_F: "activation transfer", K.RECV_F: "activation transfer", K.SEND_B: "gradient transfer",
               K.RECV_B: "gradient transfer"}
COLLECTIVE_COLOR = "#8172B3"
LINK_COLOR = "#64666B"
UNKNOWN_COLOR = "grey"  # a kind this version does not know (a newer file): drawn, not refused
DPI = 150


def plain(text: str) -> str:
    """Text drawn as it is: matplotlib reads ``$...$`` as TeX math, and a file's or a user's ``$`` must not be."""
    return str(text).replace("$", r"\$")


def time_unit(span_ns: float) -> tuple[str, float]:
    """The axis unit that keeps tick labels short (s, ms or us) and the ns in one of it."""
    for unit, scale in (("s", 1e9), ("ms", 1e6)):
        if span_ns >= 10 * scale:
            return unit, scale
    return "us", 1e3


def byte_unit(peak_bytes: float) -> tuple[str, int]:
    """The axis unit (GiB, MiB or KiB) in which ``peak_bytes`` reads as at least 1: a 2.6 MiB run is not 0.0025 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if peak_bytes >= scale:
            return unit, scale
    return "KiB", 2**10


def figure_bytes(fig: Figure, fmt: str) -> bytes:
    """The figure rendered as PNG, SVG or PDF. The figure stays open."""
    buffer = io.BytesIO()
    # PDF and SVG embed the date unless told not to; without it the same figure gives the same bytes.
    metadata = {"Date": None} if fmt in ("svg", "pdf") else None
    # "tight": a legend placed beside the axes (every figure's) is kept whole, not cut at the figure's edge
    fig.savefig(buffer, format=fmt, dpi=DPI, metadata=metadata, bbox_inches="tight", pad_inches=0.1)
    return buffer.getvalue()


def save_figure(fig: Figure, path: str, fmt: str | None = None) -> None:
    """Write the figure to ``path`` atomically (.png, .svg or .pdf; ``fmt``, when given, must agree) and close it."""
    try:
        data = figure_bytes(fig, format_of(path, fmt))
    finally:
        plt.close(fig)
    write_atomic(path, data)
