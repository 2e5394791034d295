"""Argument checks shared by the schedule generators.

Errors name the config key, the bad value and what is expected, e.g.
``schedule.microbatches: got 3, expected at least schedule.stages (=4) for zb-h2``.
"""

from __future__ import annotations


def check_sizes(name: str, p: int, m: int, min_m: int = 1) -> None:
    """Raise ValueError unless p >= 1 and m >= max(1, min_m).

    Args:
        name: the generator's registry name, quoted in the message.
        p: pipeline devices.
        m: microbatches per iteration.
        min_m: the generator's own lower bound on m (usually p).
    """
    if p < 1:
        raise ValueError(f"schedule.stages: got {p}, expected at least 1 for {name}")
    if m < 1:
        raise ValueError(f"schedule.microbatches: got {m}, expected at least 1 for {name}")
    if m < min_m:
        raise ValueError(f"schedule.microbatches: got {m}, expected at least schedule.stages (={p}) for {name}")


def check_chunks(name: str, chunks: int, allowed: tuple[int, ...]) -> None:
    """Raise ValueError unless ``chunks`` is one of ``allowed``."""
    if chunks not in allowed:
        expected = " or ".join(str(c) for c in allowed)
        raise ValueError(f"schedule.chunks: got {chunks}, expected {expected} for {name}")


def check_two_pipelines(name: str, p: int, chunks: int) -> None:
    """Raise ValueError unless a bidirectional schedule (DualPipe, Chimera) can run: one stage of each of its two
    pipelines per device, and an even number of devices, so that the pipelines meet in the middle."""
    if chunks != 1:
        raise ValueError(f"schedule.chunks: got {chunks}, expected 1 for {name}: each device holds one stage of "
                         f"each of its two pipelines")
    if p < 2 or p % 2:
        raise ValueError(f"schedule.stages: got {p}, expected an even number from 2 for {name}: its two pipelines "
                         f"meet in the middle")


def check_iterations(name: str, iterations: int) -> None:
    """Raise ValueError unless at least one iteration is simulated."""
    if iterations < 1:
        raise ValueError(f"iterations: got {iterations}, expected at least 1 for {name}")


def v_chunks(name: str, chunks: int) -> int:
    """V schedules always hold 2 chunks per device (docs/schedules.md: a V is one stage down, one back up)."""
    check_chunks(name, chunks, (2,))
    return 2
