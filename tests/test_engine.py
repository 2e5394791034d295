"""The engine on its own: deadlocks it meets are reported with the stuck ops, links are FIFO per direction."""

from dataclasses import dataclass

import pytest

from pipescope.simulator.check import ScheduleError
from pipescope.simulator.costs import Link, UniformCosts
from pipescope.simulator.engine import Engine, compile_schedule
from pipescope.simulator.ir import Action, Schedule
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate


def test_engine_reports_deadlock_with_stuck_ops() -> None:
    """Bypassing the checker, a cyclic wait ends the run with both devices' stuck ops named, not a hang."""
    lists = ((Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)),
             (Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)))
    schedule = Schedule("crafted", 2, 2, (0, 1), lists)
    compiled = compile_schedule(schedule, UniformCosts(), lambda a, b: Link(1e9, 0))
    with pytest.raises(ScheduleError) as err:
        Engine(compiled).run()
    assert "device 0 op 1: 0B0 waits for 1B0 (transfer)" in str(err.value)
    assert "device 1 op 0: 1F1 waits for 0F1 (transfer)" in str(err.value)


def test_link_bandwidth_and_latency_set_transfer_time() -> None:
    """Analytic transfers take latency + bytes / bandwidth of the path the cluster gives."""
    from pipescope.simulator.costs import AnalyticCosts
    from pipescope.simulator.models import DEVICES, preset
    costs = AnalyticCosts(preset("gpt-355m"), DEVICES["a100"])
    slow = simulate(build("1f1b", 2, 2), costs, lambda a, b: Link(1e9, 10_000))
    fast = simulate(build("1f1b", 2, 2), costs, lambda a, b: Link(1e12, 10_000))
    nbytes = costs.stage_cost(0, 2, 1).boundary_bytes
    frame = slow.timeline[slow.timeline["stream"] != "compute"]
    assert set(frame["end_ns"] - frame["start_ns"]) == {10_000 + nbytes}  # 1 GB/s: one ns per byte
    assert slow.iteration_ns > fast.iteration_ns


@dataclass(frozen=True)
class SerialLinks(UniformCosts):
    """Uniform op times, but each transfer holds its link for all of its p2p time (no latency part)."""

    def occupancy_ns(self, nbytes: int, link: Link) -> int:
        return self.transfer_ns(nbytes, link)


def test_transfers_queue_on_a_busy_link() -> None:
    """Two activations produced 1 s apart on a link that needs 3 s each: the second waits for the first."""
    costs = SerialLinks(forward=1.0, backward_input=0.5, backward_weight=0.5, p2p=3.0)
    result = simulate(build("gpipe", 2, 2), costs)
    sends = result.timeline[(result.timeline["stream"] == "send->1")].sort_values("start_ns")
    assert list(sends["start_ns"]) == [1 * 10**9, 4 * 10**9]  # not 2 s: the link was still busy
    assert list(sends["end_ns"]) == [4 * 10**9, 7 * 10**9]


def test_latency_overlaps_on_a_link() -> None:
    """Analytic transfers hold the link for bytes/bandwidth only; latency of one overlaps the next."""
    from pipescope.simulator.costs import AnalyticCosts
    from pipescope.simulator.models import DEVICES, preset
    costs = AnalyticCosts(preset("gpt-355m"), DEVICES["a100"])
    link = Link(1e15, 10**9)  # a huge latency, negligible serialisation
    result = simulate(build("gpipe", 2, 3), costs, lambda a, b: link)
    sends = result.timeline[(result.timeline["stream"] == "send->1")].sort_values("start_ns")
    produced = result.timeline[(result.timeline["action"].isin(["0F0", "0F1", "0F2"]))].sort_values("end_ns")
    assert list(sends["start_ns"]) == list(produced["end_ns"])  # no transfer waited for the one before


def test_uniform_p2p_longer_than_ops_is_a_pure_delay() -> None:
    """Uniform p2p (2 s, twice an op) adds to each hop without queueing: equal to the plain timing model."""
    from pipescope.simulator.reference import list_schedule, uniform_duration
    schedule = build("gpipe", 4, 8)
    result = simulate(schedule, UniformCosts(forward=1.0, backward_input=0.5, backward_weight=0.5, p2p=2.0))
    reference = list_schedule(schedule, uniform_duration(10**9, 5 * 10**8, 5 * 10**8), 2 * 10**9)
    assert result.iteration_ns == reference.iteration_ns == (11 * 2 + 2 * 3 * 2) * 10**9
