"""The engine on its own: deadlocks it meets are reported with the stuck ops, links are FIFO per direction."""

import pytest

from simulator.check import ScheduleError
from simulator.costs import Link, UniformCosts
from simulator.engine import Engine, compile_schedule
from simulator.ir import Action, Schedule
from simulator.schedules import build
from simulator.simulate import simulate


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
    from simulator.costs import AnalyticCosts
    from simulator.models import DEVICES, preset
    costs = AnalyticCosts(preset("gpt-355m"), DEVICES["a100"])
    slow = simulate(build("1f1b", 2, 2), costs, lambda a, b: Link(1e9, 10_000))
    fast = simulate(build("1f1b", 2, 2), costs, lambda a, b: Link(1e12, 10_000))
    nbytes = costs.stage_cost(0, 2, 1).boundary_bytes
    frame = slow.timeline[slow.timeline["stream"] != "compute"]
    assert set(frame["end_ns"] - frame["start_ns"]) == {10_000 + nbytes}  # 1 GB/s: one ns per byte
    assert slow.iteration_ns > fast.iteration_ns


def test_transfers_queue_on_a_busy_link() -> None:
    """Two activations produced 1 s apart on a link that needs 3 s each: the second waits for the first."""
    costs = UniformCosts(forward=1.0, backward_input=0.5, backward_weight=0.5, p2p=3.0)
    result = simulate(build("gpipe", 2, 2), costs)
    sends = result.timeline[(result.timeline["stream"] == "send->1")].sort_values("start_ns")
    assert list(sends["start_ns"]) == [1 * 10**9, 4 * 10**9]  # not 2 s: the link was still busy
