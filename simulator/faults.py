"""Faults and variability a user injects (docs/network.md): straggler GPUs, per-op jitter, degraded and failed links.

The config's ``faults`` section is text so it fits YAML and ``--set`` alike:
``stragglers: "3:1.5, 7:2"`` (GPU rank: slowdown factor), ``degraded_links: "n0.nic0-leaf0:0.25"`` (both
directions of a link, or ``a>b`` for one, at a fraction of its bandwidth), ``failed_links: "n0.nic0-leaf0"``,
``jitter: 0.05`` (each op's duration times a mean-1 lognormal factor of that relative spread, drawn from the run's
``seed``). The same seed gives the same durations, so the same bytes of output.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from pipescope.simulator.ir import Role
from pipescope.simulator.program import Program, rescaled_parts
from pipescope.simulator.readers.units import short_repr

MAX_FACTOR = 1000.0  # a straggler 1000x slower, or a link at 1/1000: beyond, a run is not worth simulating
MAX_ITEMS = 10_000


@dataclass(frozen=True)
class FaultsConfig:
    """The ``faults`` section; every field empty or 0 means a healthy cluster."""

    stragglers: str = ""
    degraded_links: str = ""
    failed_links: str = ""
    jitter: float = 0.0


@dataclass(frozen=True)
class ComputeFaults:
    """Slowdown per device and jitter, applied to a compiled program's compute durations."""

    slowdown: dict[int, float] = field(default_factory=dict)
    jitter: float = 0.0
    seed: int = 0

    def apply(self, program: Program) -> None:
        """Scale each compute entry's duration in place (a positive time stays >= 1 ns)."""
        compute = np.flatnonzero(program.columns.role == Role.COMPUTE)
        duration = np.asarray(program.duration, dtype=np.float64)[compute]
        factor = np.ones(len(compute))
        for device, slowdown in self.slowdown.items():
            factor[program.columns.device[compute] == device] *= slowdown
        if self.jitter > 0:
            sigma = math.sqrt(math.log1p(self.jitter ** 2))  # the lognormal whose std / mean is ``jitter``
            factor *= np.random.default_rng(self.seed).lognormal(-sigma * sigma / 2, sigma, len(compute))
        scaled = np.where(duration > 0, np.maximum(1, np.rint(duration * factor)), 0).astype(np.int64)
        for i, ns in zip(compute.tolist(), scaled.tolist()):
            if i in program.segments:  # an op run unit by unit: each unit by the same factor, the sum kept
                program.segments[i] = rescaled_parts(program.segments[i], ns)
            program.duration[i] = ns


def _items(key: str, text: str) -> list[str]:
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if len(items) > MAX_ITEMS:
        raise ValueError(f"{key}: got {len(items):,} items, expected at most {MAX_ITEMS:,}")
    return items


def _factor(key: str, item: str, text: str, low: float, high: float) -> float:
    try:
        value = float(text) if re.fullmatch(r"[0-9.eE+-]{1,30}", text.strip()) else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{key}: {short_repr(item)}: factor got {short_repr(text)}, expected a number from {low:g} "
                         f"to {high:g}")
    return value


def parse_stragglers(text: str) -> dict[int, float]:
    """``"3:1.5, 7:2"`` -> {3: 1.5, 7: 2.0} (GPU rank: slowdown factor >= 1)."""
    found: dict[int, float] = {}
    for item in _items("faults.stragglers", text):
        rank, sep, factor = item.partition(":")
        if not sep or not re.fullmatch(r"[0-9]{1,9}", rank.strip()):
            raise ValueError(f"faults.stragglers: got {short_repr(item)}, expected GPU:FACTOR, e.g. 3:1.5")
        if int(rank) in found:
            raise ValueError(f"faults.stragglers: GPU {int(rank)} is named twice")
        found[int(rank)] = _factor("faults.stragglers", item, factor, 1.0, MAX_FACTOR)
    return found


def apply_link_faults(graph: nx.DiGraph, degraded: str, failed: str) -> nx.DiGraph:
    """A copy of ``graph`` with degraded links' bandwidth scaled and failed links removed.

    Links are named ``a-b`` (both directions) or ``a>b`` (one), by node names; ValueError naming the item if a
    link does not exist."""
    if not degraded.strip() and not failed.strip():
        return graph
    graph, named = graph.copy(), set()
    for item in _items("faults.degraded_links", degraded):
        link, sep, factor = item.rpartition(":")
        if not sep:
            raise ValueError(f"faults.degraded_links: got {short_repr(item)}, expected LINK:FACTOR, e.g. "
                             f"n0.nic0-leaf0:0.5")
        scale = _factor("faults.degraded_links", item, factor, 1 / MAX_FACTOR, 1.0)
        for edge in _once(named, "faults.degraded_links", link.strip(), _edges(graph, "faults.degraded_links",
                                                                              link.strip())):
            graph.edges[edge]["bandwidth"] *= scale
    failures = [_once(named, "faults.failed_links", item, _edges(graph, "faults.failed_links", item))
                for item in _items("faults.failed_links", failed)]  # all named before any is removed
    for edges in failures:
        graph.remove_edges_from(edges)
    return graph


def _once(named: set, key: str, name: str, edges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``edges``, recorded in ``named``; ValueError if a fault named one before (factors would multiply past the
    bound, or a failed link would be degraded too), in either spelling (a-b, b-a, a>b)."""
    again = [edge for edge in edges if edge in named]
    if again:
        raise ValueError(f"{key}: {short_repr(name)} names the link {again[0][0]}>{again[0][1]} a second time, "
                         f"expected each link in one fault")
    named.update(edges)
    return edges


def _edges(graph: nx.DiGraph, key: str, name: str) -> list[tuple[str, str]]:
    """The directed edges ``a>b`` or ``a-b`` names (the split that gives two nodes joined by an edge)."""
    for sep, both in ((">", False), ("-", True)):
        for at in [m.start() for m in re.finditer(re.escape(sep), name)]:
            a, b = name[:at].strip(), name[at + 1:].strip()
            if graph.has_edge(a, b):
                return [(a, b), (b, a)] if both and graph.has_edge(b, a) else [(a, b)]
    raise ValueError(f"{key}: {short_repr(name)} is not a link of the topology, expected A-B or A>B with A and B "
                     f"joined by an edge (see 'pipescope topology NAME --save FILE.yaml')")
