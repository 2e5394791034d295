"""``RoutedNetwork``: the engine's ``Network`` on a graph of the interconnect, transfers and collectives as routed,
fair-shared flows (``simulator.flows``, ``simulator.collectives``; docs/network.md)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from itertools import count
from typing import TYPE_CHECKING

import networkx as nx

from pipescope.simulator.collectives import NCCL_STEP_NS, Collectives
from pipescope.simulator.flows import FlowFabric, NetworkError, part_key
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.network import Clock

if TYPE_CHECKING:
    from pipescope.simulator.fold import Fold
    from pipescope.simulator.result import SimResult


MAX_LINK_LANES = 16  # busiest links a result keeps spans of (for the trace's and Gantt's link lanes)


class RoutedNetwork:
    """Transfers routed over ``graph`` between the nodes ``endpoints[device]``; collectives by ``algorithm``.

    Args:
        graph: directed edges with ``bandwidth`` (bytes/s) and ``latency_ns``; GPU nodes may carry ``node``
            (their server), which the hierarchical all-reduce groups by.
        endpoints: the graph node each device runs on.
        seed: picks among equal-cost paths (ECMP), per flow.
        algorithm: ``auto`` (the fastest on the idle network, as NCCL's tuner) or ``ring``/``tree``/``hierarchical``.
        lanes: under tensor parallelism, per device the graph nodes of its other GPUs, in order. Each GPU moves its
            own slice of a transfer to the same GPU of the peer device, and joins its own copy of a collective over
            the same GPU of every member (a data-parallel all-reduce of its gradient shard), all at once: where the
            GPUs share a link (one NIC for a server) they share its bandwidth (docs/network.md).
    """

    final_answers = False  # a flow's end moves whenever the fair share is re-planned

    def __init__(self, graph: nx.DiGraph, endpoints: Sequence[str], seed: int = 0, algorithm: str = "auto",
                 lanes: Sequence[Sequence[str]] = (), step_ns: int = NCCL_STEP_NS):
        devices, width = len(endpoints), 1 + (len(lanes[0]) if lanes else 0)
        self.fabric = FlowFabric(graph, [*endpoints, *(gpu for more in lanes for gpu in more)], seed)
        # device d's GPUs as fabric endpoints: d itself, then its lanes after every device's first GPU
        self.lanes = [[d, *range(devices + d * (width - 1), devices + (d + 1) * (width - 1))]
                      for d in range(devices)] if width > 1 else None
        self.collectives = Collectives(self.fabric, algorithm, self.lanes, step_ns)
        self._src: list[int] = []
        self._dst: list[int] = []
        self._bytes: list[int] = []
        self.algorithms_used: dict[str, int] = {}
        self.fold: Fold | None = None  # alike replicas folded (``simulator.fold``), while such a replay runs

    def folding(self, fold: Fold | None) -> None:
        """Replay the replicas ``fold`` keeps, each collective over their edges alone (None: every replica's)."""
        self.fold = self.collectives.fold = fold

    def device_endpoints(self) -> list[list[int]]:
        """Per device, its GPUs' fabric endpoints: its first GPU, then its lanes."""
        return [list(lanes) for lanes in self.lanes] if self.lanes is not None else \
            [[d] for d in range(len(self.fabric.endpoints))]

    def bind(self, src: Sequence[int], dst: Sequence[int], nbytes: Sequence[int]) -> None:
        """Forget the last replay; NetworkError naming the first transfer that has no route."""
        self.fabric.reset()
        self.algorithms_used = {}
        self._src, self._dst, self._bytes = list(src), list(dst), list(nbytes)
        checked = set()
        for flow, pair in enumerate(zip(self._src, self._dst)):
            if pair[0] >= 0 and pair not in checked:
                checked.add(pair)
                for a, b in self._lane_pairs(*pair):
                    if self.fabric.route(a, b, 0) is None:
                        raise NetworkError(self._no_route(pair[0], pair[1], a, b), flow)

    def _lane_pairs(self, src: int, dst: int) -> list[tuple[int, int]]:
        """The endpoint pairs a transfer from device ``src`` to ``dst`` moves between: one per GPU of a device."""
        return [(src, dst)] if self.lanes is None else list(zip(self.lanes[src], self.lanes[dst]))

    def _no_route(self, src: int, dst: int, a: int, b: int) -> str:
        ends = self.fabric.endpoints
        return f"no route from device {src} ({ends[a]}) to device {dst} ({ends[b]})"

    def link_stats(self, makespan_ns: int) -> list[dict]:
        """Per directed edge that carried bytes: its ends, kind, bandwidth, bytes, busy time and utilisation (bytes
        over what the edge could carry in the run), busiest first."""
        fabric, stats, rows = self.fabric, self.fabric.stats, []
        for e, (a, b) in enumerate(fabric.names):
            if stats.nbytes[e]:
                bandwidth = fabric.capacity[e] * 1e9
                rows.append({"src": a, "dst": b, "kind": fabric.graph.edges[a, b].get("kind", ""),
                             "bandwidth_Bps": bandwidth, "bytes": stats.nbytes[e], "busy_s": stats.busy_ns[e] / 1e9,
                             "utilization": stats.nbytes[e] / (bandwidth * makespan_ns / 1e9) if makespan_ns else 0.0})
        return sorted(rows, key=lambda r: (-r["utilization"], r["src"], r["dst"]))

    def busy_spans(self, top: int = MAX_LINK_LANES) -> dict[str, list[tuple[int, int]]]:
        """The ``top`` busiest directed edges (by busy time), each as ``"a>b"``: its busy spans (start, end ns)."""
        stats, names = self.fabric.stats, self.fabric.names
        busiest = sorted((e for e in range(len(names)) if stats.busy_ns[e]), key=lambda e: (-stats.busy_ns[e], e))
        return {f"{names[e][0]}>{names[e][1]}": list(stats.busy_spans[e]) for e in busiest[:top]}

    def report(self, result: SimResult) -> None:
        """The links' statistics, the busiest links' busy spans and the flow counters, into ``result``."""
        result.links, result.network = self.link_stats(result.makespan_ns), self.counters()
        result.link_spans = self.busy_spans()

    def busiest_link_ns(self) -> int:
        """The most ns any directed edge needed for the bytes that crossed it, at its rate (what NCCL reaches)."""
        fabric = self.fabric
        return max((math.ceil(nbytes / fabric.capacity[e]) for e, nbytes in enumerate(fabric.stats.nbytes) if nbytes),
                   default=0)

    def counters(self) -> dict:
        """Flows started, rate updates and the collective algorithms the run used."""
        return {"flows": self.fabric.flows_started, "rate_updates": self.fabric.rate_updates,
                "collective_algorithms": dict(sorted(self.algorithms_used.items()))}

    def start_transfer(self, clock: Clock, now: int, flow: int) -> int:
        """Start a transfer; with lanes, its GPUs' slices move in lockstep as one flow over all their edges (an edge
        two slices cross counts twice), as a collective's phase does."""
        src, dst = self._src[flow], self._dst[flow]
        if self.fold is not None:
            for a, b in self._lane_pairs(src, dst):
                self.fold.transfer(a, b)
        if self.lanes is None:
            path = self.fabric.route(src, dst, flow)
        else:
            # a key per slice, as a collective's transfers have: each GPU's slice picks its own equal-cost path
            pairs = enumerate(self._lane_pairs(src, dst))
            paths = [self.fabric.route(a, b, part_key(flow, i)) for i, (a, b) in pairs]
            path = tuple(e for edges, _ in paths for e in edges), max(latency for _, latency in paths)
        self.fabric.start(clock, now, path, self._bytes[flow], lambda time: clock.finish_at(flow, time))
        return now

    def start_collective(self, clock: Clock, now: int, flow: int, kind: ActionKind, group: Sequence[int]) -> int:
        name, phases = self.collectives.choose(kind, group, self._bytes[flow])
        # a folded run's collective inside one replica stands for one in each replica of its kind
        runs = self.fold.runs_of(group) if self.fold is not None else 1
        self.algorithms_used[name] = self.algorithms_used.get(name, 0) + runs
        self.collectives.run(clock, now, flow, phases, lambda end: clock.finish_at(flow, end))
        return now


class IdleClock:
    """A clock for flows with nothing else running: ``pipescope collective`` and the network's own tests."""

    def __init__(self) -> None:
        self.ends: dict[int, int] = {}
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self._order = count()

    def finish_at(self, flow: int, time: int) -> None:
        self.ends[flow] = time

    def call_at(self, time: int, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._order), callback))

    def run(self) -> dict[int, int]:
        """Run every wake-up in time order; returns each flow's end."""
        while self._heap:
            _, _, callback = heapq.heappop(self._heap)
            callback()
        return self.ends


