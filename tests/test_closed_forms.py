"""GPipe and PipeDream-Flush under uniform costs against their closed forms (docs/schedules.md sections 0, 1, 4)."""

import pytest

from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.engine import Engine
from pipescope.simulator.lowering import lower
from pipescope.simulator.network import FifoLinks
from pipescope.simulator.oracle import Oracle
from pipescope.simulator.program import compile_program, op_durations
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), GRID)
def test_bubble_rate_and_iteration_time(name: str, p: int, m: int) -> None:
    """bubble_rate = (p-1)/(m+p-1) to 1e-9 and iteration = (m+p-1)(F+B) when p2p is free."""
    f, b = 1.0, 2.0
    result = simulate(build(name, p, m), UniformCosts(forward=f, backward_input=1.0, backward_weight=1.0))
    assert result.bubble_rate == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert result.iteration_ns == round((m + p - 1) * (f + b) * 1e9)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_activations(p: int, m: int) -> None:
    """GPipe stashes all m microbatches on every device; Flush min(p-r, m) on device r."""
    costs = UniformCosts()
    gpipe = simulate(build("gpipe", p, m), costs)
    flush = simulate(build("1f1b", p, m), costs)
    assert [d.peak_activations for d in gpipe.devices] == [m] * p
    assert [d.peak_activations for d in flush.devices] == [min(p - r, m) for r in range(p)]


def test_gpipe_p2p_time_adds_2_p_minus_1_hops() -> None:
    """GPipe with a p2p time c: the critical path crosses 2(p-1) links: (m+p-1)(F+B) + 2(p-1)c.

    (1F1B has no such simple form: its steady state waits a round trip per microbatch; it is
    checked against the plain timing model below instead.)
    """
    p, m = 4, 8
    costs = UniformCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
    result = simulate(build("gpipe", p, m), costs, FifoLinks.fixed_delay(250_000_000))
    assert result.iteration_ns == round(((m + p - 1) * 3.0 + 2 * (p - 1) * 0.25) * 1e9)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h2", "v-half"])
@pytest.mark.parametrize(("p", "m"), [(2, 5), (4, 8), (5, 5), (8, 16)])
def test_engine_equals_the_test_oracle(name: str, p: int, m: int) -> None:
    """Every action starts and ends where the heapq oracle puts it, over FIFO links with occupancy (F != I != W)."""
    schedule = build(name, p, m)
    costs = UniformCosts(forward=1.0, backward_input=1.5, backward_weight=0.75)
    stage_costs = [costs.stage_cost(s, schedule.num_stages, schedule.chunks) for s in range(schedule.num_stages)]
    program = compile_program(lower(schedule), op_durations(stage_costs, False), [10**6] * schedule.num_stages)
    links = FifoLinks(lambda src, dst, nbytes: (300_000_000, 200_000_000))  # queues: each hop holds its link
    assert Engine(program, links).run() == Oracle(program, links).run()


def test_recompute_costs_one_more_forward_per_backward() -> None:
    """GPipe with recompute: each backward takes F+B, and the stash is only stage inputs."""
    p, m = 4, 8
    costs = UniformCosts(forward=1.0, backward_input=1.0, backward_weight=1.0, activation_bytes=1000)
    plain = simulate(build("gpipe", p, m), costs)
    recompute = simulate(build("gpipe", p, m, recompute=True), costs)
    assert recompute.devices[0].busy_s == pytest.approx(plain.devices[0].busy_s + m * 1.0)
    assert recompute.peak_memory_bytes < plain.peak_memory_bytes
