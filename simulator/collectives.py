"""Collectives as phases of flows on the graph, and the algorithm NCCL would pick (docs/network.md).

A collective over a group of devices is a list of phases; a phase is a set of transfers that run at once and
end together. Pipelined algorithms (NCCL's ring and tree move the buffer in chunks, every link busy at once) are
modelled in bulk: each link of the ring or tree carries all the bytes it carries over the whole collective, the
links of a phase move in lockstep at one rate (one flow over all their edges in the fair share), and the phase
ends ``steps`` path latencies after it started draining plus its bytes' time, so a ring all-reduce on equal links
takes 2(n-1)/n * S/B + 2(n-1) latencies, the textbook figure, and a link that others share slows the whole
collective down. Each collective runs under the NCCL protocol that makes it faster: Simple pays NCCL's own time
per step (``NCCL_STEP_NS``), LL twice the bytes (``LL_WIRE_FACTOR``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from pipescope.simulator.flows import FlowFabric, NetworkError, max_min_rates, part_key
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.network import Clock

if TYPE_CHECKING:
    from pipescope.simulator.fold import Fold

K = ActionKind
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
# NCCL moves a collective with one of its protocols, the one its tuner expects to be faster (docs/network.md,
# "Protocols"). Simple, for large buffers, runs at the links' bandwidth and adds to each step beyond the path's
# latency what its chunk handshakes take: nccl-tests' all_reduce_perf on 8 A100s takes a median 185 us beyond its
# bytes at the 234.89 GB/s bus bandwidth it plateaus at, over 16 MiB to 16 GiB (stas00/ml-engineering
# network/README.md, "Real network throughput"); the ring's 14 steps of 1.5 us paths leave (185 - 21) / 14.
NCCL_STEP_NS = 11_700
FOR_A_COLLECTIVE = " for a collective"  # a route error's end where nothing says which (simulate names it)
# LL, for small buffers, adds nothing per step but sends each 8 bytes of data in a 16-byte line with its flags:
# twice the bytes on the wire (NCCL src/include/device.h's ncclLLFifoLine; its tuner takes busBw * .5 for LL).
LL_WIRE_FACTOR = 2


@dataclass(frozen=True)
class Phase:
    """Transfers (src device, dst device, bytes) that run together; ``steps`` latency-bound steps, each adding
    ``step_ns`` to its path's latency (the protocol's, ``Collectives.protocols``)."""

    transfers: tuple[tuple[int, int, int], ...]
    steps: int
    step_ns: int = 0

    @cached_property
    def largest(self) -> int:
        """The bytes of its largest transfer, which set when the lockstep phase drains (a wide phase's transfers are
        tens of thousands: found once, not at every bucket's start)."""
        return max(nb for _, _, nb in self.transfers)


def _ring_pairs(group: Sequence[int]) -> list[tuple[int, int]]:
    return list(zip(group, list(group[1:]) + list(group[:1])))


def ring(kind: ActionKind, group: Sequence[int], nbytes: int) -> list[Phase]:
    """Ring all-reduce (reduce-scatter then all-gather: 2(n-1) steps of S/n), all-gather and reduce-scatter (n-1
    steps of S/n); broadcast as a pipelined chain from ``group[0]`` (n-1 hops of the whole buffer)."""
    n = len(group)
    if n < 2:
        return []
    if kind is K.BROADCAST:
        return [Phase(tuple((a, b, nbytes) for a, b in zip(group, group[1:])), n - 1)]
    steps = 2 * (n - 1) if kind is K.ALL_REDUCE else n - 1
    per_link = math.ceil(steps * nbytes / n)
    return [Phase(tuple((a, b, per_link) for a, b in _ring_pairs(group)), steps)]


def tree(group: Sequence[int], nbytes: int) -> list[Phase]:
    """NCCL's double binary tree all-reduce: two binary trees (the second over the group shifted by one, so a
    rank interior in one is a leaf in the other) each reduce half the buffer up and broadcast it down, pipelined:
    every tree edge carries its half both ways at once, over 2 x depth latency steps."""
    n = len(group)
    if n < 2:
        return []
    half = math.ceil(nbytes / 2)
    transfers = []
    for order in (list(group), list(group[1:]) + list(group[:1])):
        for child in range(1, n):
            parent = (child - 1) // 2
            transfers += [(order[child], order[parent], half), (order[parent], order[child], half)]
    return [Phase(tuple(transfers), 2 * max(1, int(math.log2(n))))]


def hierarchical(kind: ActionKind, group: Sequence[int], nbytes: int, server_of: Sequence[int]) -> list[Phase] | None:
    """Intra-server reduce-scatter, an all-reduce of each 1/g slice across servers (g rings at once), intra-server
    all-gather. None unless the group spans several servers with the same number (> 1) of members on each."""
    servers: dict[int, list[int]] = {}
    for d in group:
        servers.setdefault(server_of[d], []).append(d)
    local = list(servers.values())
    g = len(local[0])
    if kind is not K.ALL_REDUCE or len(local) < 2 or g < 2 or any(len(members) != g for members in local):
        return None

    def within(part: ActionKind) -> Phase:
        phases = [ring(part, members, nbytes)[0] for members in local]
        return Phase(tuple(t for ph in phases for t in ph.transfers), phases[0].steps)

    across = [ring(K.ALL_REDUCE, [members[j] for members in local], math.ceil(nbytes / g))[0] for j in range(g)]
    return [within(K.REDUCE_SCATTER), Phase(tuple(t for ph in across for t in ph.transfers), across[0].steps),
            within(K.ALL_GATHER)]


def plans(kind: ActionKind, group: Sequence[int], nbytes: int, server_of: Sequence[int]) -> dict[str, list[Phase]]:
    """Every algorithm that applies to this collective, by name."""
    found = {"ring": ring(kind, group, nbytes)}
    if kind is K.ALL_REDUCE and len(group) > 2:
        found["tree"] = tree(group, nbytes)
    layered = hierarchical(kind, group, nbytes, server_of)
    if layered is not None:
        found["hierarchical"] = layered
    return found


def _under(phases: list[Phase], factor: int, step_ns: int) -> list[Phase]:
    """The phases under a protocol: each transfer's bytes times ``factor``, each step ``step_ns`` longer."""
    return [Phase(tuple((a, b, n * factor) for a, b, n in phase.transfers), phase.steps, step_ns) for phase in phases]


class Collectives:
    """Runs collectives as flows on a ``FlowFabric`` with a chosen or forced algorithm.

    ``auto`` prices every algorithm that applies on the idle network (fair-share rates of its own flows, plus its
    latency steps) and takes the fastest: NCCL's tuner does the same with its latency/bandwidth model per
    algorithm, so small buffers go to the tree (fewer latency steps) and large ones to the ring or the
    hierarchical algorithm. A forced algorithm that does not apply (a tree for a broadcast, hierarchical inside
    one server) falls back to the ring.
    """

    def __init__(self, fabric: FlowFabric, algorithm: str = "auto", lanes: Sequence[Sequence[int]] | None = None,
                 step_ns: int = NCCL_STEP_NS):
        """``lanes``: per device, its GPUs' endpoints under tensor parallelism (``RoutedNetwork``); each runs its own
        copy of the collective over the same GPU of every member, at once. ``step_ns``: what each step adds to its
        path's latency (0 on a graph of measured links, whose latencies hold NCCL's already)."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"got {algorithm!r}, expected one of {', '.join(ALGORITHMS)}")
        self.fabric, self.algorithm, self.lanes, self.step_ns = fabric, algorithm, lanes, step_ns
        self.device_of = {end: d for d, ends in enumerate(lanes or ()) for end in ends}  # a lane's GPU -> its device
        self.server_of = [fabric.graph.nodes[node].get("node", 0) for node in fabric.endpoints]
        self._chosen: dict[tuple, tuple[str, list[Phase]]] = {}
        self.fold: Fold | None = None  # alike replicas folded (simulator.fold): phases over the replayed ones' edges

    def choose(self, kind: ActionKind, group: Sequence[int], nbytes: int) -> tuple[str, list[Phase]]:
        """(algorithm name, phases) for this collective: of the algorithms that apply (or the one forced), under
        each protocol, the fastest on the idle network; an LL choice is named ``<algorithm>/LL``."""
        key = (kind, tuple(group), nbytes)
        known = self._chosen.get(key)
        if known is None:
            options = self.plans_of(kind, group, nbytes)
            if self.algorithm != "auto":
                options = {name: phases for name, phases in options.items()
                           if name == (self.algorithm if self.algorithm in options else "ring")}
            timed = {}  # name -> (estimate, phases); a plan's paths and rates are found once for both protocols
            for algorithm, plan in options.items():
                idle = [self._idle(phase) for phase in plan]
                for suffix, (factor, step_ns) in self.protocols().items():
                    estimate = sum(factor * bytes_s + steps * (hop + step_ns) for bytes_s, hop, steps in idle)
                    timed[algorithm + suffix] = (estimate, _under(plan, factor, step_ns))
            name = min(timed, key=lambda a: (timed[a][0], a))
            known = self._chosen[key] = (name, timed[name][1])
        return known

    def protocols(self) -> dict[str, tuple[int, int]]:
        """NCCL's Simple protocol (suffix '': the bytes as they are, each step ``step_ns`` more) and its LL protocol
        ('/LL': twice the bytes on the wire, no step time beyond the path's latency): (bytes factor, step ns)."""
        return {"": (1, self.step_ns), "/LL": (LL_WIRE_FACTOR, 0)}

    def plans_of(self, kind: ActionKind, group: Sequence[int], nbytes: int) -> dict[str, list[Phase]]:
        """``plans`` of the group; with lanes, every GPU's copy, phase by phase merged into one (the copies run at
        once, in lockstep: the same algorithm over GPUs of the same servers has the same phases)."""
        if self.lanes is None:
            return plans(kind, group, nbytes, self.server_of)
        copies = [plans(kind, [self.lanes[d][i] for d in group], nbytes, self.server_of)
                  for i in range(len(self.lanes[0]))]
        return {name: [Phase(tuple(t for phase in same for t in phase.transfers), same[0].steps)
                       for same in zip(*(copy[name] for copy in copies))] for name in copies[0]}

    def _idle(self, phase: Phase) -> tuple[float, int, int]:
        """A phase on an otherwise idle network, as ``run`` runs it (one lockstep flow): the ns its largest
        transfer's bytes take at the flow's rate, its slowest path's latency and its steps."""
        paths = [self._path(src, dst, 0, i) for i, (src, dst, _) in enumerate(phase.transfers)]
        rate = max_min_rates([[e for path, _ in paths for e in path]], self.fabric.capacity)[0]
        return phase.largest / rate, max(p[1] for p in paths), phase.steps

    def _path(self, src: int, dst: int, key: int, index: int) -> tuple[tuple[int, ...], int]:
        path = self.fabric.route(src, dst, part_key(key, index))
        if path is None:
            ends, device = self.fabric.endpoints, self.device_of
            raise NetworkError(f"no route from device {device.get(src, src)} ({ends[src]}) to device "
                               f"{device.get(dst, dst)} ({ends[dst]}){FOR_A_COLLECTIVE}", key)
        return path

    def run(self, clock: Clock, now: int, key: int, phases: list[Phase], done: Callable[[int], None]) -> None:
        """Start the phases one after another from ``now``; ``done(end)`` once the last one ends.

        A phase runs as one flow over all its transfers' edges (an edge two transfers cross counts twice): a
        pipelined ring or tree moves in lockstep at its slowest link's pace, so its links share one rate, and one
        flow instead of n keeps the fair-share updates of a 64-member ring at one per change instead of 64.
        """
        if not phases:
            done(now)
            return
        phase, rest = phases[0], phases[1:]
        if self.fold is not None:
            edges, hop = self.fold.phase(phase)
        else:
            paths = [self._path(src, dst, key, i) for i, (src, dst, _) in enumerate(phase.transfers)]
            hop = max(p[1] for p in paths)
            edges = tuple(e for path, _ in paths for e in path)

        def arrived(time: int) -> None:
            end = time + (phase.steps - 1) * hop + phase.steps * phase.step_ns
            if rest:
                clock.call_at(end, lambda: self.run(clock, end, key, rest, done))
            else:
                done(end)

        self.fabric.start(clock, now, (edges, hop), phase.largest, arrived)
