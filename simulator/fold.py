"""Folding: data-parallel replicas that do the same thing at the same time, simulated once per kind (docs/network.md,
"Folding identical replicas").

Without faults, every replica of a pipeline runs the same program. Where each replica also sits on servers of its
own, laid out alike (replica r's GPU for device d is replica 0's on the server ``r * shift`` further, with the same
name inside it), and the fabric is the same seen from every server (``ServerSymmetry``), replica r's transfers are
replica 0's renamed. What can still tell two replicas apart is the gradient collectives, which span all of them: a
ring crosses every replica's servers alike, but a double binary tree crosses an interior rank's servers more often
than a leaf's. So the replicas fall into classes by how often every collective crosses each of their servers' edges
(``classify``); replicas of one class load the same edges the same way and run at the same times, to the
nanosecond: max-min fair rates are unique, so a problem that is the same for two replicas gives them the same
rates, and each edge's share is the same float (the same capacity over the same count).

So one replica per class is simulated (the representatives), each collective running over the representatives'
edges alone: its rate is the least share over its edges, and every edge it drops has an equal one it keeps. The
other replicas take their representative's times and edge statistics, copied.

Anything that could break the symmetry leaves the run unfolded (``NotFoldable``, or ``Fold.of`` finding no fold): a
fabric edge (a spine) crossed, a pair of GPUs with several equal-cost paths (ECMP would hash each replica's flow
onto a path of its own), replicas sharing a server, faults, stragglers or jitter, HSDP's groups. The caller then
simulates every replica, as it would have without folding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pipescope.simulator.engine import RunTimes
from pipescope.simulator.flows import EdgeStats, FlowFabric

if TYPE_CHECKING:
    from pipescope.simulator.collectives import Phase

Transfers = Sequence[tuple[int, int, int]]  # a collective phase's (src endpoint, dst endpoint, bytes)


class NotFoldable(Exception):
    """The replicas are not alike after all: simulate every one (the message says why)."""


class Fold:
    """Which replicas are alike, and their results copied from one of each kind to the others."""

    def __init__(self, fabric: FlowFabric, devices: int, equivalent: np.ndarray, replica_of_edge: np.ndarray):
        self.fabric, self.devices = fabric, devices
        self.replicas = len(equivalent)
        self.equivalent = equivalent  # [replica, place]: the edge at that place among replica 0's servers' edges
        self.replica_of_edge = replica_of_edge  # per edge: the replica whose server holds it, -1 for the fabric's
        self.representative = list(range(self.replicas))  # per replica, the one simulated for it (``classify``)
        self._phases: dict[int, tuple[Phase, tuple[tuple[int, ...], int]]] = {}  # id(phase) -> (phase, path)
        self._pairs: set[tuple[int, int]] = set()  # transfer endpoint pairs already checked

    @classmethod
    def of(cls, fabric: FlowFabric, endpoints: Sequence[Sequence[int]], devices: int, replicas: int) -> Fold | None:
        """The fold of ``replicas`` replicas of ``devices`` devices each (device ``r * devices + d``), whose GPUs are
        the fabric endpoints ``endpoints[device]``; None where the servers or the fabric are not the same for every
        replica (``ServerSymmetry`` compares the servers' links by their latency, which routing needs: their
        bandwidths are compared here)."""
        symmetry = fabric.server_symmetry
        if symmetry is None or replicas < 2:
            return None
        names = fabric.endpoints
        server = [symmetry.server[name] for name in names]
        local = [symmetry.local[name] for name in names]
        base = [endpoints[d] for d in range(devices)]
        base_servers = sorted({server[e] for ends in base for e in ends})
        shift = server[endpoints[devices][0]] - server[base[0][0]]
        if base_servers[0] < 0 or shift <= base_servers[-1] - base_servers[0]:
            return None  # a GPU outside the servers, or replicas sharing a server
        for r in range(1, replicas):
            for d in range(devices):
                mine = endpoints[r * devices + d]
                if len(mine) != len(base[d]) or any(
                        server[e] != server[b] + r * shift or local[e] != local[b] for e, b in zip(mine, base[d])):
                    return None
        equivalent = np.array([[e for k in base_servers for e in symmetry.server_edges[k + r * shift]]
                               for r in range(replicas)], dtype=np.int64)
        capacity = np.asarray(fabric.capacity)[equivalent]
        if (capacity != capacity[0]).any():
            return None  # a link of some replica's servers degraded, or a file's servers that differ in bandwidth
        replica_of_edge = np.full(len(fabric.names), -1, dtype=np.int64)
        replica_of_edge[equivalent] = np.arange(replicas)[:, None]
        return cls(fabric, devices, equivalent, replica_of_edge)

    @property
    def simulated(self) -> list[int]:
        """The replicas simulated: one of each class, the lowest."""
        return sorted(set(self.representative))

    def classify(self, phases: Iterable[Transfers]) -> None:
        """Sort the replicas into classes by how often the phases of every collective that spans them (each phase's
        transfers) cross each of their servers' edges: replicas whose counts all agree are alike."""
        signatures: list[list[bytes]] = [[] for _ in range(self.replicas)]
        places = np.full(len(self.fabric.names), -1, dtype=np.int64)
        places[self.equivalent] = np.arange(self.equivalent.shape[1])[None, :]
        for transfers in phases:
            edges = self._edges(transfers)[0]
            replica = self.replica_of_edge[edges]
            if (replica < 0).any():
                raise NotFoldable("a collective crosses the fabric's shared switches (a spine)")
            counts = np.zeros(self.equivalent.shape, dtype=np.int64)  # [replica, place]: crossings
            np.add.at(counts, (replica, places[edges]), 1)
            for r in range(self.replicas):
                signatures[r].append(counts[r].tobytes())
        first: dict[tuple[bytes, ...], int] = {}
        self.representative = [first.setdefault(tuple(signature), r) for r, signature in enumerate(signatures)]

    def within_replica(self, group: Sequence[int]) -> bool:
        """A collective over one replica's devices alone (clipping's norm): every replica of its class runs one."""
        return len({device // self.devices for device in group}) == 1

    def runs_of(self, group: Sequence[int]) -> int:
        """How many collectives of the whole run a folded one over ``group`` stands for."""
        if not self.within_replica(group):
            return 1
        mine = self.representative[group[0] // self.devices]
        return sum(1 for rep in self.representative if rep == mine)

    def transfer(self, src: int, dst: int) -> None:
        """NotFoldable unless the transfer between endpoints ``src`` and ``dst`` has one path, inside its replica's
        servers (each replica of its class then takes its own copy of it)."""
        if (src, dst) in self._pairs:
            return
        edges, _ = self._edges([(src, dst, 0)])
        owners = set(self.replica_of_edge[edges].tolist())
        if len(owners) > 1 or -1 in owners:
            raise NotFoldable(f"the path from {self.fabric.endpoints[src]} to {self.fabric.endpoints[dst]} leaves "
                              f"its replica's servers")
        self._pairs.add((src, dst))

    def phase(self, phase: Phase) -> tuple[tuple[int, ...], int]:
        """A collective phase's edges on the simulated replicas' servers, and its slowest path's latency, once per
        phase (a collective's phases are the same objects bucket after bucket: ``Collectives.choose`` keeps them)."""
        known = self._phases.get(id(phase))
        if known is not None and known[0] is phase:
            return known[1]
        edges, hop = self._edges(phase.transfers)
        replica = self.replica_of_edge[edges]
        if (replica < 0).any():
            raise NotFoldable("a collective crosses the fabric's shared switches (a spine)")
        kept = np.isin(replica, self.simulated)
        folded = (tuple(edges[kept].tolist()), hop)
        self._phases[id(phase)] = (phase, folded)
        return folded

    def _edges(self, transfers: Transfers) -> tuple[np.ndarray, int]:
        """Every edge the transfers cross (an edge crossed twice listed twice), and the slowest path's latency;
        NotFoldable where a pair has several equal-cost paths."""
        paths = []
        for src, dst, _ in transfers:
            routes = self.fabric.routes(src, dst)
            if len(routes) != 1:
                raise NotFoldable(f"{len(routes)} equal-cost paths between {self.fabric.endpoints[src]} and "
                                  f"{self.fabric.endpoints[dst]}: ECMP would not pick alike for every replica")
            paths.append(routes[0])
        edges = np.fromiter((e for path, _ in paths for e in path), dtype=np.int64)
        return edges, max(latency for _, latency in paths)

    def expand_stats(self, stats: EdgeStats) -> None:
        """Every replica's edges given its representative's bytes, busy time and busy spans."""
        for r, rep in enumerate(self.representative):
            if rep == r:
                continue
            for copy, e in zip(self.equivalent[r].tolist(), self.equivalent[rep].tolist()):
                if stats.nbytes[e]:
                    stats.nbytes[copy], stats.busy_ns[copy] = stats.nbytes[e], stats.busy_ns[e]
                    if e in stats.busy_spans:
                        stats.busy_spans[copy] = list(stats.busy_spans[e])

    def expand_times(self, times: RunTimes, entries: int, flows: int) -> RunTimes:
        """The whole run's times from the simulated replicas': each replica's entries and transfers take its
        representative's, and so does its member of each collective (``replicas.data_parallel`` numbers the entries
        replica by replica, then each collective's members in replica order; the flows replica by replica, then one
        per collective)."""
        simulated = self.simulated
        slot = np.array([simulated.index(rep) for rep in self.representative])  # per replica, its folded position
        k = len(simulated)

        def whole(values: list[int], per_replica: int, members: bool) -> list[int]:
            array = np.asarray(values, dtype=np.int64)
            own = array[:k * per_replica].reshape(k, per_replica)[slot].reshape(-1)
            rest = array[k * per_replica:]
            return np.concatenate([own, rest.reshape(-1, k)[:, slot].reshape(-1) if members else rest]).tolist()

        stalls = {r * entries + i % entries: spans for r in range(self.replicas)
                  for i, spans in times.stalls.items() if i < k * entries and i // entries == slot[r]}
        return RunTimes(whole(times.entry_start, entries, True), whole(times.entry_end, entries, True),
                        whole(times.flow_start, flows, False), whole(times.flow_end, flows, False), stalls)


def spanning_phases(collectives: Iterable[tuple], choose: Callable, devices: int) -> list[Transfers]:
    """The phases (as transfers) of every distinct collective among ``collectives`` (kind, group, bytes) that spans
    more than one replica of ``devices`` devices, as ``choose`` (``Collectives.choose``) runs it."""
    found: dict[tuple, None] = {}
    for kind, group, nbytes in collectives:
        if len({d // devices for d in group}) > 1:
            found[(kind, tuple(group), nbytes)] = None
    return [phase.transfers for key in found for phase in choose(*key)[1]]
