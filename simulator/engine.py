"""The SimPy engine: one process per device stream replays the lowered program; the network moves the data.

A compute entry waits for its input signals, then holds the stream for its duration. A SEND asks the network to
start its transfer and goes on (torch's ``isend``); a RECV is posted without blocking and its consumer waits for the
arrival (torch's ``irecv`` and the wait before the op). A collective blocks each member until the network says it
ended; it starts when the last member joins. The clock is integer nanoseconds. Four choices keep the event count
at one Timeout per op and per flow, or fewer: a consumer waits on the event that will produce its input (the
producer's running Timeout, then the flow's), so a fresh event is made only when that has not started; a flow's end
is a Timeout whose callback fires it, not a generator resume; a flow that ends the instant it starts (a
zero-delay transfer) ends at once, with no event; and on FIFO links, whose first answer is final, a transfer's
arrival is only noted, and becomes an event when something waits for it before it arrives (in 1F1B p = 64, m = 512,
32,193 of 64,512 transfers needed none).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import simpy

from pipescope.simulator.ir import COMPUTE_KINDS, Role, ScheduleError
from pipescope.simulator.network import Network
from pipescope.simulator.program import Program

if TYPE_CHECKING:
    from pipescope.simulator.host_cores import SharedCores


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector, restoring its state after.

    Compiling and replaying allocate hundreds of thousands of small acyclic objects; the collector's
    repeated generation scans of them cost a quarter of the run and find nothing to free.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class RunTimes:
    """What a replay measured (ns): each compute and collective entry's start and end (-1 for the others, which
    take no stream time), and each flow's (a transfer, or a collective from its last member's join); ``stalls``:
    per op run unit by unit (``Program.segments``), the (from, to) of each wait between its segments."""

    entry_start: list[int]
    entry_end: list[int]
    flow_start: list[int]
    flow_end: list[int]
    stalls: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


Progress = Callable[[int, int], None]  # (entries ended, entries): told every PROGRESS_EVERY events and at the end
PROGRESS_EVERY = 1_000  # SimPy events between reports: a few ms, but seconds late in a large routed run


class Engine:
    """Replays a compiled program in SimPy over a network and reports entry and flow times."""

    def __init__(self, program: Program, network: Network, cores: SharedCores | None = None,
                 progress: Progress | None = None):
        self.p, self.network, self.cores = program, network, cores  # cores: CPU ranks sharing a host's cores
        self.flow_joins = program.flow_joins  # HSDP: per flow, the members that join others when it ends
        self.progress = progress
        self.ended = 0  # compute and collective entries that ended
        self.n = n = program.num_entries
        signals = n + program.num_flows
        self.env = simpy.Environment()
        self.fired = [False] * signals
        self.pending: list[simpy.Event | None] = [None] * signals
        self.waiter: list[simpy.Event | None] = [None] * signals
        self.joined = [0] * program.num_flows
        self.times = RunTimes([-1] * n, [-1] * n, [-1] * program.num_flows, [-1] * program.num_flows)
        # per signal, a transfer's arrival where the network's first answer is final (FIFO links): it fires when
        # something waits for it, with an event only if that is before it arrives (``_event_for``)
        self.due: list[int] | None = [-1] * signals if network.final_answers else None

    def run(self) -> RunTimes:
        """Replay to the end; ScheduleError naming the stuck actions if it cannot finish."""
        self.network.bind(self.p.flow_src, self.p.flow_dst, self.p.flow_bytes)
        for flow, offset in self.p.start_joins:
            if offset:
                self.call_at(offset, lambda f=flow: self.join(f))
            else:
                self.join(flow)
        for d, steps in enumerate(self.p.device_steps):
            if steps:
                self.env.process(self._stream(d, steps))
        with gc_paused():
            if self.progress is None:
                self.env.run()
            else:
                self._run_reporting(self.progress)
        stuck = self._stuck()
        if stuck:
            raise ScheduleError(["deadlock: " + line for line in stuck])
        return self.times

    def _run_reporting(self, progress: Progress) -> None:
        """``env.run()``, telling ``progress`` how far it got every PROGRESS_EVERY events."""
        total, step = sum(map(len, self.p.device_steps)), self.env.step
        try:
            while True:
                for _ in range(PROGRESS_EVERY):
                    step()
                progress(self.ended, total)
        except simpy.core.EmptySchedule:
            progress(self.ended, total)

    def finish_at(self, flow: int, time: int) -> None:
        """The network's answer: ``flow`` ends at ``time`` (a later answer replaces an earlier one). A flow that ends
        now (a zero-delay transfer: every transfer of the closed forms' runs) ends at once, without an event: what
        waits for it resumes at this same instant either way."""
        if time == self.env.now:
            self._end_flow(flow)
            return
        signal = self.n + flow
        if self.due is not None and self.p.flow_src[flow] >= 0 and self.waiter[signal] is None:
            # a transfer whose end is final, which nothing waits for yet: no event until something does
            self.times.flow_end[flow] = self.due[signal] = time
            return
        event = self.env.timeout(time - self.env.now, flow)
        event.callbacks.append(self._flow_ended)
        self.pending[signal] = event

    def call_at(self, time: int, callback: Callable[[], None]) -> None:
        """The network's own wake-up at ``time``."""
        self.env.timeout(time - self.env.now).callbacks.append(lambda _: callback())

    def _flow_ended(self, event: simpy.Event) -> None:
        if self.pending[self.n + event.value] is event:  # else re-planned: a newer answer stands for this flow
            self._end_flow(event.value)

    def _end_flow(self, flow: int) -> None:
        self.times.flow_end[flow] = self.env.now
        self._fire(self.n + flow)
        if self.flow_joins:
            for later in self.flow_joins.get(flow, ()):
                self.join(later)

    def _fire(self, signal: int) -> None:
        self.fired[signal] = True
        self.pending[signal] = None
        event = self.waiter[signal]
        if event is not None:
            event.succeed()

    def _event_for(self, signal: int) -> simpy.Event | None:
        """The soonest existing event after which ``signal`` may have fired; None where it fires now (a transfer
        that arrived while nothing waited for it)."""
        event = self.pending[signal]
        if event is None and self.due is not None and self.due[signal] >= 0:
            due, now = self.due[signal], self.env.now
            if due <= now:
                self._fire(signal)
                return None
            event = self.pending[signal] = self.env.timeout(due - now)
            event.callbacks.append(lambda _: self._fire(signal))
            return event
        if event is None and signal >= self.n:
            producer = self.p.flow_producer[signal - self.n]
            event = self.pending[producer] if producer >= 0 else None
        if event is None:
            event = self.waiter[signal]
            if event is None:
                event = self.waiter[signal] = self.env.event()
        return event

    def _stream(self, device: int, steps: list[int]):
        env, p, fired, times, pending, waiter = self.env, self.p, self.fired, self.times, self.pending, self.waiter
        role, waits, duration, launches, flow_of = p.role, p.waits, p.duration, p.launches, p.flow_of
        start_transfer, cores = self.network.start_transfer, self.cores
        compute, joins, segments = Role.COMPUTE, p.joins, p.segments
        for i in steps:
            if role[i] is compute:
                for signal in waits[i]:
                    while not fired[signal]:
                        event = self._event_for(signal)
                        if event is None:
                            break
                        yield event
                times.entry_start[i] = env.now
                if i in joins:
                    for flow, offset in joins[i]:
                        self.call_at(env.now + offset, lambda f=flow: self.join(f))
                if i in segments:
                    yield from self._segments(i, device)
                elif cores is None:  # the common case, inlined: this runs once per op
                    pending[i] = timeout = env.timeout(duration[i])
                    yield timeout
                else:
                    yield self._hold(i, device, duration[i])
                fired[i], pending[i] = True, None  # _fire, inlined: this runs once per op
                if waiter[i] is not None:
                    waiter[i].succeed()
            else:
                times.entry_start[i] = env.now
                yield from self._collective(flow_of[i])
            now = times.entry_end[i] = env.now
            self.ended += 1
            for f in launches[i]:  # the SENDs after it: torch's isend, the stream goes on
                times.flow_start[f] = start_transfer(self, now, f)

    def _hold(self, i: int, device: int, ns: int) -> simpy.Event:
        """The event that ends ``ns`` of entry ``i``'s work from now, which its consumers wait on (``pending``)."""
        if self.cores is None:
            self.pending[i] = timeout = self.env.timeout(ns)
        else:  # the op's work at the share of a core the host gives it (simulator.host_cores)
            self.pending[i] = timeout = self.env.event()
            self.cores.run(self, self.env.now, device, ns, lambda t, e=timeout: self.call_at(t, e.succeed))
        return timeout

    def _segments(self, i: int, device: int):
        """An op run unit by unit: each segment after its own signals (a wait between two is a stall of the op),
        its device's members joining what its start launches."""
        env, p = self.env, self.p
        for j, ns in enumerate(p.segments[i]):
            if j:
                waited = env.now
                for signal in p.segment_waits.get((i, j), ()):
                    while not self.fired[signal]:
                        event = self._event_for(signal)
                        if event is None:
                            break
                        yield event
                if env.now > waited:
                    self.times.stalls.setdefault(i, []).append((waited, env.now))
                for flow, offset in p.segment_joins.get((i, j), ()):
                    self.call_at(env.now + offset, lambda f=flow: self.join(f))
            yield self._hold(i, device, ns)
            self.pending[i] = None  # consumers waiting across a stall wait on ``waiter``, not an event gone by

    def join(self, flow: int) -> None:
        """A member joins collective ``flow``; the last one to join starts it."""
        self.joined[flow] += 1
        collective = self.p.flow_collective[flow]
        if self.joined[flow] == self.p.joiners.get(flow, len(collective.group)):
            self.times.flow_start[flow] = self.network.start_collective(self, self.env.now, flow, collective.kind,
                                                                        collective.group)

    def _collective(self, flow: int):
        """Join; every member waits for its end."""
        self.join(flow)
        signal = self.n + flow
        while not self.fired[signal]:
            yield self._event_for(signal)

    def _stuck(self) -> list[str]:
        """Each unfinished device's first op that did not end, and what it waits for."""
        lines, p = [], self.p
        for device, steps in enumerate(p.device_steps):
            k = next((k for k, i in enumerate(steps) if self.times.entry_end[i] < 0), None)
            if k is None:
                continue
            i = steps[k]
            waiting = [self._signal_name(s) for s in p.waits[i] if not self.fired[s]]
            if p.role[i] is Role.COLLECTIVE:
                f = p.flow_of[i]
                waiting = [f"{len(p.flow_collective[f].group)} members ({self.joined[f]} joined)"]
            position = sum(1 for j in steps[:k] if p.actions[j].kind in COMPUTE_KINDS)
            lines.append(f"device {device} op {position}: {p.actions[i]} waits for {', '.join(waiting)}")
        return lines

    def _signal_name(self, signal: int) -> str:
        if signal < self.n:
            return str(self.p.actions[signal])
        producer = self.p.flow_producer[signal - self.n]
        return f"{self.p.actions[producer]} (transfer)"
