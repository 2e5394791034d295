"""Interleaved 1F1B (Megatron-LM, torch ScheduleInterleaved1F1B): v looped chunks per device.

Device r holds stages r, r+p, ..., r+(v-1)p. Forwards walk the chunks in rounds of
microbatches: all of a round's microbatches through chunk 0, then chunk 1, ...;
backwards do the same with the chunks reversed. Megatron needs m % p == 0 and torch
needs m % (m // p) == 0; here any m >= p works: the m microbatches are cut into
m // p rounds whose sizes differ by at most one, so every round holds >= p
microbatches (which is what keeps the chunk hand-off from device p-1 to device 0 fed).
With m a multiple of p this is exactly Megatron's order, and with torch's rule it is torch's.
"""

from __future__ import annotations

from pipescope.simulator.ir import ActionKind, Action, Schedule, looped_placement
from pipescope.simulator.schedules.common import check_sizes


def round_sizes(p: int, m: int) -> list[int]:
    """Split m microbatches into max(1, m // p) rounds, larger rounds first."""
    rounds = max(1, m // p)
    base, extra = divmod(m, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]


def chunk_order(p: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in the order one device runs its forwards (or backwards)."""
    order, first = [], 0
    for size in round_sizes(p, m):
        chunks = range(v - 1, -1, -1) if backward else range(v)
        order += [(c, mb) for c in chunks for mb in range(first, first + size)]
        first += size
    return order


def warmup_count(r: int, p: int, m: int, v: int) -> int:
    """Forwards before the first backward on device r: (v-1) * round + 2(p-1-r), as Megatron/torch."""
    return min((v - 1) * round_sizes(p, m)[0] + 2 * (p - 1 - r), v * m)


def device_order(r: int, p: int, m: int, v: int) -> list[Action]:
    """Device r's ops: warm-up forwards, then (F, B) pairs, then the remaining backwards."""
    fwd = [Action(c * p + r, ActionKind.F, mb) for c, mb in chunk_order(p, m, v, backward=False)]
    bwd = [Action(c * p + r, ActionKind.B, mb) for c, mb in chunk_order(p, m, v, backward=True)]
    warmup = warmup_count(r, p, m, v)
    order = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[len(fwd) - warmup:]


def interleaved(p: int, m: int, chunks: int = 2, recompute: bool = False) -> Schedule:
    """Interleaved 1F1B with ``chunks`` (v >= 2) looped stages per device and a flush.

    Args:
        p: pipeline devices.
        m: microbatches per iteration, >= p.
        chunks: stages per device v; the total is v * p stages.
        recompute: recompute activations before each backward.
    """
    check_sizes("interleaved", p, m, min_m=p)
    if chunks < 2:
        raise ValueError(f"schedule.chunks: got {chunks}, expected at least 2 for interleaved; use '1f1b' for one "
                         f"chunk")
    lists = tuple(tuple(device_order(r, p, m, chunks)) for r in range(p))
    return Schedule("interleaved", p, m, looped_placement(p, chunks), lists, recompute=recompute,
                    weight_versions=(1,) * p)
