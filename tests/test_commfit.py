"""The comms fits (calibration/commfit.py): a real, positive latency shared by the size ranges, per-range bandwidth.

Real arithmetic on synthetic timings with a known latency L and bandwidth B and seeded multiplicative
(log-normal) noise, the kind the timing loop leaves: it stops once the median's standard error is a fraction
(rel_tol) of the median.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import pytest

from pipescope.calibration import commfit
from pipescope.simulator.readers.profile_schema import COMMS_FIT_RULES

SIZES = [1 << k for k in range(15, 31)]  # calibrate-comms' default sweep: 32 KiB .. 1 GiB, doubling
US = 1000.0  # ns


def linear(latency_ns: float, bandwidth: float) -> Callable[[int], float]:
    """The model the fit assumes: latency + bytes / bandwidth (bytes/s)."""
    return lambda n: latency_ns + n * 1e9 / bandwidth


def hidden(latency_ns: float, bandwidth: float) -> Callable[[int], float]:
    """Latency-bound small sizes: flat at the latency until bytes / bandwidth takes over."""
    return lambda n: max(latency_ns, n * 1e9 / bandwidth)


def rows(curve: Callable[[int], float], sigma: float, seed: int, sizes: Sequence[int] = SIZES) -> list[dict]:
    """calibrate-comms rows for p2p on 2 ranks, each median off by a log-normal factor (sigma, relative)."""
    rnd = random.Random(seed)
    return [{"collective": "p2p", "world_size": 2, "nbytes": n, "median_ns": curve(n) * rnd.lognormvariate(0, sigma)}
            for n in sizes]


def predict(fit: dict, nbytes: int) -> float:
    return fit["latency_ns"] + nbytes * 1e9 / fit["bandwidth"]


def old_fit_rows(rows: Sequence[dict]) -> list[dict]:
    """The fit before the fix, frozen here: ordinary least squares per range, a negative intercept clamped to 0
    (slope refitted through the origin), a non-positive slope replaced by 0 latency and the largest point's rate."""
    def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
        n = len(points)
        mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        var = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var > 0 else 0.0
        latency = mean_y - slope * mean_x
        if latency < 0:
            latency, slope = 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
        if slope <= 0:
            x, y = max(points)
            latency, slope = 0.0, y / x
        return latency, 1e9 / max(slope, 1e-6)

    times = {r["nbytes"]: r["median_ns"] for r in rows}
    out = []
    for group in commfit.split_ranges(list(times)):
        latency, bandwidth = fit_line([(s, times[s]) for s in group])
        out.append({"lo_bytes": group[0], "hi_bytes": group[-1], "latency_ns": latency, "bandwidth": bandwidth})
    return out


@pytest.mark.parametrize("seed", range(10))
def test_known_latency_and_bandwidth_come_back_in_every_range(seed: int) -> None:
    """L = 20 us, B = 5 GB/s (gloo-like: both terms visible at 32 KiB), 1 % noise: L within 10 %, every range's B
    within 5 %, one latency shared by the three ranges."""
    fits = commfit.fit_rows(rows(linear(20 * US, 5e9), 0.01, seed))
    assert [(f["lo_bytes"], f["hi_bytes"], f["points"]) for f in fits] == [
        (1 << 15, 1 << 19, 5), (1 << 20, 1 << 25, 6), (1 << 26, 1 << 30, 5)]
    assert len({f["latency_ns"] for f in fits}) == 1
    assert fits[0]["latency_ns"] == pytest.approx(20 * US, rel=0.10)
    for fit in fits:
        assert fit["bandwidth"] == pytest.approx(5e9, rel=0.05)


@pytest.mark.parametrize("seed", range(10))
def test_nvlink_like_latency_comes_back_from_latency_bound_small_sizes(seed: int) -> None:
    """L = 10 us, B = 150 GB/s, 2 % noise: below 1 MiB the bandwidth term (0.2..3.5 us) is within the noise of
    the latency, so that range fixes L (within 10 %) and the two larger ranges' B are within 5 %."""
    fits = commfit.fit_rows(rows(linear(10 * US, 150e9), 0.02, seed))
    assert fits[0]["latency_ns"] == pytest.approx(10 * US, rel=0.10)
    for fit in fits[1:]:
        assert fit["bandwidth"] == pytest.approx(150e9, rel=0.05)


@pytest.mark.parametrize("seed", range(10))
def test_flat_small_sizes_give_their_latency(seed: int) -> None:
    """Times flat at L = 10 us below L * B = 1.5 MB (the latency hidden under the transfer above it), 2 % noise:
    the latency is positive and within 10 % of L, and the large range's bandwidth within 5 % of B."""
    fits = commfit.fit_rows(rows(hidden(10 * US, 150e9), 0.02, seed))
    assert all(f["latency_ns"] == pytest.approx(10 * US, rel=0.10) for f in fits)
    assert fits[-1]["bandwidth"] == pytest.approx(150e9, rel=0.05)


