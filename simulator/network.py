"""The network seam: the engine starts transfers and collectives here and is told when each one ends.

The cost model answers only how long compute takes; how long data takes to move is the network's question. A
``Network`` is handed a ``Clock`` (the engine, or the test oracle) and calls ``clock.finish_at(flow, time)`` once it
knows when a flow ends; it may call it again for the same flow with a new time, and the clock keeps only the latest;
``clock.call_at(time, callback)`` wakes the network for its own events. ``FifoLinks`` is one FIFO link per directed
device pair (the plain timing model's fixed delay, and a comms profile's fitted p2p link); ``simulator.routed``'s
``RoutedNetwork`` routes fair-shared flows over the graph of a cluster (docs/network.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pipescope.simulator.ir import ActionKind

if TYPE_CHECKING:
    from pipescope.simulator.result import SimResult


@dataclass(frozen=True)
class Link:
    """A path between two devices: the slowest bandwidth on it (bytes/s) and its total latency."""

    bandwidth: float
    latency_ns: int


def link_occupancy_ns(nbytes: int, link: Link) -> int:
    """Bytes over bandwidth, rounded up: how long a transfer keeps the link from the next one."""
    return math.ceil(nbytes * 1e9 / link.bandwidth) if nbytes > 0 else 0


def link_transfer_ns(nbytes: int, link: Link) -> int:
    """Latency plus bytes over bandwidth: from a transfer's start to its arrival (0 for an empty one)."""
    return link.latency_ns + link_occupancy_ns(nbytes, link) if nbytes > 0 else 0


