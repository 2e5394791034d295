"""``pipescope bench --scale``: how the simulator's cost grows with the cluster (issue 30's ladder; README, "Speed").

One model and schedule, the GPT of issue 30's 16,384-GPU case (128 layers, hidden 16,384, seq 8,192, vocabulary
128,000; interleaved pipeline 16 x 2, 16 microbatches, tensor 8, dgx-h100 servers), with ever more data-parallel
replicas: 1, 2, 8, 32 and 128, so 128 to 16,384 GPUs (a pipeline is 128 GPUs, so the ladder starts there). Each
rung is a whole ``pipescope simulate --json`` in a child process, so that its wall time includes the start and
its peak memory (the child's maximum resident set, from ``wait4``) is its own; "replayed" is how many replicas it
simulated, one of each kind where alike ones fold (``simulator.fold``). Events are what the replay
scheduled: ops, flows started and fair-share rate updates (each a SimPy event). The exponent is the least-squares
slope of log wall time against log GPUs: 1 means linear.

Beside the ladder, one collective over more and more servers: ``pipescope collective``'s 1 GiB all-reduce over every
GPU of 64, 512 and 4,096 dgx-h100 servers (512 to 32,768 GPUs), each in its own process too, where routing the
flows between so many servers is most of the work (issue 30's second row).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

PIPELINE, CHUNKS, TENSOR, MICROBATCHES = 16, 2, 8, 16
REPLICA_GPUS = PIPELINE * TENSOR  # one pipeline: the smallest rung
LADDER = (1, 2, 8, 32, 128)  # data-parallel replicas: 128 to 16,384 GPUs
GPUS_PER_NODE = 8  # dgx-h100
TARGET = {"gpus": 16_384, "wall_s": 30.0, "peak_rss_bytes": 2 * 2**30}  # issue 30's first row
MODEL = {"layers": 128, "hidden": 16384, "heads": 128, "seq": 8192, "vocab": 128000, "microbatch_size": 1}
COLLECTIVE_NODES = (64, 512, 4096)  # dgx-h100 servers: 512, 4,096 and 32,768 GPUs
COLLECTIVE_TARGET = {"gpus": 32_768, "wall_s": 10.0}  # issue 30's second row


def case_args(replicas: int) -> list[str]:
    """``pipescope simulate`` arguments of the rung with ``replicas`` pipelines."""
    gpus = REPLICA_GPUS * replicas
    sets = {"parallel.tensor": TENSOR, "cluster.topology": "dgx-h100", "cluster.nodes": gpus // GPUS_PER_NODE,
            "cluster.data_parallel": replicas, **{f"model.{key}": value for key, value in MODEL.items()}}
    flags = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    return ["simulate", "--schedule", "interleaved", "--stages", str(PIPELINE), "--chunks", str(CHUNKS),
            "--microbatches", str(MICROBATCHES), *flags, "--allow-oom", "--json"]


def run_case(replicas: int) -> dict:
    """One rung in a child process: wall time, peak resident memory, the replay's counts and events per second."""
    wall, rss, result = _child(case_args(replicas), f"{replicas} replicas")
    network = result["network"]
    events = result["ops"] + network.get("flows", 0) + network.get("rate_updates", 0)
    replayed = network.get("folding", {}).get("simulated", replicas)  # alike replicas folded (simulator.fold)
    return {"gpus": REPLICA_GPUS * replicas, "data_parallel": replicas, "replayed": replayed, "wall_s": wall,
            "peak_rss_bytes": rss,
            "simulated_s": result["sim_wall_s"], "ops": result["ops"], "flows": network.get("flows", 0),
            "rate_updates": network.get("rate_updates", 0), "events_per_s": events / wall,
            "iteration_time_s": result["iteration_time_s"]}


def run_collective(nodes: int) -> dict:
    """``pipescope collective``'s default all-reduce over every GPU of ``nodes`` dgx-h100 servers, in a child
    process: wall time, peak resident memory, the algorithm chosen and its time."""
    wall, rss, result = _child(["collective", "--nodes", str(nodes), "--json"], f"{nodes} nodes")
    return {"gpus": nodes * GPUS_PER_NODE, "nodes": nodes, "wall_s": wall, "peak_rss_bytes": rss,
            "algorithm": result["algorithm"], "time_s": result["time_s"], "busbw_GBps": result["busbw_GBps"]}


