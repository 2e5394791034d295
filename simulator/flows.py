"""Routed flows with max-min fair sharing over a graph of the interconnect (docs/network.md).

Every transfer is routed over the graph (shortest path by summed latency, then by hops; among equal paths one is
picked per flow by a seeded hash, as ECMP hashes a flow onto one of its paths) and shares each directed edge it
crosses with the flows active at the same time, max-min fairly. A flow's bytes start to drain when it starts; it
arrives its path's latency after its last byte drained, so one flow alone takes latency + bytes / slowest bandwidth.

Rates are re-planned when a flow starts or ends, and only for the flows that share an edge with it, directly or
through other flows (the "component"): a p2p transfer on its own path touches nothing else, and a collective's
flows start together in one re-plan. Re-planning a component is progressive filling over all its (flow, edge)
pairs in numpy (``max_min_rates``); docs/network.md says what keeps a run sub-quadratic.

Each re-plan gives every flow whose rate changed a new time at which it will have drained. Those times wait in
the fabric's own heap, and the clock is asked for one wake-up, at the earliest: a large run re-plans a million
times, and a clock event per re-plan (most of them overtaken by the next re-plan) cost more than the solving.
Drains due at the same time are handled in the order they were planned, as the clock's events would be.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count

import networkx as nx
import numpy as np

from pipescope.simulator.network import Clock
from pipescope.simulator.routing import EqualCostRouter
from pipescope.simulator.server_symmetry import Renaming, Routes, ServerSymmetry

MAX_ECMP_PATHS = 16  # equal-cost paths considered per pair; fabrics with more spines reuse the first 16
HOP_WEIGHT = 1 << 20  # more hops than any real path has: latency decides first, hop count breaks ties
PART_KEYS = 1_000_003  # a flow's parts (a collective's transfers, a sliced transfer's lanes) hash as part_key
WIDE = 64  # edges from which a flow's checks run in numpy: a collective's phase, not a p2p path of a few hops
MIN_RATE = 1e-12  # bytes/ns: a guard against a rate rounding to 0 when shares are subtracted
DENSE_EDGES_PER_PAIR = 8  # a solve counts over every edge of the graph while it has at most this many per pair


class NetworkError(ValueError):
    """A transfer that cannot be delivered (no route once failed links are removed); ``flow`` names it."""

    def __init__(self, message: str, flow: int):
        super().__init__(message)
        self.flow = flow

    def __reduce__(self) -> tuple:
        """Rebuilt with its flow where a worker process sends it back (the default passes the message alone)."""
        return type(self), (str(self), self.flow)


def max_min_rates(paths: Sequence[Sequence[int]], capacity: Sequence[float]) -> list[float]:
    """Max-min fair rates of flows over directed edges (progressive filling).

    Args:
        paths: per flow, the edge ids it crosses; an edge listed k times carries k times the flow's rate (a
            collective's lockstep links, ``simulator.collectives``).
        capacity: per edge id, its bandwidth (any unit; rates come out in it).

    Returns:
        Per flow its rate: the smallest fair share over its edges once the flows bottlenecked elsewhere keep
        theirs. A flow with no edges gets ``inf``.

    Most solves of a run end in one round: every flow crosses an edge of the lowest share (a collective's links
    share one level, and so do the p2p transfers that join it). ``_one_level`` finds that with one count over the
    graph's edges; the other solves run every round (``_progressive_filling``), to the same floats.
    """
    lengths = np.fromiter(map(len, paths), dtype=np.int64, count=len(paths))
    if not lengths.any():
        return [math.inf] * len(paths)
    pairs = np.concatenate(paths, dtype=np.int64, casting="unsafe")
    if lengths.all() and len(capacity) <= DENSE_EDGES_PER_PAIR * len(pairs):
        level = _one_level(pairs, lengths, np.asarray(capacity, dtype=np.float64))
        if level is not None:
            return [level] * len(paths)
    return _progressive_filling(pairs, lengths, capacity)


def _one_level(pairs: np.ndarray, lengths: np.ndarray, capacity: np.ndarray) -> float | None:
    """The first round of progressive filling, counted over every edge of the graph: its level if it freezes
    every flow, else None. Per edge, the count and the share are those of ``_progressive_filling``'s first
    round, so the level is the same float."""
    weight = np.bincount(pairs, minlength=len(capacity))
    share = np.divide(capacity, weight, out=np.full(len(capacity), np.inf), where=weight > 0)
    level = max(float(share.min()), MIN_RATE)
    hit = (share <= level * (1 + 1e-12))[pairs]  # each (flow, edge) pair: on a bottleneck edge
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return level if np.logical_or.reduceat(hit, starts).all() else None


def _progressive_filling(pairs: np.ndarray, lengths: np.ndarray, capacity: Sequence[float]) -> list[float]:
    """``max_min_rates`` round by round: each round freezes every flow through the edges with the lowest share, in
    numpy over all (flow, edge) pairs (``pairs``: every path's edges in turn; ``lengths``: per flow, how many), so
    a solve costs O(levels x pairs) in C: the distinct bottleneck levels are few (a collective's links share one,
    replicas are alike), where a heap of edges cost a Python step per pair."""
    rate = np.where(lengths == 0, np.inf, -1.0)
    flow = np.repeat(np.arange(len(lengths)), lengths)
    edges, local = _distinct(pairs, len(capacity))
    residual = np.asarray(capacity, dtype=np.float64)[edges]
    weight = np.bincount(local, minlength=len(edges)).astype(np.float64)
    while len(flow):  # the (flow, edge) pairs of flows not frozen yet
        share = np.divide(residual, weight, out=np.full(len(edges), np.inf), where=weight > 0)
        level = max(float(share.min()), MIN_RATE)
        bottleneck = share <= level * (1 + 1e-12)  # equal levels up to rounding freeze together
        frozen = np.zeros(len(lengths), dtype=bool)
        frozen[flow[bottleneck[local]]] = True
        rate[frozen] = level
        done = frozen[flow]
        if done.all():  # what is left of the edges is never read
            break
        np.subtract.at(residual, local[done], level)
        np.subtract.at(weight, local[done], 1.0)
        flow, local = flow[~done], local[~done]
    return rate.tolist()


def _distinct(pairs: np.ndarray, ids: int) -> tuple[np.ndarray, np.ndarray]:
    """(the ids in ``pairs`` once each, per pair the position of its id among them), as ``np.unique`` with
    ``return_inverse`` but without sorting: O(pairs) with a scratch array of ``ids`` slots. The order of the ids is
    arbitrary, which progressive filling does not depend on."""
    slot = np.empty(ids, dtype=np.int64)
    at = np.arange(len(pairs))
    slot[pairs] = at  # one occurrence per id wins; which one does not matter
    chosen = slot[pairs]
    first = chosen == at
    return pairs[first], (np.cumsum(first) - 1)[chosen]


@dataclass(eq=False)
class Flow:
    """One routed flow in flight: its edges, what is left to drain, its rate (bytes/ns) since ``since``."""

    seq: int
    edges: tuple[int, ...]
    distinct: tuple[int, ...]  # each edge once
    wide: np.ndarray | None  # a flow of WIDE edges or more (a collective's phase): ``edges`` in numpy
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
    busy_spans: defaultdict[int, list[tuple[int, int]]]  # only the edges that carried a flow


@dataclass
class FlowFabric:
    """The graph as arrays, routes between its nodes, and the flows in flight with their fair-share rates.

    Collective algorithms (``simulator.collectives``) and the engine-facing ``RoutedNetwork`` (``simulator.routed``)
    both start flows here. ``endpoints[d]`` is the graph node of device d.
    """

    graph: nx.DiGraph
    endpoints: Sequence[str]
    seed: int = 0
    edge_ids: dict[tuple[str, str], int] = field(init=False)
    capacity: list[float] = field(init=False)  # bytes per ns
    latency: list[float] = field(init=False)
    names: list[tuple[str, str]] = field(init=False)

    def __post_init__(self) -> None:
        arrays = _graph_arrays(self.graph)
        self.names, self.edge_ids, self.capacity, self.latency = arrays.names, arrays.edge_ids, arrays.capacity, \
            arrays.latency
        self._capacity, self._router, self._servers = arrays.capacity_array, arrays.router, arrays.servers
        # per device pair: its routes, or its class's and their renaming (a shared list and a small dict)
        self._routes: dict[tuple[int, int], tuple[Routes, Renaming | None]] = {}
        self.reset()

    def reset(self) -> None:
        """Forget flows in flight and edge statistics (before a replay)."""
        # per edge, made when a flow first crosses it: a cluster of 32,768 GPUs has a million edges, most idle
        self.on_edge: defaultdict[int, set[Flow]] = defaultdict(set)
        self.stats = EdgeStats([0] * len(self.names), [0] * len(self.names), defaultdict(list))
        self._busy_since = [0] * len(self.names)
        self._users = np.zeros(len(self.names), dtype=np.int64)  # flows in flight per edge
        self._dirty: set[Flow] = set()
        self._dirty_edges: set[int] = set()  # edges a drained flow left: their flows are re-planned
        self._solve_due = False
        self._seq = count()
        self._drains: list[list] = []  # a heap of one solve's planned drains each: see ``_plan_drains``
        self._order = count()
        self._wake_at = math.inf  # the one wake-up the clock holds for the earliest drain (inf: none)
        self.rate_updates = 0
        self.flows_started = 0
        self._in_flight: dict[Flow, None] = {}  # the flows in flight, in start order (which is ``seq`` order)

    @property
    def server_symmetry(self) -> ServerSymmetry | None:
        """The graph's symmetry between its servers (``server_symmetry``), None where it has none."""
        return self._servers

    # Routing -----------------------------------------------------------------------------------------------------

    def routes(self, src: int, dst: int) -> list[tuple[tuple[int, ...], int]]:
        """The equal-latency shortest paths from device ``src`` to ``dst``: (edge ids, summed latency ns) each;
        empty when there is none."""
        paths, onto = self._paths(src, dst)
        return paths if onto is None else [(self._servers.rename(path, onto), latency) for path, latency in paths]

    def route(self, src: int, dst: int, key: int) -> tuple[tuple[int, ...], int] | None:
        """The path flow ``key`` takes: one of the equal paths by a seeded hash of the flow (None: no route). Between
        identical servers only that one path is renamed from its class's (``server_symmetry``)."""
        paths, onto = self._paths(src, dst)
        if not paths:
            return None
        path, latency = paths[_mix(self.seed, key) % len(paths)] if len(paths) > 1 else paths[0]
        return (path, latency) if onto is None else (self._servers.rename(path, onto), latency)

    def _paths(self, src: int, dst: int) -> tuple[list[tuple[tuple[int, ...], int]], Renaming | None]:
        """The pair's routes, or its class's and their renaming (``ServerSymmetry.of_class``), once per pair."""
        key = (src, dst)
        known = self._routes.get(key)
        if known is None:
            ends = self.endpoints[src], self.endpoints[dst]
            found = None if self._servers is None else self._servers.of_class(*ends, self._search)
            known = self._routes[key] = found if found is not None else (self._search(*ends), None)
        return known

    def _search(self, source: str, target: str) -> list[tuple[tuple[int, ...], int]]:
        """Up to ``MAX_ECMP_PATHS`` shortest paths between two graph nodes, each with its summed latency."""
        paths = self._router.paths(source, target, MAX_ECMP_PATHS)
        return [(p, round(sum(self.latency[e] for e in p))) for p in paths]

    # Flows -------------------------------------------------------------------------------------------------------

    def start(self, clock: Clock, now: int, path: tuple[tuple[int, ...], int], nbytes: int,
              arrived: Callable[[int], None]) -> None:
        """Start a flow of ``nbytes`` along ``path`` at ``now``; ``arrived(time)`` is called once it arrives."""
        self.flows_started += 1
        edges, latency = path
        if nbytes <= 0 or not edges:
            arrived(now + (latency if nbytes > 0 else 0))
            return
        distinct = tuple(dict.fromkeys(edges))
        wide = np.asarray(edges, dtype=np.int64) if len(edges) >= WIDE else None
        flow = Flow(next(self._seq), edges, distinct, wide, nbytes, latency, arrived, remaining=float(nbytes),
                    since=now)
        self._in_flight[flow] = None
        for e in edges:
            users = self.on_edge[e]
            if not users:
                self._busy_since[e] = now
            users.add(flow)
            self.stats.nbytes[e] += nbytes
        self._users[distinct, ] += 1
        self._replan(clock, now, {flow})

    def _replan(self, clock: Clock, now: int, flows: Iterable[Flow] = (), edges: Iterable[int] = ()) -> None:
        """Mark the flows, and those on the edges (and so their components), for a new rate; one solve per instant,
        whatever starts or ends at it."""
        self._dirty.update(flows)
        self._dirty_edges.update(edges)
        if not self._solve_due:
            self._solve_due = True
            clock.call_at(now, lambda: self._solve(clock, now))

    def _solve(self, clock: Clock, now: int) -> None:
        self._solve_due = False
        flows = self._component(self._dirty, self._dirty_edges)
        self._dirty, self._dirty_edges = set(), set()
        rates = max_min_rates([f.edges if f.wide is None else f.wide for f in flows], self._capacity)
        planned = []
        for flow, rate in zip(flows, rates):
            if rate == flow.rate:
                continue
            flow.remaining -= flow.rate * (now - flow.since)
            flow.rate, flow.since = rate, now
            flow.version += 1
            self.rate_updates += 1
            drained = now + max(0, math.ceil(flow.remaining / rate - 1e-9))
            planned.append((drained, next(self._order), flow, flow.version))
        self._plan_drains(planned)
        self._wake(clock)

    def _plan_drains(self, planned: list[tuple[int, int, Flow, int]]) -> None:
        """Queue one solve's planned drains, each (time, order, flow, its version then), as one entry of the heap:
        [time, order, the plans sorted, the next one's index], keyed by its next plan. A solve re-plans a whole
        component and the next solve usually supersedes most of it, so one heap entry per solve (and one step per
        superseded plan) replaces a push and a pop per plan. Taking the least key each time gives the plans in
        (time, order) order, as one heap of plans did: drains due together run in the order they were planned."""
        if planned:
            planned.sort()  # (time, order) is unique: the flows are never compared
            heapq.heappush(self._drains, [planned[0][0], planned[0][1], planned, 0])

    def _take(self) -> tuple[int, int, Flow, int]:
        """The top entry's next plan, taken."""
        top = self._drains[0]
        plan = top[2][top[3]]
        self._move_top(top[3] + 1)
        return plan

    def _settle(self) -> None:
        """Step the top entries past their superseded plans, re-keying each once (or dropping it), until the top's
        next plan stands."""
        drains = self._drains
        while drains:
            top = drains[0]
            plans, index = top[2], top[3]
            while index < len(plans) and plans[index][2].version != plans[index][3]:
                index += 1
            if index == top[3]:
                return
            self._move_top(index)

    def _move_top(self, index: int) -> None:
        """The top entry's next plan becomes its ``index``-th: the entry is re-keyed by it, or leaves the heap when
        it has no more."""
        top = self._drains[0]
        plans = top[2]
        if index == len(plans):
            heapq.heappop(self._drains)
        else:
            top[0], top[1], top[3] = plans[index][0], plans[index][1], index
            heapq.heapreplace(self._drains, top)  # its key grew: sift it down

    def _wake(self, clock: Clock) -> None:
        """Ask the clock to call ``_drain_due`` at the earliest planned drain that still stands, unless it will
        already by then."""
        self._settle()  # a superseded plan: waking for it would find nothing to drain
        drains = self._drains
        if drains and drains[0][0] < self._wake_at:
            due = self._wake_at = drains[0][0]
            clock.call_at(due, lambda: self._drain_due(clock, due))

    def _drain_due(self, clock: Clock, now: int) -> None:
        """Every flow planned to drain by ``now`` whose plan still stands (a later re-plan supersedes it)."""
        if now != self._wake_at:
            return  # an earlier wake-up took this one's place and drained what was due
        self._wake_at = math.inf
        drains = self._drains
        while drains and drains[0][0] <= now:
            _, _, flow, version = self._take()
            if flow.version == version:
                self._drained(clock, flow, now)
        self._wake(clock)

    def _component(self, seeds: set[Flow], edges: set[int]) -> list[Flow]:
        """The ``seeds`` still in flight, the flows on ``edges``, and every flow that shares an edge with them,
        transitively, in start order. An edge is walked once: seeding with a drained flow's edges, not with their
        flows, saves walking each of those edges again from every flow on it."""
        flows = {flow for flow in seeds if flow in self._in_flight}  # one may have drained since
        seen: set[int] = set(edges)
        for e in edges:
            flows |= self.on_edge[e]
        stack, flying = list(flows), len(self._in_flight)
        while stack and len(flows) < flying:  # once every flow in flight is in, there is nothing to find
            flow = stack.pop()
            for e in self._shared(flow):
                if e not in seen:
                    seen.add(e)
                    fresh = self.on_edge[e] - flows
                    flows |= fresh
                    stack.extend(fresh)
                    if len(flows) == flying:
                        break
        if len(flows) == flying:  # most solves of a wide run: every flow in flight, already in start order
            return list(self._in_flight)
        return sorted(flows, key=lambda f: f.seq)  # a fixed order: the same floats, the same bytes of output

    def _shared(self, flow: Flow, others: int = 1) -> list[int]:
        """The flow's edges that more than ``others`` flows in flight cross (1: other flows than itself; 0, once it
        has left: any)."""
        if flow.wide is None:
            return [e for e in flow.distinct if len(self.on_edge[e]) > others]
        return flow.wide[self._users[flow.wide] > others].tolist()

    def _drained(self, clock: Clock, flow: Flow, now: int) -> None:
        flow.version += 1
        del self._in_flight[flow]
        for e in flow.distinct:  # once per edge: a lockstep flow may cross one twice, which is one busy span
            users = self.on_edge[e]
            users.discard(flow)
            if not users:
                self.stats.busy_ns[e] += now - self._busy_since[e]
                self.stats.busy_spans[e].append((self._busy_since[e], now))
        self._users[flow.distinct, ] -= 1
        # the flows left on its edges are what its leaving re-plans (no edge left in use still takes its turn)
        self._replan(clock, now, edges=self._shared(flow, others=0))
        flow.arrived(now + flow.latency_ns)


@dataclass(frozen=True)
class _GraphArrays:
    """What a fabric reads off its graph alone, whatever its endpoints: the edges in id order, their capacity and
    latency, the router and the servers' symmetry."""

    names: list[tuple[str, str]]
    edge_ids: dict[tuple[str, str], int]
    capacity: list[float]  # bytes per ns
    capacity_array: np.ndarray
    latency: list[float]
    router: EqualCostRouter
    servers: ServerSymmetry | None

    @classmethod
    def of(cls, graph: nx.DiGraph) -> _GraphArrays:
        names = list(graph.edges)
        # what NCCL's transfers reach of each link (its line rate times its efficiency, docs/topologies.md)
        capacity = [graph.edges[e]["bandwidth"] * graph.edges[e].get("efficiency", 1.0) / 1e9 for e in names]
        latency = [float(graph.edges[e]["latency_ns"]) for e in names]
        # Every node is routable, a GPU whose links all failed too: it is just unreachable.
        router = EqualCostRouter(graph, names, [routing_weight(lat) for lat in latency])
        return cls(names, {edge: i for i, edge in enumerate(names)}, capacity, np.asarray(capacity, dtype=np.float64),
                   latency, router, ServerSymmetry.of(graph, names, latency, MAX_ECMP_PATHS))


_OF_FROZEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # frozen graph -> its _GraphArrays


def _graph_arrays(graph: nx.DiGraph) -> _GraphArrays:
    """``_GraphArrays.of(graph)``, once per frozen graph (``topology_io.shared_topology``'s: the planner builds a
    network or two per candidate on one, and at 128 servers reading the graph was 70 ms of each)."""
    if not nx.is_frozen(graph):
        return _GraphArrays.of(graph)
    known = _OF_FROZEN.get(graph)
    if known is None:
        known = _OF_FROZEN[graph] = _GraphArrays.of(graph)
    return known


def routing_weight(latency_ns: float) -> int:
    """An edge's routing weight: latency in whole ns, then hop count, as one exact integer. Ties stay exact (ECMP
    needs equal sums), fewer hops win among equal latencies, and a 0 ns edge cannot close a cycle of equal paths."""
    return round(latency_ns) * HOP_WEIGHT + 1


def part_key(key: int, part: int) -> int:
    """The ECMP key of part ``part`` of flow ``key``: each part picks its own equal-cost path."""
    return key * PART_KEYS + part


def _mix(seed: int, key: int) -> int:
    """A 64-bit hash of (seed, key) (splitmix64's finaliser): ECMP's per-flow choice, stable across runs."""
    x = (seed * 0x9E3779B97F4A7C15 + key + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)
