"""CPU ranks sharing a host's cores (``cluster.host_cores``, simulator/host_cores.py): processor sharing."""

from __future__ import annotations

import pytest

from pipescope.config import ConfigError, load_config
from pipescope.runner import run
from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate

COSTS = UniformCosts(forward=1e-3, backward_input=1e-3, backward_weight=2e-3)  # F 1 ms, B = I + W 3 ms


def _records(result) -> list[tuple[int, int, int]]:
    t = result.timeline
    return list(zip(t["device"], t["start_ns"], t["end_ns"]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_as_many_cores_as_ranks_replays_exactly_as_without(name: str) -> None:
    schedule = build(name, 4, 8)
    alone = simulate(schedule, COSTS)
    for cores in (4, 64):
        assert _records(simulate(schedule, COSTS, host_cores=cores)) == _records(alone)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_one_core_runs_all_the_work_back_to_back(name: str) -> None:
    """One core: some op always runs (a device waits only for another's op, which then has the core), so the
    iteration is all the devices' work, and every device's busy time spans that work as others share the core."""
    schedule = build(name, 4, 8)
    work_ns = 4 * 8 * (1 + 1 + 2) * 10**6
    result = simulate(schedule, COSTS, host_cores=1)
    assert result.makespan_ns == work_ns
    assert simulate(schedule, COSTS).makespan_ns < work_ns / 2


def test_two_cores_for_four_ranks_two_ops_at_full_speed_four_at_half() -> None:
    """GPipe p = 4 on 2 cores: the first forwards run alone at full speed; the iteration lies between the work
    over 2 cores and the work on 1."""
    schedule = build("gpipe", 4, 8)
    result = simulate(schedule, COSTS, host_cores=2)
    forwards = [(s, e) for d, s, e in _records(result) if d == 0][:1]
    assert forwards == [(0, 10**6)]  # device 0's first F: nothing else runs yet
    work_ns = 4 * 8 * 4 * 10**6
    assert work_ns // 2 <= result.makespan_ns < work_ns
    assert result.makespan_ns > simulate(schedule, COSTS).makespan_ns


def test_host_cores_key_is_checked_in_one_line() -> None:
    base = ["schedule.stages=2", "costs.kind=uniform"]
    assert run(load_config(None, [*base, "cluster.host_cores=1"])).iteration_time_s > \
        run(load_config(None, base)).iteration_time_s
    with pytest.raises(ConfigError, match=r"^cluster.host_cores: .*0.*expected"):
        load_config(None, [*base, "cluster.host_cores=0"])
    with pytest.raises(ConfigError, match=r"^cluster.host_cores: got 2 with cluster.nodes 2; expected cluster.nodes 1"):
        run(load_config(None, [*base, "cluster.host_cores=2", "cluster.nodes=2"]))
