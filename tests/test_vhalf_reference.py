"""V-Half (and V-Min) against sail-sg's greedy V scheduler, re-implemented as the oracle in tests/vhalf_oracle.py:
same bubble rate and peak activations per device, F = I = W and unequal, timed by pipescope's engine
(docs/schedules.md section 6)."""

from __future__ import annotations

import pytest

from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.network import FifoLinks
from pipescope.simulator.result import SimResult
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate
from vhalf_oracle import reference_metrics, reference_schedule

COSTS = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.8), (1.0, 2.0, 1.0)]  # F, I, W
SIZES = [(p, m) for p in (4, 6, 8) for m in sorted({2 * p, 3 * p, 24})]
GENERATOR = {"half": "v-half", "min": "v-min"}
ACTIVATION_BYTES = 2000  # per whole device-stage; I keeps it all for W, so bytes held count activations until W


def simulated(kind: str, p: int, m: int, f: float, i: float, w: float, p2p_s: float = 0.0) -> SimResult:
    """pipescope's schedule under uniform costs (per whole device-stage: a chunk op takes half)."""
    costs = UniformCosts(f, i, w, activation_bytes=ACTIVATION_BYTES, weight_grad_bytes=ACTIVATION_BYTES)
    return simulate(build(GENERATOR[kind], p, m), costs, FifoLinks.fixed_delay(round(p2p_s * 1e9)))


def assert_matches_reference(kind: str, p: int, m: int, f: float, i: float, w: float, p2p_s: float = 0.0) -> None:
    """Bubble rate, and per device the peak activations held until I (the ledger's count) and until W (sail-sg's)."""
    result = simulated(kind, p, m, f, i, w, p2p_s)
    # The oracle takes per-chunk times: half of a device-stage's.
    reference = reference_metrics(p, m, f / 2, i / 2, w / 2, kind, comm=p2p_s)
    assert result.bubble_rate == pytest.approx(reference["bubble_rate"], abs=1e-9)
    assert [d.peak_activations for d in result.memory] == reference["until_i"]
    assert [d.peak_memory_bytes / ACTIVATION_BYTES for d in result.devices] == reference["until_w"]


# (kind, p, m, per-chunk F, I, W) -> the longest device span sail-sg's zbv_greedy.py prints (schedule_from_pattern's
# max_time, c_cost = 0), run from its repository at commit 39f2c186.
SAIL_SG_PRINTS = [
    (("half", 4, 8, 1, 1, 1), 53), (("half", 8, 24, 1, 1, 1), 161), (("half", 6, 12, 10, 15, 8), 1003),
    (("half", 5, 5, 1, 2, 1), 73), (("half", 8, 24, 10, 15, 8), 1911), (("half", 8, 24, 1, 2, 1), 248),
    (("min", 6, 12, 1, 1, 1), 89), (("min", 8, 16, 10, 15, 8), 1746),
]


@pytest.mark.parametrize(("case", "longest_span"), SAIL_SG_PRINTS)
def test_the_oracle_reproduces_sail_sg_numbers(case: tuple, longest_span: int) -> None:
    assert reference_metrics(*case[1:], kind=case[0])["longest_span"] == longest_span


@pytest.mark.parametrize(("f", "i", "w"), COSTS)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_v_half_bubble_and_peaks_equal_the_reference(p: int, m: int, f: float, i: float, w: float) -> None:
    assert_matches_reference("half", p, m, f, i, w)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 3), (4, 4), (4, 5), (5, 6), (7, 7), (8, 9), (12, 30)])
def test_v_half_equals_the_reference_at_small_and_odd_sizes(p: int, m: int) -> None:
    """m = p and p + 1 (device 0's last F0 comes before its first I0) and odd p (no gap in the block)."""
    assert_matches_reference("half", p, m, *COSTS[1])


@pytest.mark.parametrize(("p", "m"), [(3, 9), (4, 8), (6, 12), (6, 18), (9, 27)])
def test_v_min_equals_the_reference(p: int, m: int) -> None:
    """V-Min goes through the same re-pack; p divisible by 3 (the block's gap of 2) included."""
    for costs in COSTS:
        assert_matches_reference("min", p, m, *costs)


def test_a_p2p_delay_times_both_alike() -> None:
    """sail-sg's c_cost is a fixed delay on every cross-device input: FifoLinks.fixed_delay in pipescope."""
    assert_matches_reference("half", 8, 24, 1.0, 1.5, 0.8, p2p_s=0.1)


@pytest.mark.parametrize(("kind", "p", "m"), [("half", 4, 8), ("half", 7, 16), ("half", 8, 24), ("min", 6, 18)])
def test_every_device_runs_the_reference_order(kind: str, p: int, m: int) -> None:
    """Not just the same numbers: op for op the same order on every device (lanes F0 F1 I1 I0 W1 W0)."""
    (_, orders), _ = reference_schedule(p, m, 1, 1, 1, kind)
    kinds, chunks = "FFIIWW", (0, 1, 1, 0, 1, 0)
    schedule = build(GENERATOR[kind], p, m)
    for d, order in enumerate(orders):
        expected = [f"{d if chunks[t] == 0 else 2 * p - 1 - d}{kinds[t]}{mb}" for t, mb in order]
        assert [str(a) for a in schedule.compute_actions(d)] == expected


def test_v_half_is_about_half_of_1f1b_where_the_old_pass_gave_0_6() -> None:
    """The issue's case, p = 8, m = 24, F = I = W: 1F1B 0.226, V-Half 0.106 (0.138 before the cool-down re-pack)."""
    one_f_one_b = simulate(build("1f1b", 8, 24), UniformCosts(1.0, 1.0, 1.0)).bubble_rate
    v_half = simulated("half", 8, 24, 1.0, 1.0, 1.0).bubble_rate
    assert one_f_one_b == pytest.approx(7 / 31)
    assert v_half == pytest.approx(17 / 161)  # 161 unit slots against 144 busy
    assert v_half < 0.5 * one_f_one_b