class Clock(Protocol):
    """What a network needs from whoever replays the program."""

    def finish_at(self, flow: int, time: int) -> None:
        """Flow ``flow`` ends at ``time`` (>= now); a later call for the same flow replaces the earlier one."""
        ...

    def call_at(self, time: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` at ``time`` (>= now), after what is already due then: a network's own events
        (a flow drained, a collective's next phase)."""
        ...


class Network(Protocol):
    """Starts transfers and collectives; flows are numbered by the caller, transfers and collectives alike."""

    final_answers: bool  # True: a transfer's first ``finish_at`` is never revised (FIFO links), so a replay needs
    # no event for its arrival until something waits for it (``engine.Engine._event_for``)

    def bind(self, src: Sequence[int], dst: Sequence[int], nbytes: Sequence[int]) -> None:
        """Before a replay: the flows it will start (transfers: sender, receiver, bytes; collectives: -1, -1, bytes).
        Forgets every link's state from an earlier replay."""
        ...

    def start_transfer(self, clock: Clock, now: int, flow: int) -> int:
        """Start transfer ``flow`` at ``now``; returns when its bytes start to move."""
        ...

    def start_collective(self, clock: Clock, now: int, flow: int, kind: ActionKind, group: Sequence[int]) -> int:
        """Run collective ``flow`` over ``group`` at ``now`` (every member has joined); returns its start."""
        ...

    def report(self, result: SimResult) -> None:
        """After a replay: write what the network alone knows into ``result`` (its links' statistics, busy spans
        and counters); a network that keeps none writes nothing."""
        ...

    def busiest_link_ns(self) -> int:
        """After a replay: the ns its busiest shared link needs to carry the bytes it carried, at its rate (0: a
        network without shared links). A run of several iterations takes at least this over the iterations per
        iteration (``result.iteration_times``)."""
        ...


TransferTiming = Callable[[int, int, int], tuple[int, int]]
"""(src, dst, nbytes) -> (ns from start to arrival, ns the link stays busy)."""

# Ring algorithms: steps of nbytes/n each, the count nccl-tests' bus-bandwidth factors assume.
RING_STEPS: dict[ActionKind, Callable[[int], int]] = {
    ActionKind.ALL_REDUCE: lambda n: 2 * (n - 1),
    ActionKind.ALL_GATHER: lambda n: n - 1,
    ActionKind.REDUCE_SCATTER: lambda n: n - 1,
    ActionKind.BROADCAST: lambda n: n - 1,
}


@dataclass
class FifoLinks:
    """One FIFO link per directed device pair.

    A transfer starts once the link has serialised the earlier ones (their occupancy, bytes over bandwidth) and
    arrives its full time (latency included) after it starts, so latencies overlap but bandwidth is shared in order.
    With zero occupancy (``fixed_delay``) a transfer is a pure delay, as in docs/schedules.md section 0. A
    collective runs as a ring over its group in the given order, each step as long as the slowest hop's transfer
    of nbytes/n; it does not hold the links (the fair-share model will).
    """

    timing: TransferTiming
    final_answers = True  # a transfer's end is known when it starts: its link's queue and its own duration
    _cache: dict[tuple[int, int, int], tuple[int, int]] = field(default_factory=dict, repr=False)
    _free_at: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)
    _link: list[tuple[int, int]] = field(default_factory=list, repr=False)  # per flow, from bind()
    _bytes: list[int] = field(default_factory=list, repr=False)
    _duration: list[int] = field(default_factory=list, repr=False)
    _occupancy: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def over(cls, link_of: Callable[[int, int], Link]) -> FifoLinks:
        """Links with the bandwidth and latency ``link_of(src, dst)`` gives."""
        def timing(src: int, dst: int, nbytes: int) -> tuple[int, int]:
            link = link_of(src, dst)
            return link_transfer_ns(nbytes, link), link_occupancy_ns(nbytes, link)
        return cls(timing)

    @classmethod
    def fixed_delay(cls, delay_ns: int) -> FifoLinks:
        """Every transfer takes ``delay_ns`` and holds nothing: the plain timing model's p2p time."""
        return cls(lambda src, dst, nbytes: (delay_ns, 0))

    def bind(self, src: Sequence[int], dst: Sequence[int], nbytes: Sequence[int]) -> None:
        self._free_at.clear()
        self._link = list(zip(src, dst))
        self._bytes = list(nbytes)
        # Time each distinct (src, dst, bytes) once: a pipeline has few, however many flows it starts.
        flows = np.array([src, dst, nbytes], dtype=np.int64).reshape(3, -1)
        order = np.lexsort(flows[::-1])
        new_group = np.ones(len(order), dtype=bool)
        new_group[1:] = (np.diff(flows[:, order], axis=1) != 0).any(axis=0)
        group = np.empty(len(order), dtype=np.int64)
        group[order] = np.cumsum(new_group) - 1
        distinct = flows[:, order[new_group]].T.tolist()
        timed = np.array([self.times(a, b, n) if a >= 0 else (0, 0) for a, b, n in distinct],
                         dtype=np.int64).reshape(-1, 2)
        self._duration, self._occupancy = timed[group, 0].tolist(), timed[group, 1].tolist()

    def times(self, src: int, dst: int, nbytes: int) -> tuple[int, int]:
        """(duration, occupancy) of one transfer, computed once per (src, dst, nbytes)."""
        key = (src, dst, nbytes)
        known = self._cache.get(key)
        if known is None:
            known = self._cache[key] = self.timing(src, dst, nbytes)
        return known

    def start_transfer(self, clock: Clock, now: int, flow: int) -> int:
        link, free_at = self._link[flow], self._free_at
        start = max(now, free_at.get(link, 0))
        free_at[link] = start + self._occupancy[flow]
        clock.finish_at(flow, start + self._duration[flow])
        return start

    def start_collective(self, clock: Clock, now: int, flow: int, kind: ActionKind, group: Sequence[int]) -> int:
        n, nbytes = len(group), self._bytes[flow]
        step = max((self.times(a, b, math.ceil(nbytes / n))[0] for a, b in zip(group, group[1:] + group[:1])),
                   default=0) if n > 1 else 0
        clock.finish_at(flow, now + RING_STEPS[kind](n) * step)
        return now

    def report(self, result: SimResult) -> None:
        """FIFO links keep no statistics: the result's link fields stay empty."""

    def busiest_link_ns(self) -> int:
        """0: each device pair has a link of its own, which no other pair's transfers share."""
        return 0
