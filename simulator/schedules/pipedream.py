"""Schedules without a flush: PipeDream (weight stashing) and PipeDream-2BW.

Both run the 1F1B order over ``iterations * m`` consecutive microbatches, so the
pipeline fills once and drains once per run (docs/schedules.md sections 2 and 3).
"""

from __future__ import annotations

from pipescope.simulator.ir import Action, Schedule, WeightUpdate, looped_placement
from pipescope.simulator.schedules.basic import one_f_one_b_order
from pipescope.simulator.schedules.common import check_chunks, check_iterations, check_sizes

DEFAULT_ITERATIONS = 3


def _continuous_1f1b(p: int, total: int) -> tuple[tuple[Action, ...], ...]:
    """1F1B over ``total`` microbatches on every device, with no flush between iterations."""
    return tuple(tuple(one_f_one_b_order(r, p, total)) for r in range(p))


def pipedream_versions(p: int, vertical_sync: bool) -> tuple[int, ...]:
    """Weight versions device r must hold in PipeDream's steady state.

    Without vertical sync every microbatch uses the newest weights at its forward,
    so stage r holds one version per in-flight microbatch: p - r. With vertical sync
    a microbatch uses stage 0's version number on every stage; stage r must keep all
    versions from its oldest in-flight one to its newest (the forwards still to come
    need the ones in between), which is p on every stage.
    """
    return tuple(p if vertical_sync else p - r for r in range(p))


def pipedream(p: int, m: int, chunks: int = 1, recompute: bool = False, iterations: int = DEFAULT_ITERATIONS,
              vertical_sync: bool = False) -> Schedule:
    """PipeDream: asynchronous 1F1B with weight stashing, one update per backward.

    Args:
        p: pipeline devices (one stage each).
        m: microbatches per iteration (only groups the run; every backward updates its stage).
        chunks: must be 1.
        recompute: recompute activations before each backward.
        iterations: consecutive iterations simulated (microbatches 0 .. iterations*m - 1).
        vertical_sync: every stage uses the weight version stage 0 used (changes only the versions held).
    """
    check_sizes("pipedream", p, m)
    check_chunks("pipedream", chunks, (1,))
    check_iterations("pipedream", iterations)
    return Schedule("pipedream", p, m, looped_placement(p, 1), _continuous_1f1b(p, iterations * m),
                    weight_update=WeightUpdate.ASYNC_STASH, iterations=iterations, recompute=recompute,
                    weight_versions=pipedream_versions(p, vertical_sync))


def two_bw(p: int, m: int, chunks: int = 1, recompute: bool = False,
           iterations: int = DEFAULT_ITERATIONS) -> Schedule:
    """PipeDream-2BW: 1F1B without a flush, m gradients coalesced per update, 2 weight versions.

    m >= p keeps the 1F1B window inside two consecutive iterations, which is what
    bounds the versions at 2 (the paper's requirement m >= d).
    """
    check_sizes("2bw", p, m, min_m=p)
    check_chunks("2bw", chunks, (1,))
    check_iterations("2bw", iterations)
    return Schedule("2bw", p, m, looped_placement(p, 1), _continuous_1f1b(p, iterations * m),
                    weight_update=WeightUpdate.TWO_BW, iterations=iterations, recompute=recompute,
                    weight_versions=(2,) * p)
