"""Timing one piece of work the way kernel benchmarks should.

CUDA: events recorded on the stream the work runs on, warm-up first, the L2 cache flushed (a write larger
than L2, outside the timed window) before every repetition. CPU: ``time.perf_counter_ns`` around the work,
with the thread count recorded by the caller. Either way repetitions continue until the median is stable
(its estimated standard error under ``rel_tol`` of it), capped by ``max_reps`` and ``budget_s``; the median
and the spread (p10, p90, min) are kept.

A busy machine shows as a long upper tail: another process taking the core for a while makes some repetitions
many times slower. So a measurement whose spread (p90 / median) is above ``max_spread`` is made again, up to
``retries`` more times, and the attempt with the lowest median is kept (noise only ever adds time); whether it
is still noisy is then visible from its own p90 / median (``needs_retry``, ``best``, ``is_noisy``: pure
functions, driven by tests without real noise).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TimingConfig:
    """How hard to try: warm-up runs, repetition bounds, target precision and a wall-time budget per op; how
    much spread (p90 / median) a measurement may have before it is made again, and how many times at most."""

    warmup: int = 3
    min_reps: int = 7
    max_reps: int = 200
    rel_tol: float = 0.02
    budget_s: float = 2.0
    flush_l2: bool = True
    max_spread: float = 2.0
    retries: int = 2


@dataclass(frozen=True)
class Stats:
    """Median and spread of one op's repetitions, in nanoseconds."""

    median_ns: int
    p10_ns: int
    p90_ns: int
    min_ns: int
    reps: int
    attempts: int = 1


@dataclass(frozen=True)
class Bench:
    """``setup`` prepares state outside the timed window; ``run(state)`` is the timed work."""

    run: Callable[[Any], Any]
    setup: Callable[[], Any] = lambda: None


def stats(samples: list[float]) -> Stats:
    """Median, 10th/90th percentile (nearest rank) and minimum of ``samples`` (ns)."""
    ordered = sorted(samples)

    def rank(q: float) -> int:
        return int(round(ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]))

    return Stats(int(round(statistics.median(ordered))), rank(0.1), rank(0.9), int(round(ordered[0])), len(ordered))


def is_stable(samples: list[float], rel_tol: float) -> bool:
    """Whether the median's standard error (1.253 sigma / sqrt(n), sigma from the IQR) is within ``rel_tol``."""
    if len(samples) < 4:
        return False
    q1, _, q3 = statistics.quantiles(samples, n=4)
    sigma = (q3 - q1) / 1.349
    return 1.253 * sigma / math.sqrt(len(samples)) <= rel_tol * statistics.median(samples)


def spread(median_ns: float, p90_ns: float) -> float:
    """p90 over median: 1.0 for steady repetitions, large when some were slowed down (1.0 for a 0 median)."""
    return p90_ns / median_ns if median_ns > 0 else 1.0


def is_noisy(result: Stats, max_spread: float) -> bool:
    """Whether ``result``'s p90 / median is above ``max_spread``."""
    return spread(result.median_ns, result.p90_ns) > max_spread


def best(attempts: list[Stats]) -> Stats:
    """The attempt with the lowest median (the first of equals), ``attempts`` set to how many were made."""
    return dataclasses.replace(min(attempts, key=lambda a: a.median_ns), attempts=len(attempts))


def needs_retry(attempts: list[Stats], max_spread: float, retries: int) -> bool:
    """Whether to measure once more: the best attempt so far is noisy and at most ``retries`` attempts were made
    after the first."""
    return len(attempts) <= retries and is_noisy(best(attempts), max_spread)


class Timer:
    """Times Benches on one device; subclasses supply one repetition."""

    method = "none"

    def __init__(self, config: TimingConfig) -> None:
        self.config = config

    def measure(self, bench: Bench) -> Stats:
        """Warm up, then ``measure_once``; again (not warmed up again) while the best attempt so far is noisy
        (``needs_retry``); the best attempt is kept. The budget of the first attempt includes the collection."""
        for _ in range(self.config.warmup):
            self._discard(bench.run(bench.setup()))
        started = time.perf_counter()
        gc.collect()
        gc.disable()  # a collection inside the timed window is noise, not the op's cost
        try:
            attempts = [self.measure_once(bench, started)]
            while needs_retry(attempts, self.config.max_spread, self.config.retries):
                attempts.append(self.measure_once(bench, time.perf_counter()))
        finally:
            gc.enable()
        return best(attempts)

    def measure_once(self, bench: Bench, started: float) -> Stats:
        """Repeat until the median is stable or a cap is hit (the budget counted from ``started``)."""
        samples: list[float] = []
        while len(samples) < self.config.max_reps:
            count = 1 if not samples else min(self._batch(), self.config.max_reps - len(samples))
            samples.extend(self._repeat(bench, count))
            if len(samples) >= self.config.min_reps and (
                is_stable(samples, self.config.rel_tol) or time.perf_counter() - started > self.config.budget_s
            ):
                break
        return stats(samples)

    def _batch(self) -> int:
        return 1

    def _repeat(self, bench: Bench, count: int) -> list[float]:
        raise NotImplementedError

    def _discard(self, result: Any) -> None:
        del result


class CpuTimer(Timer):
    """perf_counter_ns around each repetition; setup and freeing the result stay outside."""

    method = "perf_counter"

    def _repeat(self, bench: Bench, count: int) -> list[float]:
        out = []
        for _ in range(count):
            state = bench.setup()
            start = time.perf_counter_ns()
            result = bench.run(state)
            out.append(float(time.perf_counter_ns() - start))
            del result, state
        return out


class CudaTimer(Timer):
    """CUDA events on the current stream (where the work is issued), L2 flushed before each repetition.

    A batch of repetitions is issued before one synchronize, so the host is not in the timed window; the start
    event is recorded after the setup's and the flush's kernels, so only the work itself falls between events.
    """

    method = "cuda-events"

    def __init__(self, config: TimingConfig, device: torch.device) -> None:
        super().__init__(config)
        self.device = device
        self.flush_bytes = l2_flush_bytes(device) if config.flush_l2 else 0
        self._flush_buffer = torch.empty(self.flush_bytes // 4, dtype=torch.int32, device=device)

    def _batch(self) -> int:
        return 5

    def _repeat(self, bench: Bench, count: int) -> list[float]:
        stream = torch.cuda.current_stream(self.device)
        events = []
        for _ in range(count):
            state = bench.setup()
            if self.flush_bytes:
                self._flush_buffer.fill_(1)  # a write evicts everything the work could have left in L2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            result = bench.run(state)
            end.record(stream)
            events.append((start, end))
            del result, state
        stream.synchronize()
        return [start.elapsed_time(end) * 1e6 for start, end in events]

    def _discard(self, result: Any) -> None:
        del result
        torch.cuda.synchronize(self.device)


def l2_flush_bytes(device: torch.device) -> int:
    """Twice the L2 size as the driver reports it (256 MiB if unknown), so one write evicts it all."""
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (128 << 20)
    return 2 * int(size)


def make_timer(device: torch.device, config: TimingConfig) -> Timer:
    """The right timer for ``device``."""
    return CudaTimer(config, device) if device.type == "cuda" else CpuTimer(config)
