"""When the executor's actions start and end: ``perf_counter_ns`` on CPU, CUDA events on a GPU.

On a GPU the host only queues work, so a host clock would time the launches (or, with a synchronize around every
action, add the launch latency and Python time that training hides by running ahead). Events on the device's current
stream time what the GPU did, as ``calibrate``'s ``CudaTimer`` does, so the executor's op times and the profile's
compare like with like. An event stamp becomes nanoseconds after the run: the run's first event is tied to the
host's ``perf_counter_ns`` at a synchronize, and every other is that plus the GPU time elapsed since it.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class HostClock:
    """CPU ranks: a stamp is the host's ``perf_counter_ns``."""

    wall = True  # a stamp is wall time, so a time taken in another thread (gloo's completion) is on this clock

    def begin(self) -> None:
        """A run of the program starts (after its barrier)."""

    def stamp(self) -> Any:
        return time.perf_counter_ns()

    def resolve(self, rows: list[tuple]) -> list[tuple]:
        """The run's rows, their start and end (the last two fields) in ns."""
        return rows


class ThreadCpuClock(HostClock):
    """CPU ranks timed by the CPU time of the thread that runs the ops: what an op costs whoever holds the core,
    without the time it waits for one (stage timing with more ranks than cores, ``stage_timing``)."""

    wall = False

    def stamp(self) -> Any:
        return time.thread_time_ns()


class CudaClock:
    """A GPU rank: a stamp is a CUDA event on the device's current stream, resolved after the run."""

    wall = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin(self) -> None:
        torch.cuda.synchronize(self.device)
        self.origin_ns = time.perf_counter_ns()
        self.origin = self.stamp()

    def stamp(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def resolve(self, rows: list[tuple]) -> list[tuple]:
        torch.cuda.synchronize(self.device)
        return [(*row[:-2], self._ns(row[-2]), self._ns(row[-1])) for row in rows]

    def _ns(self, stamp: Any) -> int:
        return self.origin_ns + round(self.origin.elapsed_time(stamp) * 1e6)  # elapsed_time is in ms


def make_clock(device: torch.device, cpu_time: bool = False) -> HostClock | CudaClock:
    if device.type == "cuda":
        return CudaClock(device)
    return ThreadCpuClock() if cpu_time else HostClock()
