"""Per-action times of a simulated result, keyed by Action, for tests that check closed forms op by op."""

from __future__ import annotations

from dataclasses import dataclass

from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.ir import Action, Role, Schedule
from pipescope.simulator.network import FifoLinks
from pipescope.simulator.result import SimResult
from pipescope.simulator.simulate import simulate


@dataclass(frozen=True)
class Times:
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
        """1 - sum(busy) / (D * max span), docs/schedules.md section 0."""
        return 1.0 - sum(self.busy) / (len(self.busy) * max(self.span))


def op_times(result: SimResult) -> Times:
    rec = result.records
    rows = [(a, int(s), int(e)) for a, s, e, c in zip(rec.actions, rec.start, rec.end, rec.mask(Role.COMPUTE)) if c]
    return Times({a: s for a, s, _ in rows}, {a: e for a, _, e in rows},
                 [round(d.busy_s * 1e9) for d in result.devices], [round(d.span_s * 1e9) for d in result.devices])


def uniform_times(schedule: Schedule, f_ns: int, i_ns: int, w_ns: int, p2p_ns: int = 0) -> Times:
    """The engine's times under uniform F, I, W per whole device-stage (a chunk op takes its share)."""
    costs = UniformCosts(forward=f_ns / 1e9, backward_input=i_ns / 1e9, backward_weight=w_ns / 1e9)
    return op_times(simulate(schedule, costs, FifoLinks.fixed_delay(p2p_ns)))
