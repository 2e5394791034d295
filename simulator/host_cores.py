"""Ranks that share one host's CPU cores (``cluster.host_cores``): processor sharing, as the OS shares cores.

A GPU rank computes on its own device, so the engine gives every op its full duration. CPU ranks on one host take
turns on its cores: with n ops running on c cores, the scheduler gives each min(1, c / n) of a core. That is
max-min fair sharing, the network's own model, so each op here is a fluid flow of its duration (ns of work)
through two edges of a ``flows.FlowFabric``: its device's (capacity one core: an op never runs faster than alone)
and the host's (c cores). A run whose ops never outnumber the cores replays exactly as without it
(docs/validation.md, "More ranks than cores").
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

from pipescope.simulator.flows import FlowFabric
from pipescope.simulator.network import Clock

CORE = 1e9  # a core's capacity in the fabric's units (bytes/s there): one ns of work per ns


class SharedCores:
    """``cores`` cores shared by ``devices`` ranks' ops."""

    def __init__(self, devices: int, cores: int):
        graph = nx.DiGraph()
        for d in range(devices):
            graph.add_edge(f"rank{d}", "host", bandwidth=CORE, latency_ns=0)
        graph.add_edge("host", "cores", bandwidth=cores * CORE, latency_ns=0)
        self.fabric = FlowFabric(graph, [f"rank{d}" for d in range(devices)])
        host = self.fabric.edge_ids["host", "cores"]
        self.paths = [((self.fabric.edge_ids[f"rank{d}", "host"], host), 0) for d in range(devices)]

    def run(self, clock: Clock, now: int, device: int, work_ns: int, done: Callable[[int], None]) -> None:
        """Start an op of ``work_ns`` on ``device`` at ``now``; ``done(time)`` is called when it ends."""
        self.fabric.start(clock, now, self.paths[device], work_ns, done)