def _child(args: list[str], what: str) -> tuple[float, int, dict]:
    """``pipescope ARGS`` in a child process: (wall s, its peak resident bytes, its JSON)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "pipescope.experiments.cli", *args],
                                 stdout=out, stderr=err)  # files, not pipes: the JSON of 16,384 GPUs fills a pipe
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            err.seek(0)
            last = (err.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"bench --scale: {what} exited {code}: {last[-500:]}")
        out.seek(0)
        return wall, usage.ru_maxrss * 1024, json.load(out)  # Linux reports KiB


def log_fit(rows: list[dict]) -> np.poly1d | None:
    """The least-squares line of log wall time over log GPUs (None for fewer than two rungs)."""
    if len(rows) < 2:
        return None
    return np.poly1d(np.polyfit([math.log(r["gpus"]) for r in rows], [math.log(r["wall_s"]) for r in rows], 1))


def exponent(rows: list[dict]) -> float | None:
    """k of wall ~ GPUs^k: the slope of ``log_fit``."""
    fit = log_fit(rows)
    return None if fit is None else float(fit.coeffs[0])


def run_scale(max_gpus: int, as_json: bool, plot: str | None) -> int:
    from tqdm import tqdm
    ladder = [w for w in LADDER if REPLICA_GPUS * w <= max_gpus]
    servers = [n for n in COLLECTIVE_NODES if n * GPUS_PER_NODE <= max_gpus]
    rows, collectives = [], []
    try:
        for replicas in tqdm(ladder, desc="bench --scale", unit="rung", file=sys.stderr, disable=None):
            rows.append(run_case(replicas))
        for nodes in tqdm(servers, desc="bench --scale: collective", unit="rung", file=sys.stderr, disable=None):
            collectives.append(run_collective(nodes))
    except RuntimeError as err:  # a rung failed: its own error, in one line
        print(f"pipescope {err}", file=sys.stderr)
        return 1
    slope = exponent(rows)
    if plot:
        plot_scale(rows, collectives, plot)
    if as_json:
        print(json.dumps({"cases": rows, "exponent": slope, "target": TARGET, "collectives": collectives,
                          "collective_target": COLLECTIVE_TARGET}))
        return 0
    print(f"{'GPUs':>6} {'replicas':>8} {'replayed':>8} {'wall':>8} {'peak RSS':>9} {'ops':>8} {'flows':>8} "
          f"{'rate updates':>13} {'events/s':>9}")
    for r in rows:
        print(f"{r['gpus']:>6} {r['data_parallel']:>8} {r['replayed']:>8} {r['wall_s']:>7.1f}s "
              f"{r['peak_rss_bytes'] / 2**30:>6.2f} GiB "
              f"{r['ops']:>8} {r['flows']:>8} {r['rate_updates']:>13} {r['events_per_s']:>9.0f}")
    print(f"exponent (wall ~ GPUs^k): {'n/a' if slope is None else f'{slope:.2f}'}; target at {TARGET['gpus']:,} "
          f"GPUs: {TARGET['wall_s']:g} s and {TARGET['peak_rss_bytes'] / 2**30:g} GiB (issue 30)")
    print(f"interleaved p={PIPELINE} v={CHUNKS} m={MICROBATCHES}, tensor {TENSOR}, GPT 128 x 16384 at seq 8192 on "
          f"dgx-h100 servers; each rung a whole `pipescope simulate` in its own process (start included)")
    if collectives:
        print(f"\n{'GPUs':>6} {'servers':>8} {'wall':>8} {'peak RSS':>9}  all-reduce of 1 GiB")
        for c in collectives:
            print(f"{c['gpus']:>6} {c['nodes']:>8} {c['wall_s']:>7.1f}s {c['peak_rss_bytes'] / 2**30:>6.2f} GiB  "
                  f"{c['time_s'] * 1e3:.3f} ms, {c['algorithm']}, busbw {c['busbw_GBps']:.1f} GB/s")
        print(f"each a whole `pipescope collective --nodes N` in its own process; target at "
              f"{COLLECTIVE_TARGET['gpus']:,} GPUs: {COLLECTIVE_TARGET['wall_s']:g} s (issue 30)")
    return 0


def plot_scale(rows: list[dict], collectives: list[dict], path: str) -> None:
    """Wall time against GPUs on log-log axes, with the fit and issue 30's targets; the collective's rungs beside."""
    from pipescope.experiments.plots_style import plt, save_figure
    fig, ax = plt.subplots(figsize=(6, 4))
    gpus, walls, fit = [r["gpus"] for r in rows], [r["wall_s"] for r in rows], log_fit(rows)
    ax.loglog(gpus, walls, "o-", color="#4C72B0", label="measured (whole simulate)")
    if fit is not None:
        ax.loglog(gpus, np.exp(fit(np.log(gpus))), "--", color="grey", label=f"fit: wall ~ GPUs^{fit.coeffs[0]:.2f}")
    ax.loglog([TARGET["gpus"]], [TARGET["wall_s"]], "*", color="#C44E52", markersize=12,
              label=f"target: {TARGET['wall_s']:g} s at {TARGET['gpus']:,} GPUs")
    if collectives:
        ax.loglog([c["gpus"] for c in collectives], [c["wall_s"] for c in collectives], "s-", color="#55A868",
                  label="one 1 GiB all-reduce (collective)")
        ax.loglog([COLLECTIVE_TARGET["gpus"]], [COLLECTIVE_TARGET["wall_s"]], "*", color="#55A868", markersize=12,
                  label=f"target: {COLLECTIVE_TARGET['wall_s']:g} s at {COLLECTIVE_TARGET['gpus']:,} GPUs")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("wall time (s)")
    ax.set_title("pipescope bench --scale")
    ax.margins(0.15)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)
