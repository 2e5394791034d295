"""Model shapes the harness can time: the same presets as ``simulator/models.py``, kept here so that
``calibration/`` runs on a GPU box without the simulator's dependencies. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shape:
    """A GPT-style decoder: ``layers`` pre-LN blocks (attention + 4h GELU MLP), embedding, output layer."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int


PRESETS: dict[str, Shape] = {
    "tiny": Shape("tiny", layers=4, hidden=64, heads=4, seq=32, vocab=512),
    "gpt-355m": Shape("gpt-355m", layers=24, hidden=1024, heads=16, seq=1024, vocab=50257),
    "gpt-1.3b": Shape("gpt-1.3b", layers=24, hidden=2048, heads=16, seq=1024, vocab=50257),
    "gpt-2.2b": Shape("gpt-2.2b", layers=28, hidden=2560, heads=20, seq=1024, vocab=50257),
    "gpt-3.8b": Shape("gpt-3.8b", layers=32, hidden=3072, heads=24, seq=1024, vocab=50257),
}

PRECISIONS = ("bf16", "fp16", "fp32")


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
            raise ValueError(f"--model: {preset!r} ...expected one of {', '.join(PRESETS)}")
        shape = replace(PRESETS[preset], **given)
    else:
        missing = [f for f in fields if f not in given]
        if missing:
            raise ValueError(f"--{missing[0]}: missing ...expected --model PRESET or all of --layers/--hidden/"
                             "--heads/--seq/--vocab")
        shape = Shape("custom", **given)
    for name in fields:
        if getattr(shape, name) <= 0:
            raise ValueError(f"--{name}: {getattr(shape, name)} ...expected a positive integer")
    if shape.hidden % shape.heads:
        raise ValueError(f"--heads: {shape.heads} ...expected a divisor of --hidden {shape.hidden}")
    return shape
