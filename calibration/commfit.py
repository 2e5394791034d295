"""Bandwidth arithmetic for collectives, as nccl-tests reports it, and the latency + bytes/bandwidth fits.

Standard library only. nccl-tests conventions (its doc/PERFORMANCE.md): ``size`` is the full buffer
(all-gather: the gathered output; reduce-scatter: the input being scattered; p2p: one message),
algbw = size / time, busbw = algbw * factor with factor 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
reduce-scatter, and 1 for send/recv.
"""

from __future__ import annotations

from collections.abc import Sequence

# Default edges of the size ranges fitted separately: latency-bound, middle, bandwidth-bound.
RANGE_EDGES = (1 << 20, 64 << 20)


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio for ``collective`` over ``world_size`` ranks."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "p2p": 1.0}
    if collective not in factors:
        raise ValueError(f"collective: {collective!r}, expected one of {', '.join(factors)}")
    return factors[collective]


def bandwidths(collective: str, world_size: int, nbytes: int, time_ns: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second), as nccl-tests prints them."""
    algbw = nbytes / time_ns if time_ns > 0 else float("inf")  # bytes/ns == GB/s
    return algbw, algbw * bus_factor(collective, world_size)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``time_ns = latency_ns + nbytes / bandwidth`` over (nbytes, time_ns) points.

    Returns:
        (latency_ns, bandwidth in bytes/s). A negative latency (noise at tiny sizes) is clamped to 0 and the
        slope refitted through the origin; a non-positive slope falls back to the largest point's rate.
    """
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var > 0 else 0.0
    latency = mean_y - slope * mean_x
    if latency < 0:
        latency = 0.0
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    if slope <= 0:
        x, y = max(points)
        latency, slope = 0.0, y / x
    return latency, 1e9 / max(slope, MIN_NS_PER_BYTE)


MIN_NS_PER_BYTE = 1e-6  # 1 PB/s, the fastest link a topology file may name: a 0 ns median is not a real rate


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
    """Fit each (collective, world size) per size range; rows need collective, world_size, nbytes, median_ns."""
    keys = sorted({(r["collective"], r["world_size"]) for r in rows})
    fits = []
    for collective, world in keys:
        times = {r["nbytes"]: r["median_ns"] for r in rows if (r["collective"], r["world_size"]) == (collective, world)}
        for group in split_ranges(list(times), edges):
            if len(group) < 2:
                latency, bandwidth = 0.0, 1e9 * group[0] / times[group[0]]
            else:
                latency, bandwidth = fit_line([(s, times[s]) for s in group])
            fits.append({"collective": collective, "world_size": world, "lo_bytes": group[0], "hi_bytes": group[-1],
                         "latency_ns": latency, "bandwidth": bandwidth, "points": len(group)})
    return fits
