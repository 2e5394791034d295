"""Model shapes the harness can time: the presets of ``simulator/models.py`` (stdlib-only plain data, the one
place presets are defined, so the analytic model and the harness never disagree). Standard library only."""

from __future__ import annotations

from dataclasses import replace

from pipescope.simulator.models import PRECISIONS, PRESETS
from pipescope.simulator.models import ModelSpec as Shape

__all__ = ["PRECISIONS", "PRESETS", "Shape", "resolve"]  # PRECISIONS: the simulator's table, one for both


def resolve(preset: str | None, **overrides: int | None) -> Shape:
    """A preset with some fields replaced, or a custom shape from all five fields.

    Raises:
        ValueError: unknown preset, a missing field of a custom shape, a non-positive field, or heads not
            dividing hidden; the message names the key, the value and what was expected.
    """
    fields = ("layers", "hidden", "heads", "seq", "vocab")
    given = {k: v for k, v in overrides.items() if v is not None}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"--model: {preset!r}, expected one of {', '.join(PRESETS)}")
        shape = replace(PRESETS[preset], **given)
    else:
        missing = [f for f in fields if f not in given]
        if missing:
            raise ValueError(f"--{missing[0]}: missing, expected --model PRESET or all of --layers/--hidden/"
                             "--heads/--seq/--vocab")
        shape = Shape("custom", **given)
    for name in fields:
        if getattr(shape, name) <= 0:
            raise ValueError(f"--{name}: {getattr(shape, name)}, expected a positive integer")
    if shape.hidden % shape.heads:
        raise ValueError(f"--heads: {shape.heads}, expected a divisor of --hidden {shape.hidden}")
    return shape
