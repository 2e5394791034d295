"""``pipescope bench``: the engine's speed against the heapq floor (``simulator.oracle``), with ``--network`` a
whole run over routed flows at 64, 256 and 1,024 GPUs, and ``bench_sweep``: a sweep's throughput and per-run overhead.

Both replay the same compiled program (durations, inputs, FIFO transfers) over the same network, so the ratio
measures the price of SimPy processes and events alone. The oracle also cross-checks the engine: every action must
end at the same nanosecond in both.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

from pipescope.simulator.check import check
from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.engine import Engine, gc_paused
from pipescope.simulator.network import FifoLinks
from pipescope.simulator.oracle import Oracle
from pipescope.simulator.result import build_result
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import prepare, simulate
from pipescope.simulator.timeline import replay_timeline

CASES = ((8, 64), (64, 512))
COSTS = UniformCosts(forward=1e-3, backward_input=1e-3, backward_weight=1e-3)
P2P_NS = 100_000


def network() -> FifoLinks:
    return FifoLinks.fixed_delay(P2P_NS)


def _paused(fn, *args):
    """Same GC treatment as the engine's run (it pauses the collector itself)."""
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
    """Medians of: checker, lowering + compile, engine run, result building, and the heapq floor."""
    schedule = build("1f1b", p, m)
    program, stage_costs = prepare(schedule, COSTS)
    engine_times = Engine(program, network()).run()
    if Oracle(program, network()).run() != engine_times:
        raise AssertionError(f"engine and heapq floor disagree for p={p} m={m}")
    times = {
        "check_s": _median_time(lambda: check(schedule), repeat),
        "compile_s": _median_time(lambda: _paused(prepare, schedule, COSTS), repeat),
        "engine_run_s": _median_time(lambda: Engine(program, network()).run(), repeat),
        "floor_s": _median_time(lambda: _paused(lambda: Oracle(program, network()).run()), repeat),
        "result_s": _median_time(lambda: _paused(lambda: build_result(
            schedule, replay_timeline(program, engine_times, p), stage_costs, "bf16", m)), repeat),
        "simulate_s": _median_time(lambda: simulate(schedule, COSTS, network()), repeat),
    }
    ops = schedule.num_compute_ops()
    return {"schedule": "1f1b", "p": p, "m": m, "ops": ops, "transfers": program.num_flows, **times,
            "engine_ops_per_s": ops / times["engine_run_s"], "floor_ops_per_s": ops / times["floor_s"],
            "ratio_engine_to_floor": times["engine_run_s"] / times["floor_s"]}


# (label, topology, nodes, fabric, p, w, m): issue 10's cases, 64 -> 256 -> 1024 GPUs, bucketed all-reduce.
NETWORK_CASES = (("64 GPUs", "dgx-h100", 8, "rail", 8, 8, 32), ("256 GPUs", "dgx-h100", 32, "fat-tree", 16, 16, 64),
                 ("1024 GPUs", "dgx-h100", 128, "fat-tree", 16, 64, 64))


def bench_network(label: str, topology: str, nodes: int, fabric: str, p: int, w: int, m: int, repeat: int) -> dict:
    """A whole ``pipescope.run`` of 1F1B over routed flows with w replicas (topology build included): wall time,
    flows and fair-share rate updates."""
    from pipescope import load_config, run

    config = load_config(None, [f"cluster.topology={topology}", f"cluster.nodes={nodes}", f"cluster.fabric={fabric}",
                                f"cluster.data_parallel={w}", f"schedule.stages={p}", f"schedule.microbatches={m}",
                                "model.microbatch_size=1"])
    results = []
    wall = _median_time(lambda: results.append(run(config)), repeat)
    result = results[-1]
    counters = result.network
    return {"case": label, "gpus": p * w, "p": p, "w": w, "m": m, "wall_s": wall, "flows": counters["flows"],
            "rate_updates": counters["rate_updates"], "rate_updates_per_s": counters["rate_updates"] / wall,
            "iteration_time_s": result.iteration_time_s, "exposed_allreduce_s": result.exposed_allreduce_s}


# 4 schedules x 2 depths x 5 microbatch counts x 5 seeds = 200 small uniform-cost runs (2 to 45 ms each).
SWEEP_EXPERIMENT = {
    "costs": {"kind": "uniform", "forward": "1ms", "backward_input": "1ms", "backward_weight": "1ms", "p2p": "10us"},
    "sweep": {"schedule.name": ["gpipe", "1f1b", "zb-h1", "zb-h2"], "schedule.stages": [2, 4],
              "schedule.microbatches": [4, 8, 16, 32, 64], "seed": [0, 1, 2, 3, 4]},
}


