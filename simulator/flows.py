"""Routed flows with max-min fair sharing over a graph of the interconnect (docs/network.md).

Every transfer is routed over the graph (shortest path by summed latency, then by hops; among equal paths one is
picked per flow by a seeded hash, as ECMP hashes a flow onto one of its paths) and shares each directed edge it
crosses with the flows active at the same time, max-min fairly. A flow's bytes start to drain when it starts; it
arrives its path's latency after its last byte drained, so one flow alone takes latency + bytes / slowest bandwidth.

Rates are re-planned when a flow starts or ends, and only for the flows that share an edge with it, directly or
through other flows (the "component"): a p2p transfer on its own path touches nothing else, and a collective's
flows start together in one re-plan. Re-planning a component is progressive filling with a heap of edges,
O((E + L) log E) for E edges and L path hops of its flows; docs/network.md says what keeps a run sub-quadratic.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count

import networkx as nx

from pipescope.simulator.network import Clock

MAX_ECMP_PATHS = 16  # equal-cost paths considered per pair; fabrics with more spines reuse the first 16
HOP_WEIGHT = 1 << 20  # more hops than any real path has: latency decides first, hop count breaks ties
MIN_RATE = 1e-12  # bytes/ns: a guard against a rate rounding to 0 when shares are subtracted


class NetworkError(ValueError):
    """A transfer that cannot be delivered (no route once failed links are removed); ``flow`` names it."""

    def __init__(self, message: str, flow: int):
        super().__init__(message)
        self.flow = flow


def max_min_rates(paths: Sequence[Sequence[int]], capacity: Sequence[float]) -> list[float]:
    """Max-min fair rates of flows over directed edges (progressive filling).

    Args:
        paths: per flow, the edge ids it crosses (a flow crosses an edge at most once).
        capacity: per edge id, its bandwidth (any unit; rates come out in it).

    Returns:
        Per flow its rate: the smallest fair share over its edges once the flows bottlenecked elsewhere keep
        theirs. A flow with no edges gets ``inf``.
    """
    users: dict[int, list[int]] = {}
    for i, path in enumerate(paths):
        for e in path:
            users.setdefault(e, []).append(i)
    residual = {e: float(capacity[e]) for e in users}
    left = {e: len(flows) for e, flows in users.items()}
    heap = [(residual[e] / left[e], e) for e in users]
    heapq.heapify(heap)
    rate = [math.inf if not path else -1.0 for path in paths]
    while heap:
        share, e = heapq.heappop(heap)
        if not left[e] or share != residual[e] / left[e]:
            continue  # stale: the edge's share changed since this entry was pushed
        share = max(share, MIN_RATE)
        for i in users[e]:
            if rate[i] >= 0:
                continue
            rate[i] = share
            for other in paths[i]:
                residual[other] -= share
                left[other] -= 1
                if left[other] and other != e:
                    heapq.heappush(heap, (residual[other] / left[other], other))
    return rate


@dataclass(eq=False)
class Flow:
    """One routed flow in flight: its edges, what is left to drain, its rate (bytes/ns) since ``since``."""

    seq: int
    edges: tuple[int, ...]
    nbytes: int
    latency_ns: int
    arrived: Callable[[int], None]  # called with the arrival time once the last byte drained
    remaining: float = 0.0
    rate: float = 0.0
    since: int = 0
    version: int = 0


@dataclass
class EdgeStats:
    """Per directed edge: bytes that crossed it and ns it carried at least one flow."""

    nbytes: list[int]
    busy_ns: list[int]
    busy_spans: list[list[tuple[int, int]]]


@dataclass
class FlowFabric:
    """The graph as arrays, routes between its nodes, and the flows in flight with their fair-share rates.

    Collective algorithms (``simulator.collectives``) and the engine-facing ``FlowNetwork`` both start flows here.
    ``endpoints[d]`` is the graph node of device d.
    """

    graph: nx.DiGraph
    endpoints: Sequence[str]
    seed: int = 0
    edge_ids: dict[tuple[str, str], int] = field(init=False)
    capacity: list[float] = field(init=False)  # bytes per ns
    latency: list[float] = field(init=False)
    names: list[tuple[str, str]] = field(init=False)

    def __post_init__(self) -> None:
        self.names = list(self.graph.edges)
        self.edge_ids = {edge: i for i, edge in enumerate(self.names)}
        self.capacity = [self.graph.edges[e]["bandwidth"] / 1e9 for e in self.names]
        self.latency = [float(self.graph.edges[e]["latency_ns"]) for e in self.names]
        # Routing weight: latency in whole ns, then hop count, as one exact integer. Ties stay exact (ECMP needs
        # equal sums), fewer hops win among equal latencies, and a 0 ns edge cannot close a cycle of equal paths.
        self._routing = nx.DiGraph()
        self._routing.add_weighted_edges_from((a, b, round(lat) * HOP_WEIGHT + 1)
                                              for (a, b), lat in zip(self.names, self.latency))
        self._preds: dict[str, tuple[dict[str, list[str]], dict[str, int], int]] = {}  # source: preds, dist, cutoff
        self._routes: dict[tuple[int, int], list[tuple[tuple[int, ...], int]]] = {}
        self.reset()

    def reset(self) -> None:
        """Forget flows in flight and edge statistics (before a replay)."""
        self.on_edge: list[set[Flow]] = [set() for _ in self.names]
        self.stats = EdgeStats([0] * len(self.names), [0] * len(self.names), [[] for _ in self.names])
        self._busy_since = [0] * len(self.names)
        self._dirty: set[int] = set()
        self._solve_due = False
        self._seq = count()
        self.rate_updates = 0
        self.flows_started = 0

    # Routing -----------------------------------------------------------------------------------------------------

    def routes(self, src: int, dst: int) -> list[tuple[tuple[int, ...], int]]:
        """The equal-latency shortest paths from device ``src`` to ``dst``: (edge ids, summed latency ns) each;
        empty when there is none."""
        key = (src, dst)
        known = self._routes.get(key)
        if known is None:
            known = self._routes[key] = self._find_routes(self.endpoints[src], self.endpoints[dst])
        return known

    def _find_routes(self, source: str, target: str) -> list[tuple[tuple[int, ...], int]]:
        if source == target:
            return [((), 0)]
        preds = self._predecessors(source, target)
        if preds is None:
            return []
        paths: list[tuple[int, ...]] = []
        stack: list[tuple[str, tuple[int, ...]]] = [(target, ())]
        while stack and len(paths) < MAX_ECMP_PATHS:  # walk the predecessor DAG back from the target, in order
            node, tail = stack.pop()
            if node == source:
                paths.append(tail)
                continue
            for pred in reversed(preds[node]):
                stack.append((pred, (self.edge_ids[pred, node],) + tail))
        return [(p, round(sum(self.latency[e] for e in p))) for p in paths]

    def _predecessors(self, source: str, target: str) -> dict[str, list[str]] | None:
        """Every shortest-path predecessor of the nodes up to ``target``'s distance from ``source`` (None: no path).

        One Dijkstra per source, cut off at the farthest destination asked for so far: a full one per GPU costs
        O(V log V) each, which dominates a 1,024-GPU run, while most destinations (pipeline neighbours, replicas on
        the same rail) are near."""
        known = self._preds.get(source)
        if known is not None and target in known[1]:
            return known[0]
        try:
            distance = nx.bidirectional_dijkstra(self._routing, source, target)[0]
        except nx.NetworkXNoPath:
            return None
        cutoff = max(distance, known[2] if known is not None else 0)
        preds, dist = nx.dijkstra_predecessor_and_distance(self._routing, source, cutoff=cutoff)
        self._preds[source] = (preds, dist, cutoff)
        return preds

    def route(self, src: int, dst: int, key: int) -> tuple[tuple[int, ...], int] | None:
        """The path flow ``key`` takes: one of the equal paths by a seeded hash of the flow (None: no route)."""
        paths = self.routes(src, dst)
        if not paths:
            return None
        return paths[_mix(self.seed, key) % len(paths)] if len(paths) > 1 else paths[0]

    # Flows -------------------------------------------------------------------------------------------------------

    def start(self, clock: Clock, now: int, path: tuple[tuple[int, ...], int], nbytes: int,
              arrived: Callable[[int], None]) -> None:
        """Start a flow of ``nbytes`` along ``path`` at ``now``; ``arrived(time)`` is called once it arrives."""
        self.flows_started += 1
        edges, latency = path
        if nbytes <= 0 or not edges:
            arrived(now + (latency if nbytes > 0 else 0))
            return
        flow = Flow(next(self._seq), edges, nbytes, latency, arrived, remaining=float(nbytes), since=now)
        for e in edges:
            users = self.on_edge[e]
            if not users:
                self._busy_since[e] = now
            users.add(flow)
            self.stats.nbytes[e] += nbytes
        self._replan(clock, now, edges)

    def _replan(self, clock: Clock, now: int, edges: tuple[int, ...]) -> None:
        """Mark the edges' flows for a new rate; one solve per instant, whatever starts or ends at it."""
        self._dirty.update(edges)
        if not self._solve_due:
            self._solve_due = True
            clock.call_at(now, lambda: self._solve(clock, now))

    def _solve(self, clock: Clock, now: int) -> None:
        self._solve_due = False
        flows = self._component(self._dirty)
        self._dirty = set()
        rates = max_min_rates([f.edges for f in flows], self.capacity)
        for flow, rate in zip(flows, rates):
            if rate == flow.rate:
                continue
            flow.remaining -= flow.rate * (now - flow.since)
            flow.rate, flow.since = rate, now
            flow.version += 1
            self.rate_updates += 1
            version = flow.version
            drained = now + max(0, math.ceil(flow.remaining / rate - 1e-9))
            clock.call_at(drained, lambda f=flow, v=version, t=drained: self._drained(clock, f, v, t))

    def _component(self, seeds: set[int]) -> list[Flow]:
        """The flows on ``seeds`` and every flow that shares an edge with them, transitively, in start order."""
        flows: set[Flow] = set()
        seen, stack = set(seeds), list(seeds)
        while stack:
            for flow in self.on_edge[stack.pop()]:
                if flow not in flows:
                    flows.add(flow)
                    fresh = [e for e in flow.edges if e not in seen]
                    seen.update(fresh)
                    stack.extend(fresh)
        return sorted(flows, key=lambda f: f.seq)  # a fixed order: the same floats, the same bytes of output

    def _drained(self, clock: Clock, flow: Flow, version: int, now: int) -> None:
        if flow.version != version:
            return  # re-planned since: a later call stands for this flow
        flow.version += 1
        for e in flow.edges:
            users = self.on_edge[e]
            users.discard(flow)
            if not users:
                self.stats.busy_ns[e] += now - self._busy_since[e]
                self.stats.busy_spans[e].append((self._busy_since[e], now))
        self._replan(clock, now, flow.edges)
        flow.arrived(now + flow.latency_ns)


def _mix(seed: int, key: int) -> int:
    """A 64-bit hash of (seed, key) (splitmix64's finaliser): ECMP's per-flow choice, stable across runs."""
    x = (seed * 0x9E3779B97F4A7C15 + key + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)
