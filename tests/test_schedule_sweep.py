"""Every generated schedule, for p in 2..16 and every m in p..4p, passes the structure check and runs through the
SimPy engine without deadlock (simulate() does both; issue 3's sweep in full: 4,200 schedules)."""

import pytest

from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.ir import Role
from pipescope.simulator.network import FifoLinks
from pipescope.simulator.schedules import GENERATORS, build
from pipescope.simulator.simulate import simulate

COSTS = UniformCosts(forward=1.0, backward_input=1.2, backward_weight=0.8)  # unequal: no lucky ties
P2P = FifoLinks.fixed_delay(100_000_000)


@pytest.mark.parametrize("name", list(GENERATORS))
def test_family_checks_and_simulates_for_every_p_and_m(name: str) -> None:
    """All ops of every (p, m) run, every device's last op ends, and the bubble rate is a fraction."""
    # Schedules without a flush run 2 iterations, not their default 3: the second already starts before the first
    # ends, which is all a third would add to what is checked here (a third of their time in the suite)
    options = {"iterations": 2} if "iterations" in GENERATORS[name].options else {}
    smallest = 2 if name in ("dualpipev", "dualpipe") else 1  # microbatches per device: their warm-ups feed 2p
    two_way = name in ("dualpipe", "chimera")  # two pipelines that meet in the middle: p even
    for p in range(2, 17, 2 if two_way else 1):
        # half of m feeds each of DualPipe's pipelines; Chimera runs units of p
        for m in range(smallest * p, 4 * p + 1, p if name == "chimera" else 2 if two_way else 1):
            schedule = build(name, p, m, **options)
            result = simulate(schedule, COSTS, P2P)
            compute = result.records.mask(Role.COMPUTE)
            assert result.records.end[compute].min() > 0, (p, m)
            assert compute.sum() == schedule.num_compute_ops(), (p, m)
            assert 0.0 <= result.bubble_rate < 1.0, (p, m)
