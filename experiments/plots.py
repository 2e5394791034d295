"""pipescope's figures, in one place to import them from (docs/plots.md).

Each ``*_figure`` function returns a matplotlib ``Figure`` (a notebook shows it; ``save_figure`` writes it):
- ``gantt_figure(result, mode=, comm_lanes=, memory=)``: the pipeline picture (``plots_gantt``);
- ``memory_figure(result)``: bytes in use per device over time;
- ``bubble_figure(frame)``, ``throughput_figure(frame)``: a sweep's table, a line per schedule;
- ``vocab_figure(frame)``: MFU and memory against the vocabulary, a line per schedule and ``schedule.vocab``;
- ``validate_figure(report)``, ``overlay_figure(predicted, measured, name)``: predicted against measured.

``result`` is what ``pipescope.run`` returns, or a ``RunData`` read from a trace or timeline file
(``plots_inputs``). ``write_gantt`` and ``write_overlay_gantt`` are what ``simulate --gantt`` and
``validate --gantt`` write.
"""

from __future__ import annotations

import pandas as pd

from pipescope.experiments.plots_charts import (bubble_figure, memory_figure, overlay_figure, throughput_figure,
                                                validate_figure)
from pipescope.experiments.plots_data import RunData, run_data
from pipescope.experiments.plots_gantt import gantt_figure
from pipescope.experiments.plots_style import COLORS, LABELS, ODD_CHUNK_COLORS, save_figure
from pipescope.experiments.plots_vocab import vocab_figure
from pipescope.simulator.result import SimResult

__all__ = ["COLORS", "LABELS", "ODD_CHUNK_COLORS", "RunData", "bubble_figure", "gantt_figure", "memory_figure",
           "overlay_figure", "run_data", "save_figure", "throughput_figure", "validate_figure", "vocab_figure",
           "write_gantt", "write_overlay_gantt"]


def write_gantt(result: SimResult, path: str, title: str | None = None) -> None:
    """Render the Gantt chart to ``path`` (PNG, SVG or PDF by extension), atomically."""
    save_figure(gantt_figure(result, title), path)


def write_overlay_gantt(predicted: pd.DataFrame, measured: pd.DataFrame, path: str, name: str) -> None:
    """``pipescope validate --gantt``: predicted above measured compute rows of one iteration (``overlay_figure``)."""
    save_figure(overlay_figure(predicted, measured, name), path)
