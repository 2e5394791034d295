"""The SimPy engine: one process per device compute stream; each directed link a FIFO send stream.

The schedule is compiled first into flat arrays: each op's duration, the signals it waits for
(a producer's completion on the same device, or the arrival of a transfer from another device)
and the transfers it starts when it ends. Processes then only walk their lists, so the event count
is one Timeout per op and per transfer; a signal gets a fresh SimPy event only when someone has
to wait for it before its producer started. The clock is integer nanoseconds.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import simpy

from pipescope.simulator.check import ScheduleError
from pipescope.simulator.costs import CostModel, Link, StageCost
from pipescope.simulator.ir import Action, Schedule, producers

LinkLookup = Callable[[int, int], Link]


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
class CompiledSchedule:
    """Flat arrays the processes walk. Signals 0..n_ops-1 are op completions, then transfer arrivals."""

    actions: list[Action]
    device_ops: list[list[int]]
    duration: list[int]
    waits: list[list[int]]
    launches: list[list[int]]
    transfer_src: list[int]
    transfer_dst: list[int]
    transfer_bytes: list[int]
    transfer_ns: list[int]
    transfer_occupancy: list[int]
    transfer_producer: list[int]
    stage_costs: list[StageCost]


def op_duration(action: Action, cost: StageCost, recompute: bool) -> int:
    """F, I, W from the stage's costs; B = I + W; a backward under recompute reruns F first."""
    extra = cost.recompute_ns if recompute and action.kind in ("I", "B") else 0
    if action.kind == "F":
        return cost.forward_ns
    if action.kind == "I":
        return cost.input_grad_ns + extra
    if action.kind == "W":
        return cost.weight_grad_ns
    return cost.input_grad_ns + cost.weight_grad_ns + extra


def compile_schedule(schedule: Schedule, costs: CostModel, link: LinkLookup) -> CompiledSchedule:
    """Resolve every op's duration, inputs and outgoing transfers once, before simulating."""
    stage_costs = [costs.stage_cost(s, schedule.num_stages, schedule.chunks) for s in range(schedule.num_stages)]
    per_device = [schedule.compute_actions(d) for d in range(schedule.num_devices)]
    actions = [a for acts in per_device for a in acts]
    device_ops, first = [], 0
    for acts in per_device:
        device_ops.append(list(range(first, first + len(acts))))
        first += len(acts)
    index = {a: i for i, a in enumerate(actions)}
    if len(index) != len(actions):
        raise ScheduleError(["an action appears twice; run the checker for details"])
    out = CompiledSchedule(actions, device_ops, [], [], [[] for _ in actions], [], [], [], [], [], [], stage_costs)
    transfer_of: dict[tuple[int, int], int] = {}
    duration_of: dict[tuple[int, int, int], tuple[int, int]] = {}
    home, present = schedule.stage_to_device, frozenset(index)
    op_ns = {(s, k): op_duration(Action(s, k, 0), cost, schedule.recompute)
             for s, cost in enumerate(stage_costs) for k in ("F", "I", "W", "B")}
    for action in actions:
        out.duration.append(op_ns[action.stage, action.kind])
        deps = []
        for dep in producers(action, schedule.num_stages, present):
            j = index.get(dep)
            if j is None:
                raise ScheduleError([f"{action} needs {dep}, which the schedule never runs"])
            src, dst = home[dep.stage], home[action.stage]
            if src == dst:
                deps.append(j)
                continue
            key = (dep.stage, src, dst)
            if key not in duration_of:
                nbytes, path = stage_costs[dep.stage].boundary_bytes, link(src, dst)
                duration_of[key] = (costs.transfer_ns(nbytes, path), costs.occupancy_ns(nbytes, path))
            deps.append(len(actions) + _transfer(out, transfer_of, j, src, dst, duration_of[key]))
        out.waits.append(deps)
    return out


def _transfer(out: CompiledSchedule, known: dict[tuple[int, int], int], producer: int, src: int, dst: int,
              duration: tuple[int, int]) -> int:
    """The transfer of ``producer``'s output to ``dst`` (created once, however many ops read it)."""
    key = (producer, dst)
    if key not in known:
        known[key] = len(out.transfer_src)
        out.transfer_src.append(src)
        out.transfer_dst.append(dst)
        out.transfer_bytes.append(out.stage_costs[out.actions[producer].stage].boundary_bytes)
        out.transfer_ns.append(duration[0])
        out.transfer_occupancy.append(duration[1])
        out.transfer_producer.append(producer)
        out.launches[producer].append(known[key])
    return known[key]


