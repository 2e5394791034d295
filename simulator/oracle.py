"""The test oracle: the engine's replay as a plain heapq event loop, no SimPy.

It walks the same compiled program over the same network with the same rules, so the tests hold the engine to it to
the nanosecond, and ``pipescope bench`` uses it as the speed floor (the ratio prices SimPy's processes and events).
Test and benchmark code: the simulator itself never calls it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from pipescope.simulator.engine import RunTimes
from pipescope.simulator.ir import Role, ScheduleError
from pipescope.simulator.network import Network
from pipescope.simulator.program import Program


class Oracle:
    """Replays ``program``; ``run()`` returns the same RunTimes the engine does."""

    def __init__(self, program: Program, network: Network):
        self.p, self.network = program, network
        self.heap: list[tuple[int, int]] = []  # (time, signal): op ends are signals < n, flow ends n + flow
        self.due = [-1] * program.num_flows  # a flow's latest planned end: earlier heap entries are stale
        # The network's wake-ups, as signals past every entry and flow: after what is due at the same time, in order.
        self.callbacks: dict[int, Callable[[], None]] = {}
        self.next_callback = program.num_entries + program.num_flows

    def finish_at(self, flow: int, time: int) -> None:
        self.due[flow] = time
        heapq.heappush(self.heap, (time, self.p.num_entries + flow))

    def call_at(self, time: int, callback: Callable[[], None]) -> None:
        self.callbacks[self.next_callback] = callback
        heapq.heappush(self.heap, (time, self.next_callback))
        self.next_callback += 1

    def run(self) -> RunTimes:
        p, network, heap, due = self.p, self.network, self.heap, self.due
        n, steps, role, waits, duration, device = p.num_entries, p.device_steps, p.role, p.waits, p.duration, p.device
        times = RunTimes([-1] * n, [-1] * n, [-1] * p.num_flows, [-1] * p.num_flows)
        fired, joined = [False] * (n + p.num_flows), [0] * p.num_flows
        cursor, busy, waiting = [0] * len(steps), [False] * len(steps), {}
        # ops run unit by unit: per device between two segments of its op, the segment it waits to run and since when
        paused: dict[int, tuple[int, int]] = {}
        collective, launches, flow_of, start_transfer = Role.COLLECTIVE, p.launches, p.flow_of, network.start_transfer
        entry_start, push = times.entry_start, heapq.heappush
        first_callback = n + p.num_flows
        network.bind(p.flow_src, p.flow_dst, p.flow_bytes)

        def done(d: int, i: int, now: int) -> None:
            times.entry_end[i] = now
            cursor[d] += 1
            for f in launches[i]:
                times.flow_start[f] = start_transfer(self, now, f)
            advance(d, now)

        def join(f: int, now: int) -> None:
            joined[f] += 1
            c = p.flow_collective[f]
            if joined[f] == p.joiners.get(f, len(c.group)):
                times.flow_start[f] = network.start_collective(self, now, f, c.kind, c.group)

        def run_segment(d: int, i: int, j: int, now: int, since: int) -> None:
            """Segment j of op i, ready since ``since``: after its signals (the wait is a stall), then its joins and
            its time."""
            for signal in p.segment_waits.get((i, j), ()) if j else ():
                if not fired[signal]:
                    waiting.setdefault(signal, []).append(d)
                    paused[d] = (j, since)
                    return
            paused.pop(d, None)
            if now > since:
                times.stalls.setdefault(i, []).append((since, now))
            for f, offset in p.segment_joins.get((i, j), ()) if j else ():
                self.call_at(now + offset, lambda f=f, t=now + offset: join(f, t))
            busy[d] = True
            end = now + p.segments[i][j]
            if j == len(p.segments[i]) - 1:
                push(heap, (end, i))
            else:
                self.call_at(end, lambda: next_segment(d, i, j + 1, end))

        def next_segment(d: int, i: int, j: int, now: int) -> None:
            busy[d] = False
            run_segment(d, i, j, now, now)

        def advance(d: int, now: int) -> None:
            if d in paused:  # an op between two of its segments, waiting for the next one's signals
                j, since = paused[d]
                run_segment(d, steps[d][cursor[d]], j, now, since)
                return
            if busy[d] or cursor[d] >= len(steps[d]):
                return
            i = steps[d][cursor[d]]
            if role[i] is collective:
                f = flow_of[i]
                if entry_start[i] < 0:
                    entry_start[i] = now
                    join(f, now)
                if not fired[n + f]:
                    waiting.setdefault(n + f, []).append(d)
                    return
                done(d, i, now)
                return
            for signal in waits[i]:
                if not fired[signal]:
                    waiting.setdefault(signal, []).append(d)
                    return
            entry_start[i] = now
            for f, offset in p.joins.get(i, ()):
                self.call_at(now + offset, lambda f=f, t=now + offset: join(f, t))
            if i in p.segments:
                run_segment(d, i, 0, now, now)
                return
            busy[d] = True
            push(heap, (now + duration[i], i))

        for f, offset in p.start_joins:
            if offset:
                self.call_at(offset, lambda f=f, t=offset: join(f, t))
            else:
                join(f, 0)
        for d in range(len(steps)):
            advance(d, 0)
        while heap:
            now, signal = heapq.heappop(heap)
            if signal >= first_callback:
                self.callbacks.pop(signal)()
                continue
            if signal >= n:
                if fired[signal] or due[signal - n] != now:
                    continue  # re-planned: a later entry stands for this flow
                times.flow_end[signal - n] = now
                for later in p.flow_joins.get(signal - n, ()):
                    join(later, now)
            fired[signal] = True
            if signal < n:
                busy[device[signal]] = False
                done(device[signal], signal, now)
            for d in waiting.pop(signal, ()):
                advance(d, now)
        stuck = [f"device {d} step {c}: {p.actions[steps[d][c]]}" for d, c in enumerate(cursor) if c < len(steps[d])]
        if stuck:
            raise ScheduleError(["deadlock: " + line for line in stuck])
        return times
