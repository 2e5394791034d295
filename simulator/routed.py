"""``RoutedNetwork``: the engine's ``Network`` on a graph of the interconnect, transfers and collectives as routed,
fair-shared flows (``simulator.flows``, ``simulator.collectives``; docs/network.md)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from itertools import count

import networkx as nx

from pipescope.simulator.collectives import Collectives
from pipescope.simulator.flows import FlowFabric, NetworkError
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.network import Clock


MAX_LINK_LANES = 16  # busiest links a result keeps spans of (for the trace's and Gantt's link lanes)


class RoutedNetwork:
    """Transfers routed over ``graph`` between the nodes ``endpoints[device]``; collectives by ``algorithm``.

    Args:
        graph: directed edges with ``bandwidth`` (bytes/s) and ``latency_ns``; GPU nodes may carry ``node``
            (their server), which the hierarchical all-reduce groups by.
        endpoints: the graph node each device runs on.
        seed: picks among equal-cost paths (ECMP), per flow.
        algorithm: ``auto`` (the fastest on the idle network, as NCCL's tuner) or ``ring``/``tree``/``hierarchical``.
    """

    def __init__(self, graph: nx.DiGraph, endpoints: Sequence[str], seed: int = 0, algorithm: str = "auto"):
        self.fabric = FlowFabric(graph, endpoints, seed)
        self.collectives = Collectives(self.fabric, algorithm)
        self._src: list[int] = []
        self._dst: list[int] = []
        self._bytes: list[int] = []
        self.algorithms_used: dict[str, int] = {}

    def bind(self, src: Sequence[int], dst: Sequence[int], nbytes: Sequence[int]) -> None:
        """Forget the last replay; NetworkError naming the first transfer that has no route."""
        self.fabric.reset()
        self.algorithms_used = {}
        self._src, self._dst, self._bytes = list(src), list(dst), list(nbytes)
        checked = set()
        for flow, pair in enumerate(zip(self._src, self._dst)):
            if pair[0] >= 0 and pair not in checked:
                checked.add(pair)
                if not self.fabric.routes(*pair):
                    raise NetworkError(self._no_route(*pair), flow)

    def _no_route(self, src: int, dst: int) -> str:
        ends = self.fabric.endpoints
        return f"no route from device {src} ({ends[src]}) to device {dst} ({ends[dst]})"

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

    def counters(self) -> dict:
        """Flows started, rate updates and the collective algorithms the run used."""
        return {"flows": self.fabric.flows_started, "rate_updates": self.fabric.rate_updates,
                "collective_algorithms": dict(sorted(self.algorithms_used.items()))}

    def start_transfer(self, clock: Clock, now: int, flow: int) -> int:
        path = self.fabric.route(self._src[flow], self._dst[flow], flow)
        self.fabric.start(clock, now, path, self._bytes[flow], lambda time: clock.finish_at(flow, time))
        return now

    def start_collective(self, clock: Clock, now: int, flow: int, kind: ActionKind, group: Sequence[int]) -> int:
        name, phases = self.collectives.choose(kind, group, self._bytes[flow])
        self.algorithms_used[name] = self.algorithms_used.get(name, 0) + 1
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
