"""One colour and one marker per schedule, in every figure that compares schedules (``plot bubble``,
``plot throughput``, ``plot vocab``, the notebooks), so that 1F1B is the same orange everywhere (docs/plots.md).

The colours are Okabe and Ito's colour-blind-safe set where it reaches (its yellow, too faint for a line on white,
left out), then Tableau's brown, purple, olive, cyan and red, in the order the schedules were invented; V-Half's
purple is apart from 1F1B's orange, which the vocabulary figure sets side by side. A name that is no generator's
(``torch:...``, ``csv:...``) gets grey.
"""

from __future__ import annotations

SCHEDULE_COLORS = {
    "gpipe": "#0072B2", "1f1b": "#E69F00", "pipedream": "#999999", "2bw": "#8C564B", "interleaved": "#009E73",
    "zb-h1": "#D55E00", "zb-h2": "#CC79A7", "zb-v": "#56B4E9", "v-half": "#9467BD", "v-min": "#000000",
    "dualpipev": "#BCBD22", "dualpipe": "#17BECF", "chimera": "#D62728",
}
SCHEDULE_MARKERS = {"gpipe": "o", "1f1b": "s", "pipedream": "x", "2bw": "P", "interleaved": "^", "zb-h1": "D",
                    "zb-h2": "v", "zb-v": "<", "v-half": ">", "v-min": "*", "dualpipev": "p",
                    "dualpipe": "d", "chimera": "H"}
OTHER_COLOR, OTHER_MARKER = "#7F7F7F", "h"


def canonical(name: str) -> str:
    """The generator's own name for ``name`` (an alias such as ``flush`` is ``1f1b``); else ``name``."""
    from pipescope.simulator.schedules import generator

    try:
        return generator(str(name)).name
    except KeyError:
        return str(name)


def schedule_color(name: str) -> str:
    return SCHEDULE_COLORS.get(canonical(name), OTHER_COLOR)


def schedule_marker(name: str) -> str:
    return SCHEDULE_MARKERS.get(canonical(name), OTHER_MARKER)
