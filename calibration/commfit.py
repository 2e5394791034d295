"""Bandwidth arithmetic for collectives, as nccl-tests reports it, and the latency + bytes/bandwidth fits.

Standard library only. nccl-tests conventions (its doc/PERFORMANCE.md): ``size`` is the full buffer
(all-gather: the gathered output; reduce-scatter: the input being scattered; p2p: one message),
algbw = size / time, busbw = algbw * factor with factor 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
reduce-scatter, and 1 for send/recv.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

# Default edges of the size ranges fitted separately: latency-bound, middle, bandwidth-bound.
RANGE_EDGES = (1 << 20, 64 << 20)


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio for ``collective`` over ``world_size`` ranks."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "broadcast": 1.0, "p2p": 1.0}
    if collective not in factors:
        raise ValueError(f"collective: {collective!r}, expected one of {', '.join(factors)}")
    return factors[collective]


def bandwidths(collective: str, world_size: int, nbytes: int, time_ns: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second), as nccl-tests prints them."""
    algbw = nbytes / time_ns if time_ns > 0 else float("inf")  # bytes/ns == GB/s
    return algbw, algbw * bus_factor(collective, world_size)


# Why the fits look like this (the issue: p2p profiles reported latency_ns = 0 in every size range).
# The old fit was an ordinary least-squares line per size range, a negative intercept clamped to 0, a negative
# slope replaced by "0 latency, the largest point's rate". Three things made that 0 the usual answer:
#   * ordinary least squares weighs absolute errors, so the largest messages decide the line: at 64 MiB..1 GiB a
#     1 % timing error is 5..70 us, several times a 5..20 us latency, and the intercept, an extrapolation to
#     0 bytes from sizes far from it, is that noise: negative (so 0) in 37-50 % of fits;
#   * the smallest messages are latency-bound, their times are flat within noise, so the slope comes out
#     negative about half the time, and the fallback then threw the whole latency away;
#   * where the latency overlaps part of the transfer (pipelined sends, time ~ max(latency, n/B)), the points
#     of the ranges above it lie on n/B and the intercept is ~0 or below.
# (Simulated with L = 10 us, B = 150 GB/s, 2 % noise, 32 KiB..1 GiB: 37 % of the >= 64 MiB fits gave 0; with the
# latency hidden under the transfer, 49 % of the < 1 MiB, 14 % of the middle and 50 % of the large fits did.)
# Latency and bandwidth are properties of different size regimes, so they are fitted where each is visible:
#   1. one latency per (collective, world size), from the smallest-size range only (the latency-bound one), by a
#      relative-error least squares (below); if those times do not grow with size, the range is pure latency
#      and the latency is their median;
#   2. each range's bandwidth given that shared latency, again by relative error.
# Relative error (weights 1 / time**2) because the timing noise is multiplicative: repetitions stop once the
# median's standard error is rel_tol (2 %) *of the median*, so 1 / time**2 is each point's inverse variance,
# and every size counts equally instead of the largest ones deciding everything. Sharing one latency keeps the
# model close to continuous at the range edges (both sides hold the same latency; they differ only by e * (1/B_r -
# 1/B_r+1), the change in fitted rate the data shows there), and it is what a Link means: the latency is paid
# once per message, the bandwidth term is the time the link is busy.
MIN_LATENCY_NS = 1.0  # the least latency a fit reports: ProfiledCosts rounds it to whole ns, and 0 is not a latency


def _weights(points: Sequence[tuple[float, float]]) -> list[float]:
    """Inverse variances of multiplicative noise: 1 / time**2 (a time under MIN_LATENCY_NS counts as it)."""
    return [1.0 / max(y, MIN_LATENCY_NS) ** 2 for _, y in points]


