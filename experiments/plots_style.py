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
from pipescope.simulator.ir import KINDS, Role  # noqa: E402

# Views of simulator.ir.KINDS, the one table of the kinds' facts, keyed by the enum (a StrEnum: the timeline's kind
# strings look them up as they are), in its order: the order legends list them.
COLORS = {kind: facts.colour for kind, facts in KINDS.items() if facts.role is Role.COMPUTE}
ODD_CHUNK_COLORS = {kind: facts.odd_colour for kind, facts in KINDS.items() if facts.role is Role.COMPUTE}
LABELS = {kind: facts.label for kind, facts in KINDS.items() if facts.role is Role.COMPUTE}
COMM_COLORS = {kind: facts.colour for kind, facts in KINDS.items() if facts.role in (Role.SEND, Role.RECV)}
COMM_LABELS = {kind: facts.label for kind, facts in KINDS.items() if facts.role in (Role.SEND, Role.RECV)}
COLLECTIVE_COLOR = "#8172B3"
LINK_COLOR = "#64666B"
STALL_COLOR = "#8172B3"  # an op waiting for its next unit's gather: hatched in the collectives' colour
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
