"""Simulation results: the op timeline, per-device busy/span/idle/memory, iteration time, bubble rate."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from pipescope.simulator.engine import CompiledSchedule, RunTimes
from pipescope.simulator.ir import Schedule
from pipescope.simulator.memory import (
    DeviceMemory,
    MemoryEvents,
    OpArrays,
    concat,
    device_timelines,
    events,
    op_memory_events,
    static_memory,
)


@dataclass(frozen=True)
class DeviceStats:
    """One device's numbers; ``span_s`` is end of its last compute op minus start of its first."""

    device: int
    busy_s: float
    span_s: float
    idle_fraction: float
    peak_memory_bytes: int
    peak_activations: float
    static_memory_bytes: int


@dataclass
class SimResult:
    """Everything one simulation measured.

    Attributes:
        iteration_ns: the makespan of one iteration; for schedules without a flush that span
            several iterations, the steady-state time between consecutive iterations' ends.
        fill_drain_ns: for multi-iteration runs, the makespan minus iterations x steady state.
        bubble_rate: 1 - sum(busy) / (D x max span) over the whole run (SCHEDULES.md section 0).
    """

    schedule: Schedule
    compiled: CompiledSchedule
    times: RunTimes
    devices: list[DeviceStats]
    memory: list[DeviceMemory]
    iteration_ns: int
    fill_drain_ns: int
    makespan_ns: int
    bubble_rate: float
    samples_per_iteration: int
    sim_wall_s: float = 0.0
    memory_capacity_bytes: int | None = None
    model_flops_per_iteration: float | None = None
    peak_flops_per_device: float | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def iteration_time_s(self) -> float:
        return self.iteration_ns / 1e9

    @property
    def throughput_samples_per_s(self) -> float:
        return self.samples_per_iteration / self.iteration_time_s if self.iteration_ns else 0.0

    @property
    def peak_memory_bytes(self) -> int:
        return max(d.peak_memory_bytes for d in self.devices)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs per second over the pipeline's peak, when the cost model knows both."""
        if not self.model_flops_per_iteration or not self.peak_flops_per_device or not self.iteration_ns:
            return None
        achieved = self.model_flops_per_iteration / self.iteration_time_s
        return achieved / (self.peak_flops_per_device * self.schedule.num_devices)

    def oom(self) -> list[dict]:
        """Devices whose peak exceeds the device memory: device, needed and available bytes."""
        cap = self.memory_capacity_bytes
        if cap is None:
            return []
        return [{"device": d.device, "peak_memory_bytes": d.peak_memory_bytes, "capacity_bytes": cap}
                for d in self.devices if d.peak_memory_bytes > cap]

    @cached_property
    def timeline(self) -> pd.DataFrame:
        """One row per compute op and transfer: device, stream, action, kind, stage, chunk, microbatch, times."""
        c, t, home = self.compiled, self.times, self.schedule.stage_to_device
        p = self.schedule.num_devices
        ops = pd.DataFrame({
            "device": [home[a.stage] for a in c.actions],
            "stream": "compute",
            "action": [str(a) for a in c.actions],
            "kind": [a.kind for a in c.actions],
            "stage": [a.stage for a in c.actions],
            "chunk": [a.stage // p for a in c.actions],
            "microbatch": [a.microbatch for a in c.actions],
            "start_ns": t.op_start,
            "end_ns": t.op_end,
        })
        producers = [c.actions[i] for i in c.transfer_producer]
        sends = pd.DataFrame({
            "device": c.transfer_src,
            "stream": [f"send->{d}" for d in c.transfer_dst],
            "action": [f"{a.stage}SEND_{'F' if a.kind == 'F' else 'B'}{a.microbatch}" for a in producers],
            "kind": ["SEND_F" if a.kind == "F" else "SEND_B" for a in producers],
            "stage": [a.stage for a in producers],
            "chunk": [a.stage // p for a in producers],
            "microbatch": [a.microbatch for a in producers],
            "start_ns": t.transfer_start,
            "end_ns": t.transfer_end,
        })
        return pd.concat([ops, sends], ignore_index=True)

    def summary(self) -> dict:
        """The JSON object ``simulate --json`` prints (DESIGN.md's fields and a few more)."""
        s = self.schedule
        return {
            "schedule": s.name,
            "stages": s.num_stages,
            "devices": s.num_devices,
            "chunks": s.chunks,
            "microbatches": s.num_microbatches,
            "iterations": s.iterations,
            "weight_update": s.weight_update,
            "recompute": s.recompute,
            "iteration_time_s": self.iteration_time_s,
            "fill_drain_s": self.fill_drain_ns / 1e9,
            "makespan_s": self.makespan_ns / 1e9,
            "bubble_rate": self.bubble_rate,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "mfu": self.mfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "oom": self.oom(),
            "sim_wall_s": self.sim_wall_s,
            "ops": len(self.compiled.actions),
            "transfers": len(self.compiled.transfer_src),
            "warnings": self.warnings,
            "per_device": [{
                "device": d.device, "busy_s": d.busy_s, "span_s": d.span_s, "idle_fraction": d.idle_fraction,
                "peak_memory_bytes": d.peak_memory_bytes, "peak_activations": d.peak_activations,
                "static_memory_bytes": d.static_memory_bytes,
            } for d in self.devices],
        }


def _iteration_times(schedule: Schedule, compiled: CompiledSchedule, times: RunTimes) -> tuple[int, int, int]:
    """(iteration, fill/drain, makespan) in ns; one iteration: iteration = makespan."""
    makespan = max(times.op_end) - min(times.op_start)
    if schedule.iterations <= 1:
        return makespan, 0, makespan
    ends = [0] * schedule.iterations
    for action, end in zip(compiled.actions, times.op_end):
        k = action.microbatch // schedule.num_microbatches
        ends[k] = max(ends[k], end)
    steady = int(statistics.median(b - a for a, b in zip(ends, ends[1:])))
    return steady, makespan - schedule.iterations * steady, makespan


def _memory(schedule: Schedule, compiled: CompiledSchedule, times: RunTimes, precision: str,
            ) -> tuple[list[DeviceMemory], list[int]]:
    home = np.asarray(schedule.stage_to_device)
    params = np.bincount(home, [c.params for c in compiled.stage_costs], minlength=schedule.num_devices)
    static = [static_memory(int(params[d]), schedule.versions(d), precision).total
              for d in range(schedule.num_devices)]
    stage = np.fromiter((a.stage for a in compiled.actions), dtype=np.int64, count=len(compiled.actions))
    costs = compiled.stage_costs
    ops = OpArrays(
        device=home[stage],
        kind=np.array([a.kind for a in compiled.actions]),
        start=np.asarray(times.op_start, dtype=np.int64),
        end=np.asarray(times.op_end, dtype=np.int64),
        activation=np.array([c.activation_bytes for c in costs], dtype=np.int64)[stage],
        weight_grad=np.array([c.weight_grad_bytes for c in costs], dtype=np.int64)[stage],
        stage_input=np.array([c.input_bytes for c in costs], dtype=np.int64)[stage],
    )
    op_events = op_memory_events(ops, schedule.recompute, schedule.chunks)
    return device_timelines(concat([op_events, _buffer_events(compiled, times, ops.end)]), static), static


def _buffer_events(compiled: CompiledSchedule, times: RunTimes, op_end: np.ndarray) -> MemoryEvents:
    """p2p buffers: the sender's copy until the transfer ends, the receiver's until its last reader starts."""
    n_ops = len(compiled.actions)
    consumer_start = list(times.transfer_end)  # a transfer nobody reads is freed on arrival
    for i, waits in enumerate(compiled.waits):
        for signal in waits:
            if signal >= n_ops:
                consumer_start[signal - n_ops] = max(consumer_start[signal - n_ops], times.op_start[i])
    nbytes = np.asarray(compiled.transfer_bytes, dtype=np.int64)
    src, dst = np.asarray(compiled.transfer_src, dtype=np.int64), np.asarray(compiled.transfer_dst, dtype=np.int64)
    produced = op_end[np.asarray(compiled.transfer_producer, dtype=np.int64)]
    return concat([
        events(src, produced, nbytes),
        events(src, np.asarray(times.transfer_end, dtype=np.int64), -nbytes),
        events(dst, np.asarray(times.transfer_start, dtype=np.int64), nbytes),
        events(dst, np.asarray(consumer_start, dtype=np.int64), -nbytes),
    ])


def build_result(schedule: Schedule, compiled: CompiledSchedule, times: RunTimes, precision: str,
                 samples_per_iteration: int) -> SimResult:
    """Derive every statistic from the raw op and transfer times."""
    busy = [sum(times.op_end[i] - times.op_start[i] for i in ops) for ops in compiled.device_ops]
    span = [times.op_end[ops[-1]] - times.op_start[ops[0]] if ops else 0 for ops in compiled.device_ops]
    max_span = max(span) or 1
    memory, static = _memory(schedule, compiled, times, precision)
    devices = [DeviceStats(d, busy[d] / 1e9, span[d] / 1e9, 1.0 - busy[d] / max_span, memory[d].peak_bytes,
                           memory[d].peak_activations, static[d]) for d in range(schedule.num_devices)]
    iteration, fill_drain, makespan = _iteration_times(schedule, compiled, times)
    bubble = 1.0 - sum(busy) / (len(busy) * max_span)
    return SimResult(schedule, compiled, times, devices, memory, iteration, fill_drain, makespan, bubble,
                     samples_per_iteration)