def bench_sweep(workers: int = 2, dask: bool = False) -> dict:
    """``SWEEP_EXPERIMENT`` swept over a process pool (or a Dask LocalCluster) of ``workers``, from executor start to
    the written results: runs per second, and the overhead per run, the worker time not spent inside ``run()``:
    (wall x workers - sum of run times) / runs. ``serial_runs_per_s`` is the same runs in this process, no pool."""
    from pipescope import run
    from pipescope.experiments.sweep import dask_executor, expand, run_sweep

    plan = expand(SWEEP_EXPERIMENT)
    serial_s = _median_time(lambda: [run(item.config) for item in plan.runs], 1)
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        if dask:
            with dask_executor("local", workers) as (executor, threads):
                report = run_sweep(plan, out, executor, threads, progress=False)
                wall = time.perf_counter() - started
        else:
            report = run_sweep(plan, out, workers=workers, progress=False)
            wall = time.perf_counter() - started
    runs, run_s = len(plan.runs), float(report.frame["run_wall_s"].sum())
    if report.lost or (report.frame["status"] != "ok").any():
        raise AssertionError(f"sweep benchmark: {len(report.lost)} runs lost, some failed")
    return {"case": f"sweep {runs} runs", "executor": "dask local" if dask else "process pool", "workers": workers,
            "runs": runs, "wall_s": wall, "runs_per_s": runs / wall, "mean_run_s": run_s / runs,
            "overhead_per_run_s": (wall * workers - run_s) / runs, "serial_runs_per_s": runs / serial_s}


def run_bench(repeat: int = 5, quick: bool = False, as_json: bool = False, with_network: bool = False,
              with_sweep: bool = False) -> int:
    rows = [bench_case(p, m, repeat) for p, m in (CASES[:1] if quick else CASES)]
    network = [bench_network(*case, repeat=min(repeat, 3)) for case in NETWORK_CASES] if with_network else []
    sweeps = [bench_sweep(dask=dask) for dask in (False, True)] if with_sweep else []
    if as_json:
        print(json.dumps(rows + network + sweeps))
        return 0
    print(f"{'case':>14} {'ops':>7} {'xfers':>7} {'engine run':>11} {'floor':>8} {'ratio':>6} "
          f"{'ops/s':>9} {'check':>7} {'compile':>8} {'result':>7} {'simulate':>9}")
    for r in rows:
        case = f"1f1b p={r['p']} m={r['m']}"
        print(f"{case:>14} {r['ops']:>7} {r['transfers']:>7} "
              f"{r['engine_run_s']:>10.3f}s {r['floor_s']:>7.3f}s {r['ratio_engine_to_floor']:>5.2f}x "
              f"{r['engine_ops_per_s']:>9.0f} {r['check_s']:>6.3f}s {r['compile_s']:>7.3f}s {r['result_s']:>6.3f}s "
              f"{r['simulate_s']:>8.3f}s")
    print(f"medians of {repeat} runs; 'simulate' is the whole simulate() call (structure check, lowering, compile, "
          f"engine, result); 'compile' includes lowering; 'check' is the structure check plus the engine's "
          f"unit-time replay, as `pipescope check` runs it")
    if network:
        print(f"\n{'network case':>12} {'GPUs':>5} {'wall':>8} {'flows':>8} {'rate updates':>13} {'updates/s':>10}")
        for r in network:
            print(f"{r['case']:>12} {r['gpus']:>5} {r['wall_s']:>7.2f}s {r['flows']:>8} {r['rate_updates']:>13} "
                  f"{r['rate_updates_per_s']:>10.0f}")
        print(f"1F1B, w replicas with bucketed all-reduce on dgx-h100 nodes (topology build included); medians of "
              f"{min(repeat, 3)} runs")
    if sweeps:
        print(f"\n{'sweep':>16} {'workers':>7} {'runs':>5} {'wall':>7} {'runs/s':>7} {'mean run':>9} "
              f"{'overhead/run':>13} {'serial runs/s':>14}")
        for r in sweeps:
            print(f"{r['executor']:>16} {r['workers']:>7} {r['runs']:>5} {r['wall_s']:>6.2f}s {r['runs_per_s']:>7.1f} "
                  f"{r['mean_run_s'] * 1e3:>7.1f}ms {r['overhead_per_run_s'] * 1e3:>11.1f}ms "
                  f"{r['serial_runs_per_s']:>14.1f}")
        print("200 uniform-cost runs, executor start to results written; overhead/run is (wall x workers - sum of "
              "run times) / runs; serial: the same runs one after another in this process")
    return 0
