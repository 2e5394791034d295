"""``pipescope bench``: the engine's speed against a heapq list-scheduler floor.

Both replay the same compiled schedule (durations, inputs, per-link FIFO transfers), so the
ratio measures the price of SimPy processes and events alone. The floor also cross-checks the
engine: every op must end at the same nanosecond in both.
"""

from __future__ import annotations

import heapq
import json
import statistics
import time

from pipescope.simulator.check import check
from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.engine import CompiledSchedule, Engine, compile_schedule, gc_paused
from pipescope.simulator.result import build_result
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import DEFAULT_LINK, simulate

CASES = ((8, 64), (64, 512))
COSTS = UniformCosts(forward=1e-3, backward_input=1e-3, backward_weight=1e-3, p2p=1e-4)


def heapq_floor(c: CompiledSchedule) -> list[int]:
    """The same replay as the engine, as a plain event loop over a heap. Returns each op's end (ns)."""
    n_ops = len(c.actions)
    fired = [False] * (n_ops + len(c.transfer_src))
    waiting: dict[int, list[int]] = {}
    cursor, device_busy = [0] * len(c.device_ops), [False] * len(c.device_ops)
    link_free: dict[tuple[int, int], int] = {}
    op_end = [0] * n_ops
    heap: list[tuple[int, int]] = []  # (time, signal)
    owner = [d for d, ops in enumerate(c.device_ops) for _ in ops]

    def try_start(d: int, now: int) -> None:
        if device_busy[d] or cursor[d] >= len(c.device_ops[d]):
            return
        i = c.device_ops[d][cursor[d]]
        for s in c.waits[i]:
            if not fired[s]:
                waiting.setdefault(s, []).append(d)
                return
        device_busy[d] = True
        heapq.heappush(heap, (now + c.duration[i], i))

    def send(t: int, now: int) -> None:
        key = (c.transfer_src[t], c.transfer_dst[t])
        start = max(now, link_free.get(key, 0))
        link_free[key] = start + c.transfer_occupancy[t]
        heapq.heappush(heap, (start + c.transfer_ns[t], n_ops + t))

    for d in range(len(c.device_ops)):
        try_start(d, 0)
    while heap:
        now, s = heapq.heappop(heap)
        fired[s] = True
        if s < n_ops:
            op_end[s] = now
            d = owner[s]
            device_busy[d], cursor[d] = False, cursor[d] + 1
            for t in c.launches[s]:
                send(t, now)
            try_start(d, now)
        for d in waiting.pop(s, ()):
            try_start(d, now)
    return op_end


def _paused(fn, *args):
    with gc_paused():
        return fn(*args)


def _median_time(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_case(p: int, m: int, repeat: int) -> dict:
    """Medians of: checker, compile, engine run, result building, and the heapq floor."""
    schedule = build("1f1b", p, m)
    compiled = compile_schedule(schedule, COSTS, lambda a, b: DEFAULT_LINK)
    engine_end = Engine(compiled).run().op_end
    if heapq_floor(compiled) != engine_end:
        raise AssertionError(f"engine and heapq floor disagree for p={p} m={m}")
    times = {
        "check_s": _median_time(lambda: check(schedule), repeat),
        "compile_s": _median_time(lambda: compile_schedule(schedule, COSTS, lambda a, b: DEFAULT_LINK), repeat),
        "engine_run_s": _median_time(lambda: Engine(compiled).run(), repeat),
        "floor_s": _median_time(lambda: _paused(heapq_floor, compiled), repeat),  # same GC treatment as the engine
    }
    run = Engine(compiled).run()
    times["result_s"] = _median_time(lambda: build_result(schedule, compiled, run, "bf16", m), repeat)
    times["simulate_s"] = _median_time(lambda: simulate(schedule, COSTS), repeat)
    ops = len(compiled.actions)
    return {"schedule": "1f1b", "p": p, "m": m, "ops": ops, "transfers": len(compiled.transfer_src), **times,
            "engine_ops_per_s": ops / times["engine_run_s"], "floor_ops_per_s": ops / times["floor_s"],
            "ratio_engine_to_floor": times["engine_run_s"] / times["floor_s"]}


def run_bench(repeat: int = 5, quick: bool = False, as_json: bool = False) -> int:
    rows = [bench_case(p, m, repeat) for p, m in (CASES[:1] if quick else CASES)]
    if as_json:
        print(json.dumps(rows))
        return 0
    print(f"{'case':>14} {'ops':>7} {'xfers':>7} {'engine run':>11} {'floor':>8} {'ratio':>6} "
          f"{'ops/s':>9} {'check':>7} {'compile':>8} {'result':>7} {'simulate':>9}")
    for r in rows:
        case = f"1f1b p={r['p']} m={r['m']}"
        print(f"{case:>14} {r['ops']:>7} {r['transfers']:>7} "
              f"{r['engine_run_s']:>10.3f}s {r['floor_s']:>7.3f}s {r['ratio_engine_to_floor']:>5.2f}x "
              f"{r['engine_ops_per_s']:>9.0f} {r['check_s']:>6.3f}s {r['compile_s']:>7.3f}s {r['result_s']:>6.3f}s "
              f"{r['simulate_s']:>8.3f}s")
    print(f"medians of {repeat} runs; 'simulate' is the whole simulate() call (structure check, compile, engine, "
          f"result); 'check' is the full checker with its lockstep replay, as `pipescope check` runs it")
    return 0