def weighted_line(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Relative-error least squares ``time_ns = intercept + slope * nbytes``: (intercept ns, slope ns/byte).

    Minimises sum(((time - intercept - slope * nbytes) / time) ** 2). None with fewer than 2 distinct sizes.
    """
    w = _weights(points)
    total = sum(w)
    mean_x = sum(wi * x for wi, (x, _) in zip(w, points)) / total
    mean_y = sum(wi * y for wi, (_, y) in zip(w, points)) / total
    var = sum(wi * (x - mean_x) ** 2 for wi, (x, _) in zip(w, points))
    if not var > 0:
        return None
    slope = sum(wi * (x - mean_x) * (y - mean_y) for wi, (x, y) in zip(w, points)) / var
    return mean_y - slope * mean_x, slope


def fit_latency(points: Sequence[tuple[float, float]]) -> float:
    """The latency (ns, >= MIN_LATENCY_NS) from the latency-bound sizes ``points`` (the smallest-size range).

    The relative-error line's intercept; the median time when the times do not grow with size (all latency);
    MIN_LATENCY_NS when there is one size (latency and bandwidth cannot be told apart) or the intercept is not
    above 0 (no latency above the noise).
    """
    line = weighted_line(points)
    if line is None:
        return MIN_LATENCY_NS
    intercept, slope = line
    if slope <= 0:
        latency = float(statistics.median(y for _, y in points))
    else:
        latency = float(intercept)
    return latency if latency >= MIN_LATENCY_NS else MIN_LATENCY_NS


def fit_bandwidth(points: Sequence[tuple[float, float]], latency_ns: float) -> float | None:
    """Bandwidth (bytes/s) of ``time_ns = latency_ns + nbytes * 1e9 / bandwidth`` over ``points``, latency given.

    Relative-error least squares for the one slope; None when the times do not rise above the latency (a
    latency-bound range: no bandwidth to see). At most 1 PB/s (MIN_NS_PER_BYTE).
    """
    w = _weights(points)
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * (y - latency_ns) for wi, (x, y) in zip(w, points))
    if not (sxx > 0 and sxy > 0):
        return None
    return 1e9 / max(sxy / sxx, MIN_NS_PER_BYTE)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``time_ns = latency_ns + nbytes * 1e9 / bandwidth`` over one set of (nbytes, time_ns) points.

    Returns:
        (latency_ns > 0, bandwidth in bytes/s > 0): fit_latency over the points, then fit_bandwidth given it
        (1 PB/s when the times never rise above the latency). fit_rows shares one latency across ranges instead.
    """
    latency = fit_latency(points)
    bandwidth = fit_bandwidth(points, latency)
    return latency, 1e9 / MIN_NS_PER_BYTE if bandwidth is None else bandwidth


MIN_NS_PER_BYTE = 1e-6  # 1 PB/s, the fastest link a topology file may name: a 0 ns median is not a real rate


def range_bandwidths(groups: Sequence[Sequence[tuple[float, float]]], latency_ns: float) -> list[float]:
    """Each group's (size range's, smallest first) bandwidth given the shared latency.

    A range whose times do not rise above the latency takes the nearest range's bandwidth (the larger one on a
    tie), so the model stays continuous at its edge; with no bandwidth anywhere, 1 PB/s (the latency alone).
    """
    raw = [fit_bandwidth(g, latency_ns) for g in groups]
    known = [i for i, b in enumerate(raw) if b is not None]
    if not known:
        return [1e9 / MIN_NS_PER_BYTE] * len(groups)
    return [b if b is not None else raw[min(known, key=lambda k: (abs(k - i), k < i))] for i, b in enumerate(raw)]


def split_ranges(sizes: Sequence[int], edges: Sequence[int] = RANGE_EDGES) -> list[list[int]]:
    """Group sorted sizes by ``edges``; a group of fewer than 2 sizes joins the next one (a line needs 2)."""
    groups: list[list[int]] = []
    for size in sorted(sizes):
        index = sum(size >= e for e in edges)
        while len(groups) <= index:
            groups.append([])
        groups[index].append(size)
    merged: list[list[int]] = []
    carry: list[int] = []
    for group in groups:
        carry += group
        if len(carry) >= 2:
            merged.append(carry)
            carry = []
    if carry and merged:
        merged[-1] += carry
    elif carry:
        merged.append(carry)
    return merged


def fit_rows(rows: Sequence[dict], edges: Sequence[int] = RANGE_EDGES) -> list[dict]:
    """Fit each (collective, world size) per size range; rows need collective, world_size, nbytes, median_ns.

    One latency per (collective, world size), from its smallest-size range (fit_latency), shared by all its
    ranges; each range's bandwidth given it (range_bandwidths). Both positive and finite for any input.
    """
    keys = sorted({(r["collective"], r["world_size"]) for r in rows})
    fits = []
    for collective, world in keys:
        times = {r["nbytes"]: r["median_ns"] for r in rows if (r["collective"], r["world_size"]) == (collective, world)}
        groups = [[(s, times[s]) for s in group] for group in split_ranges(list(times), edges)]
        latency = fit_latency(groups[0])
        for group, bandwidth in zip(groups, range_bandwidths(groups, latency)):
            fits.append({"collective": collective, "world_size": world, "lo_bytes": group[0][0],
                         "hi_bytes": group[-1][0], "latency_ns": latency, "bandwidth": bandwidth,
                         "points": len(group)})
    return fits
