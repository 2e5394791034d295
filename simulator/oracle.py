"""The test oracle: the engine's replay as a plain heapq event loop, no SimPy.

It walks the same compiled program over the same network with the same rules, so the tests hold the engine to it to
the nanosecond, and ``pipescope bench`` uses it as the speed floor (the ratio prices SimPy's processes and events).
Test and benchmark code: the simulator itself never calls it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from pipescope.simulator.engine import RunTimes
from pipescope.simulator.ir import ScheduleError
from pipescope.simulator.network import Network
from pipescope.simulator.program import Program, Step


class Oracle:
    """Replays ``program``; ``run()`` returns the same RunTimes the engine does."""

    def __init__(self, program: Program, network: Network):
        self.p, self.network = program, network
        n, flows = program.num_entries, program.num_flows
        self.fired = [False] * (n + flows)
        self.version = [0] * flows
        self.joined = [0] * flows
        self.times = RunTimes([-1] * n, [-1] * n, [-1] * flows, [-1] * flows)
        self.cursor = [0] * len(program.device_entries)
        self.busy = [False] * len(program.device_entries)
        self.waiting: dict[int, list[int]] = {}
        self.heap: list[tuple[int, int, int, Callable[[int, int], None], int]] = []
        self.now = self.seq = 0

    def finish_at(self, flow: int, time: int) -> None:
        self.version[flow] += 1
        self._at(time, self._flow_ended, flow * (1 << 20) + self.version[flow] % (1 << 20))

    def run(self) -> RunTimes:
        self.network.reset()
        for d in range(len(self.p.device_entries)):
            self._advance(d)
        while self.heap:
            self.now, _, _, callback, arg = heapq.heappop(self.heap)
            callback(arg, self.now)
        stuck = [f"device {d} entry {c}: {self.p.actions[self.p.device_entries[d][c]]}"
                 for d, c in enumerate(self.cursor) if c < len(self.p.device_entries[d])]
        if stuck:
            raise ScheduleError(["deadlock: " + line for line in stuck])
        return self.times

    def _at(self, time: int, callback: Callable[[int, int], None], arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, 0, callback, arg))

    def _fire(self, signal: int) -> None:
        self.fired[signal] = True
        for d in self.waiting.pop(signal, ()):
            self._advance(d)

    def _flow_ended(self, arg: int, now: int) -> None:
        flow, version = divmod(arg, 1 << 20)
        if version == self.version[flow] % (1 << 20):
            self.times.flow_end[flow] = now
            self._fire(self.p.num_entries + flow)

    def _op_ended(self, i: int, now: int) -> None:
        self.times.entry_end[i] = now
        d = self.p.device[i]
        self.busy[d], self.cursor[d] = False, self.cursor[d] + 1
        self._fire(i)
        self._advance(d)

    def _advance(self, d: int) -> None:
        """Run device ``d``'s entries until one must wait (a missing input, an op in progress, a collective)."""
        p, entries = self.p, self.p.device_entries[d]
        while not self.busy[d] and self.cursor[d] < len(entries):
            i = entries[self.cursor[d]]
            blocked = self._blocked_on(i)
            if blocked is not None:
                self.waiting.setdefault(blocked, []).append(d)
                return
            if self.times.entry_start[i] < 0:
                self.times.entry_start[i] = self.now
            step, f = p.step[i], p.flow_of[i]
            if step is Step.COMPUTE:
                self.busy[d] = True
                self._at(self.now + p.duration[i], self._op_ended, i)
                return
            if step is Step.SEND:
                self.times.flow_start[f] = self.network.start_transfer(self, f, p.flow_src[f], p.flow_dst[f],
                                                                       p.flow_bytes[f])
            self.times.entry_end[i] = self.now
            self.cursor[d] += 1

    def _blocked_on(self, i: int) -> int | None:
        """The first signal entry ``i`` still waits for (joining its collective first), or None."""
        p = self.p
        if p.step[i] is Step.COLLECTIVE:
            f = p.flow_of[i]
            if self.times.entry_start[i] < 0:
                self.times.entry_start[i] = self.now
                self.joined[f] += 1
                c = p.flow_collective[f]
                if self.joined[f] == len(c.group):
                    self.times.flow_start[f] = self.network.start_collective(self, f, c.kind, c.group, c.nbytes)
            return None if self.fired[p.num_entries + f] else p.num_entries + f
        return next((s for s in p.waits[i] if not self.fired[s]), None)