def test_the_old_fit_gave_zero_latency_in_every_range_where_the_new_one_finds_it() -> None:
    """The issue's profile: latency_ns = 0 in all three ranges. Flat small sizes (a 2 % noise slope came out
    negative, so the old fit dropped the latency), an intercept extrapolated from 1..32 MiB and from
    64 MiB..1 GiB under noise (negative, clamped to 0). The new fit gives the true 10 us in all three."""
    data = rows(hidden(10 * US, 150e9), 0.02, seed=1)
    assert [f["latency_ns"] for f in old_fit_rows(data)] == [0.0, 0.0, 0.0]
    fits = commfit.fit_rows(data)
    assert [f["latency_ns"] for f in fits] == pytest.approx([10 * US] * 3, rel=0.05)
    # On the model the fit assumes, the old fit lost the large range's latency to noise (13 of the first 30
    # seeds; seed 2 gave 48 us instead): one latency, within 10 %, everywhere now.
    data = rows(linear(10 * US, 150e9), 0.02, seed=0)
    assert [round(f["latency_ns"], -2) for f in old_fit_rows(data)] == [9900.0, 9800.0, 0.0]
    assert [f["latency_ns"] for f in commfit.fit_rows(data)] == pytest.approx([10 * US] * 3, rel=0.10)


def test_model_is_continuous_at_the_range_edges() -> None:
    """Both sides of an edge share the latency and fit the same curve: predictions differ by < 5 % there."""
    for seed in range(10):
        fits = commfit.fit_rows(rows(linear(20 * US, 5e9), 0.01, seed))
        for below, above in zip(fits, fits[1:]):
            edge = above["lo_bytes"]
            assert predict(below, edge) == pytest.approx(predict(above, edge), rel=0.05)


def test_noise_free_line_is_recovered_exactly() -> None:
    """A shared latency with a different bandwidth per range comes back exactly; so does fit_line on one line."""
    rates = {0: 2e9, 1: 4e9, 2: 8e9}
    data = [{"collective": "all_reduce", "world_size": 4, "nbytes": n,
             "median_ns": 7 * US + n * 1e9 / rates[sum(n >= e for e in commfit.RANGE_EDGES)]} for n in SIZES]
    fits = commfit.fit_rows(data)
    assert [f["latency_ns"] for f in fits] == pytest.approx([7 * US] * 3, rel=1e-9)
    assert [f["bandwidth"] for f in fits] == pytest.approx([2e9, 4e9, 8e9], rel=1e-9)
    latency, bandwidth = commfit.fit_line([(n, 5000 + n / 2.0) for n in (1 << 15, 1 << 16, 1 << 17)])
    assert latency == pytest.approx(5000) and bandwidth == pytest.approx(2e9)


@pytest.mark.parametrize(("name", "points"), [
    ("one size", [(1 << 20, 50 * US)]),
    ("all times equal", [(n, 5 * US) for n in SIZES]),
    ("two sizes, equal times", [(1 << 15, 5000), (1 << 16, 5000)]),
    ("zero times", [(n, 0) for n in SIZES]),
    ("one size, zero time", [(1 << 15, 0)]),
    ("times falling with size", [(n, 1e6 / (k + 1)) for k, n in enumerate(SIZES)]),
    ("no latency at all", [(n, n / 2.0) for n in SIZES]),
    ("bandwidth-bound sizes only", [(n, 2 * US + n / 100.0) for n in SIZES[-4:]]),
    ("integer medians", [(n, int(9 * US + n / 50)) for n in SIZES[:3]]),
])
def test_degenerate_inputs_give_finite_positive_fits(name: str, points: list[tuple[int, float]]) -> None:
    """No exception, and every range's latency and bandwidth finite and above 0, in the schema's columns."""
    data = [{"collective": "p2p", "world_size": 2, "nbytes": n, "median_ns": t} for n, t in points]
    fits = commfit.fit_rows(data)
    assert fits and sum(f["points"] for f in fits) == len(points)
    for fit in fits:
        assert list(fit) == list(COMMS_FIT_RULES)
        assert isinstance(fit["latency_ns"], float) and isinstance(fit["bandwidth"], float)
        assert math.isfinite(fit["latency_ns"]) and fit["latency_ns"] >= commfit.MIN_LATENCY_NS
        assert math.isfinite(fit["bandwidth"]) and 0 < fit["bandwidth"] <= 1e9 / commfit.MIN_NS_PER_BYTE
    latency, bandwidth = commfit.fit_line(points)
    assert math.isfinite(latency) and latency > 0 and math.isfinite(bandwidth) and bandwidth > 0


def test_degenerate_fits_keep_what_the_data_shows() -> None:
    """All-equal times are all latency (no bandwidth visible: the 1 PB/s cap); times through the origin have no
    latency above the floor."""
    flat = commfit.fit_rows([{"collective": "p2p", "world_size": 2, "nbytes": n, "median_ns": 5 * US} for n in SIZES])
    assert [(f["latency_ns"], f["bandwidth"]) for f in flat] == [(5 * US, 1e9 / commfit.MIN_NS_PER_BYTE)] * 3
    through_origin = commfit.fit_line([(n, n / 2.0) for n in SIZES])
    assert through_origin[0] == commfit.MIN_LATENCY_NS and through_origin[1] == pytest.approx(2e9, rel=1e-3)
