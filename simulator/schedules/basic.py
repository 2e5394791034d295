"""GPipe and PipeDream-Flush (1F1B with a flush): one stage per device."""

from __future__ import annotations

from pipescope.simulator.ir import ActionKind, Action, Schedule, looped_placement
from pipescope.simulator.schedules.common import check_chunks, check_sizes


def gpipe(p: int, m: int, chunks: int = 1, recompute: bool = False) -> Schedule:
    """Device r: F(0..m-1), then B(0..m-1); gradients accumulate; one synchronous step."""
    check_sizes("gpipe", p, m)
    check_chunks("gpipe", chunks, (1,))
    lists = tuple(tuple([Action(r, ActionKind.F, k) for k in range(m)] + [Action(r, ActionKind.B, k) for k in range(m)])
                  for r in range(p))
    return Schedule("gpipe", p, m, looped_placement(p, 1), lists, recompute=recompute)


def one_f_one_b_order(r: int, p: int, m: int, backward: ActionKind = ActionKind.B) -> list[Action]:
    """Device r's 1F1B order: min(p-1-r, m) warm-up F's, (F, B) pairs, remaining B's."""
    warmup = min(p - 1 - r, m)
    order = [Action(r, ActionKind.F, k) for k in range(warmup)]
    for k in range(m - warmup):
        order += [Action(r, ActionKind.F, warmup + k), Action(r, backward, k)]
    order += [Action(r, backward, k) for k in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int, chunks: int = 1, recompute: bool = False) -> Schedule:
    """PipeDream-Flush: Megatron's non-interleaved 1F1B and torch's Schedule1F1B."""
    check_sizes("1f1b", p, m)
    check_chunks("1f1b", chunks, (1,))
    lists = tuple(tuple(one_f_one_b_order(r, p, m)) for r in range(p))
    return Schedule("1f1b", p, m, looped_placement(p, 1), lists, recompute=recompute)