def time_alone(network: RoutedNetwork, transfers: Sequence[tuple[int, int, int, int]] = (),
               collective: tuple[ActionKind, Sequence[int], int] | None = None) -> dict[int, int]:
    """End times (ns) on an otherwise idle network of ``transfers`` (src, dst, bytes, start ns; flows 0..k-1) and
    of one ``collective`` (kind, group, bytes; flow k) started at 0."""
    src, dst, nbytes = ([t[i] for t in transfers] for i in range(3))
    if collective is not None:
        src, dst, nbytes = src + [-1], dst + [-1], nbytes + [collective[2]]
    network.bind(src, dst, nbytes)
    clock = IdleClock()
    for flow, (_, _, _, start) in enumerate(transfers):
        clock.call_at(start, lambda f=flow, t=start: network.start_transfer(clock, t, f))
    if collective is not None:
        clock.call_at(0, lambda: network.start_collective(clock, 0, len(transfers), collective[0],
                                                          list(collective[1])))
    return clock.run()


class IdleTimes:
    """``time_alone`` over the network ``network()`` builds, whose devices are the graph nodes ``endpoints``. With a
    ``key`` (what makes the network: its graph, link faults, ECMP seed and collective algorithm) each answer is
    remembered for the process under it and the graph nodes the flows run between: the paths and their ECMP choice
    depend on those alone, not on how the devices are numbered, so runs on one cluster price each group's
    collectives once (the planner prices thousands), and the network is built only for an answer not remembered.
    ``key`` None (a graph read from a file, which may change): nothing is remembered."""

    _known: dict[tuple, int] = {}
    MAX_KNOWN = 100_000  # answers kept before the memory starts over (each a few hundred bytes)

    def __init__(self, network: Callable[[], RoutedNetwork], endpoints: Sequence[str], key: Hashable | None = None):
        self._build, self._network, self._endpoints, self.key = network, None, endpoints, key

    @property
    def network(self) -> RoutedNetwork:
        """Built the first time an answer is not remembered (building one costs more than most answers)."""
        if self._network is None:
            self._network = self._build()
        return self._network

    def collective(self, kind: ActionKind, group: Sequence[int], nbytes: int) -> int:
        """ns of one ``kind`` of ``nbytes`` over ``group`` (devices of the network) alone."""
        return self._remembered(("collective", kind, self._names(group), nbytes),
                                lambda: time_alone(self.network, collective=(kind, group, nbytes))[0])

    def transfers(self, transfers: Sequence[tuple[int, int, int, int]]) -> int:
        """ns until the last of ``transfers`` (src, dst, bytes, start ns) ends, alone."""
        key = ("transfers", tuple((self._names((a, b)), n, t) for a, b, n, t in transfers))
        return self._remembered(key, lambda: max(time_alone(self.network, transfers).values(), default=0))

    def _names(self, devices: Sequence[int]) -> tuple[str, ...]:
        return tuple(self._endpoints[d] for d in devices)

    def _remembered(self, what: tuple, compute: Callable[[], int]) -> int:
        if self.key is None:
            return compute()
        known = IdleTimes._known
        key = (self.key, *what)
        if key not in known:
            if len(known) >= self.MAX_KNOWN:
                known.clear()
            known[key] = compute()
        return known[key]
