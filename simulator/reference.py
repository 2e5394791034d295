"""The plain timing model of SCHEDULES.md section 0 as a heapq list scheduler.

No SimPy, no links, no streams: an op starts at max(end of the previous op on its device,
end of each cross-device producer + p2p time). It is the oracle the engine must reproduce
under uniform costs, and the speed floor ``pipescope bench`` compares the engine with.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from collections.abc import Callable

from pipescope.simulator.check import ScheduleError
from pipescope.simulator.ir import Action, Schedule, producers


@dataclass(frozen=True)
class ReferenceTimes:
    """Start and end (ns) of every compute op, and per-device busy time and span."""

    start: dict[Action, int]
    end: dict[Action, int]
    busy: list[int]
    span: list[int]

    @property
    def iteration_ns(self) -> int:
        return max(self.end.values()) - min(self.start.values())

    @property
    def bubble_rate(self) -> float:
        """1 - sum(busy) / (D * max span), SCHEDULES.md section 0."""
        return 1.0 - sum(self.busy) / (len(self.busy) * max(self.span))


def list_schedule(schedule: Schedule, duration: Callable[[Action], int], p2p_ns: int) -> ReferenceTimes:
    """Time every op of ``schedule`` with the section-0 model.

    Args:
        schedule: the schedule to replay.
        duration: ns of one compute op.
        p2p_ns: added to a producer's end when it ran on another device.
    """
    lists = [schedule.compute_actions(d) for d in range(schedule.num_devices)]
    present = frozenset(a for acts in lists for a in acts)
    home = schedule.stage_to_device
    waiting_on: dict[Action, list[int]] = {}
    end: dict[Action, int] = {}
    start: dict[Action, int] = {}
    cursor = [0] * len(lists)
    free_at = [0] * len(lists)
    ready: list[tuple[int, int]] = []  # (earliest start, device)

    def try_ready(d: int) -> None:
        if cursor[d] >= len(lists[d]):
            return
        action = lists[d][cursor[d]]
        t = free_at[d]
        for dep in producers(action, schedule.num_stages, present):
            if dep not in end:
                waiting_on.setdefault(dep, []).append(d)
                return
            t = max(t, end[dep] + (p2p_ns if home[dep.stage] != d else 0))
        heapq.heappush(ready, (t, d))

    for d in range(len(lists)):
        try_ready(d)
    while ready:
        t, d = heapq.heappop(ready)
        action = lists[d][cursor[d]]
        start[action], end[action] = t, t + duration(action)
        free_at[d] = end[action]
        cursor[d] += 1
        try_ready(d)
        for waiter in waiting_on.pop(action, ()):
            try_ready(waiter)
    if len(end) != len(present):
        stuck = [f"device {d} op {c}: {lists[d][c]}" for d, c in enumerate(cursor) if c < len(lists[d])]
        raise ScheduleError(["deadlock: " + line for line in stuck])
    busy = [sum(end[a] - start[a] for a in acts) for acts in lists]
    span = [end[acts[-1]] - start[acts[0]] if acts else 0 for acts in lists]
    return ReferenceTimes(start, end, busy, span)


def uniform_duration(forward: int, input_grad: int, weight_grad: int, chunks: int = 1) -> Callable[[Action], int]:
    """Durations per whole device-stage, each chunk op taking 1/chunks; B = I + W."""
    table = {"F": forward, "I": input_grad, "W": weight_grad, "B": input_grad + weight_grad}
    return lambda action: table[action.kind] // chunks
