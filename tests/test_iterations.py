"""Schedules without a flush run over several iterations: steady state and fill/drain are reported apart."""

import json

import pytest

from pipescope.experiments.cli import main
from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate


@pytest.mark.parametrize("name", ["pipedream", "2bw"])
def test_steady_state_has_no_bubble(name: str) -> None:
    """p=4, m=8, 4 iterations, F=1 B=2: steady iteration m(F+B) = 24 s, fill + drain (p-1)(F+B) = 9 s."""
    p, m, iterations = 4, 8, 4
    result = simulate(build(name, p, m, iterations=iterations), UniformCosts(1.0, 1.0, 1.0))
    assert result.iteration_ns == m * 3 * 10**9
    assert result.fill_drain_ns == (p - 1) * 3 * 10**9
    assert result.makespan_ns == ((iterations * m) + p - 1) * 3 * 10**9


def test_iterations_key_reaches_the_generator(capsys) -> None:
    """--set iterations=5 spans five iterations; on a flush schedule it is a usage error naming the key."""
    args = ["simulate", "--json", "--schedule", "2bw", "--set", "iterations=5", "--set", "costs.kind=uniform"]
    assert main(args) == 0
    assert '"iterations": 5' in capsys.readouterr().out
    assert main(["simulate", "--schedule", "1f1b", "--set", "iterations=5"]) == 2
    assert "iterations: got 5" in capsys.readouterr().err


def test_vertical_sync_option(capsys) -> None:
    """schedule.vertical_sync makes PipeDream hold p versions everywhere; other schedules reject it."""
    args = ["simulate", "--json", "--schedule", "pipedream", "--stages", "4", "--set", "schedule.vertical_sync=true"]
    assert main(args) == 0
    plain = ["simulate", "--json", "--schedule", "pipedream", "--stages", "4"]
    synced_static = [d["static_memory_bytes"] for d in json.loads(capsys.readouterr().out)["per_device"]]
    assert main(plain) == 0
    plain_static = [d["static_memory_bytes"] for d in json.loads(capsys.readouterr().out)["per_device"]]
    assert synced_static[0] == plain_static[0] and synced_static[3] > plain_static[3]
    assert main(["simulate", "--schedule", "gpipe", "--set", "schedule.vertical_sync=true"]) == 2
    assert "schedule.vertical_sync: got true, but only pipedream has it" in capsys.readouterr().err


def test_a_shared_nic_holds_the_steady_state_to_its_busiest_links_floor() -> None:
    """The 2BW paper's 8-deep GPT 2.2B plan on 8 p3.16xlarge: 8 replicas share each server's one 25 Gbit/s NIC. Its
    3 iterations alone gave 211.29 samples/s; the busiest link's bytes over its rate per iteration hold it to what
    the makespan's growth over 10 iterations measures (201.2), and the result says which link."""
    import pipescope

    def run(*sets: str):
        return pipescope.run(pipescope.load_config("p3.16xlarge-x8-gpt-2.2b-2bw-planner", list(sets)))

    three = run()
    busiest = max(link["bytes"] / link["bandwidth_Bps"] for link in three.links)  # seconds over the run
    assert three.iteration_time_s == pytest.approx(busiest / 3, abs=1e-9)
    assert three.throughput_samples_per_s == pytest.approx(201.19, abs=0.01)
    assert any(w.startswith("the iteration is held by its busiest link: leaf0 > n0.nic0") for w in three.warnings)
    six, ten = run("iterations=6"), run("iterations=10")
    growth_s = (ten.makespan_ns - six.makespan_ns) / 4 / 1e9
    assert three.iteration_time_s == pytest.approx(growth_s, rel=1e-3)
    assert not any("busiest link" in w for w in run("schedule.name=gpipe").warnings)  # a flush: its one iteration
