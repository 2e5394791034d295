"""Model shapes the harness can time: the presets of ``simulator/models.py`` (stdlib-only plain data, the one
place presets are defined, so the analytic model and the harness never disagree). Standard library only."""

from __future__ import annotations

from dataclasses import replace

from pipescope.simulator.models import PRECISIONS, PRESETS
from pipescope.simulator.models import ModelSpec as Shape

# PRECISIONS: the simulator's table, one for both.
__all__ = ["HARNESS_PRESETS", "PRECISIONS", "PRESETS", "Shape", "harness_bytes", "resolve"]
# The harness builds GPT blocks (calibration/model.py): the GPT presets are the ones it can time
HARNESS_PRESETS = {name: shape for name, shape in PRESETS.items() if shape.family == "gpt"}


def check_harness_model(preset: str) -> None:
    """ValueError naming ``--model`` unless the harness can build ``preset``."""
    if preset in HARNESS_PRESETS:
        return
    why = f" (a {PRESETS[preset].family} model; the harness builds GPT blocks only)" if preset in PRESETS else ""
    raise ValueError(f"--model: got {preset!r}{why}, expected one of {', '.join(HARNESS_PRESETS)}")


def resolve(preset: str | None, **overrides: int | None) -> Shape:
    """A preset with some fields replaced, or a custom shape from all five fields.

    Raises:
        ValueError: unknown preset, a missing field of a custom shape, a non-positive field, or heads not
            dividing hidden; the message names the key, the value and what was expected.
    """
    fields = ("layers", "hidden", "heads", "seq", "vocab")
    given = {k: v for k, v in overrides.items() if v is not None}
    if preset is not None:
        check_harness_model(preset)
        shape = replace(PRESETS[preset], **given)
    else:
        missing = [f for f in fields if f not in given]
        if missing:
            raise ValueError(f"--{missing[0]}: missing, expected --model PRESET or all of --layers/--hidden/"
                             "--heads/--seq/--vocab")
        shape = Shape("custom", **given)
    for name in fields:
        if getattr(shape, name) <= 0:
            raise ValueError(f"--{name}: got {getattr(shape, name)}, expected a positive integer")
    if shape.hidden % shape.heads:
        raise ValueError(f"--heads: got {shape.heads}, expected a divisor of --hidden {shape.hidden}")
    return shape


def harness_bytes(shape: Shape, microbatch: int, seq: int, precision: str) -> dict[str, int]:
    """A lower bound of the bytes ``calibrate`` holds for ``shape`` at its largest point, keyed by the flag that
    drives each part: the timed blocks' parameters (``--hidden``) and the embedding's and output projection's
    (``--vocab``), each with its gradient and, in the optimizer step over all of them, an fp32 master copy, its
    gradient and AdamW's two moments (16 bytes); and the output layer's logits (``--microbatch-sizes``, times seq
    and vocab). Activations come on top; the bound only has to catch shapes that cannot fit.
    """
    size = PRECISIONS[precision].activation_bytes
    per_param = 2 * size + 16
    h, blocks = shape.hidden, min(shape.layers, 2)  # calibrate instantiates at most two blocks
    return {"--hidden": blocks * (12 * h * h + 13 * h) * per_param,
            "--vocab": (2 * shape.vocab + seq) * h * per_param,
            "--microbatch-sizes": microbatch * seq * shape.vocab * size}