@dataclass
class RunTimes:
    """What a run measured: start/end of every op and transfer (ns)."""

    op_start: list[int]
    op_end: list[int]
    transfer_start: list[int]
    transfer_end: list[int]


class Engine:
    """Replays a compiled schedule in SimPy and reports op and transfer times.

    Compute streams are generator processes. A directed link is a FIFO send stream: a transfer
    starts once the link has finished serialising the earlier ones (their occupancy, bytes over
    bandwidth) and arrives its full time (latency included) after it starts. That is known the
    moment the transfer is queued, so each transfer is a single Timeout whose callback fires its
    arrival; a generator resume per transfer doubled the run time for nothing. With zero occupancy
    (uniform costs) a transfer is a pure delay, as in SCHEDULES.md section 0. A consumer waits on the
    event that will produce its input (the producer's running Timeout, then the transfer's), so a
    fresh event is needed only when that has not started.
    """

    def __init__(self, compiled: CompiledSchedule):
        self.c = compiled
        self.n_ops = n_ops = len(compiled.actions)
        n_signals = n_ops + len(compiled.transfer_src)
        self.env = simpy.Environment()
        self.fired = [False] * n_signals
        self.pending: list[simpy.Event | None] = [None] * n_signals
        self.waiter: list[simpy.Event | None] = [None] * n_signals
        self.times = RunTimes([-1] * n_ops, [-1] * n_ops, [-1] * (n_signals - n_ops), [-1] * (n_signals - n_ops))
        self.cursor = [0] * len(compiled.device_ops)
        self.link_free: dict[tuple[int, int], int] = {}

    def run(self) -> RunTimes:
        """Simulate to the end; ScheduleError naming the stuck ops if it cannot finish."""
        for d, ops in enumerate(self.c.device_ops):
            if ops:
                self.env.process(self._compute(d, ops))
        with gc_paused():
            self.env.run()
        stuck = self._stuck()
        if stuck:
            raise ScheduleError(["deadlock: " + line for line in stuck])
        return self.times

    def _fire(self, signal: int) -> None:
        self.fired[signal] = True
        self.pending[signal] = None
        event = self.waiter[signal]
        if event is not None:
            event.succeed()

    def _event_for(self, signal: int) -> simpy.Event:
        """The soonest existing event after which ``signal`` may have fired."""
        event = self.pending[signal]
        if event is None and signal >= self.n_ops:
            event = self.pending[self.c.transfer_producer[signal - self.n_ops]]
        if event is None:
            event = self.waiter[signal]
            if event is None:
                event = self.waiter[signal] = self.env.event()
        return event

    def _compute(self, device: int, ops: list[int]):
        env, c, fired, times, pending = self.env, self.c, self.fired, self.times, self.pending
        for k, i in enumerate(ops):
            self.cursor[device] = k
            for signal in c.waits[i]:
                while not fired[signal]:
                    yield self._event_for(signal)
            times.op_start[i] = env.now
            pending[i] = timeout = env.timeout(c.duration[i])
            yield timeout
            times.op_end[i] = env.now
            self._fire(i)
            for t in c.launches[i]:
                self._send(t)
        self.cursor[device] = len(ops)

    def _send(self, transfer: int) -> None:
        """Queue ``transfer`` on its link: it starts when the link is free and arrives its full time later."""
        c, now = self.c, self.env.now
        key = (c.transfer_src[transfer], c.transfer_dst[transfer])
        start = max(now, self.link_free.get(key, 0))
        self.link_free[key] = start + c.transfer_occupancy[transfer]
        self.times.transfer_start[transfer] = start
        event = self.env.timeout(start - now + c.transfer_ns[transfer], transfer)
        event.callbacks.append(self._arrived)
        self.pending[self.n_ops + transfer] = event

    def _arrived(self, event: simpy.Event) -> None:
        self.times.transfer_end[event.value] = self.env.now
        self._fire(self.n_ops + event.value)

    def _stuck(self) -> list[str]:
        lines = []
        for device, ops in enumerate(self.c.device_ops):
            k = self.cursor[device]
            if k >= len(ops):
                continue
            i = ops[k]
            waiting = [self._signal_name(s) for s in self.c.waits[i] if not self.fired[s]]
            lines.append(f"device {device} op {k}: {self.c.actions[i]} waits for {', '.join(waiting)}")
        return lines

    def _signal_name(self, signal: int) -> str:
        if signal < self.n_ops:
            return str(self.c.actions[signal])
        producer = self.c.transfer_producer[signal - self.n_ops]
        return f"{self.c.actions[producer]} (transfer)"
