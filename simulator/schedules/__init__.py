"""Schedule generators: pure functions ``(p, m, ...) -> Schedule``, found by name."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from simulator.ir import Schedule
from simulator.schedules.basic import gpipe, one_f_one_b


@dataclass(frozen=True)
class Generator:
    """A named generator and what ``pipescope schedules`` says of it."""

    name: str
    build: Callable[..., Schedule]
    description: str
    min_chunks: int = 1
    max_chunks: int | None = 1


GENERATORS: dict[str, Generator] = {}
ALIASES = {"flush": "1f1b", "pipedream-flush": "1f1b"}


def register(gen: Generator) -> None:
    GENERATORS[gen.name] = gen


register(Generator("gpipe", gpipe, "GPipe: all forwards, then all backwards, one flush per iteration"))
register(Generator("1f1b", one_f_one_b,
                   "PipeDream-Flush (= Megatron/torch 1F1B, alias 'flush'): warm-up forwards, 1F1B pairs, flush"))


def generator(name: str) -> Generator:
    """The generator called ``name`` (aliases allowed); KeyError if none."""
    return GENERATORS[ALIASES.get(name, name)]


def build(name: str, stages: int, microbatches: int, chunks: int = 1, recompute: bool = False,
          **options: object) -> Schedule:
    """Build the named schedule for ``stages`` devices and ``microbatches`` per iteration."""
    return generator(name).build(stages, microbatches, chunks=chunks, recompute=recompute, **options)
