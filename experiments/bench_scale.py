"""``pipescope bench --scale``: how the simulator's cost grows with the cluster (issue 30's ladder; README, "Speed").

One model and schedule, the GPT of issue 30's 16,384-GPU case (128 layers, hidden 16,384, seq 8,192, vocabulary
128,000; interleaved pipeline 16 x 2, 16 microbatches, tensor 8, dgx-h100 servers), with ever more data-parallel
replicas: 1, 2, 8, 32 and 128, so 128 to 16,384 GPUs (a pipeline is 128 GPUs, so the ladder starts there). Each
rung is a whole ``pipescope simulate --json`` in a child process, so that its wall time includes the start and
its peak memory (the child's maximum resident set, from ``wait4``) is its own. Events are what the replay
scheduled: ops, flows started and fair-share rate updates (each a SimPy event). The exponent is the least-squares
slope of log wall time against log GPUs: 1 means linear.
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
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "pipescope.experiments.cli", *case_args(replicas)],
                                 stdout=out, stderr=err)  # files, not pipes: the JSON of 16,384 GPUs fills a pipe
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            err.seek(0)
            last = (err.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"bench --scale: {replicas} replicas exited {child.returncode}: {last[-500:]}")
        out.seek(0)
        result = json.load(out)
    network = result["network"]
    events = result["ops"] + network.get("flows", 0) + network.get("rate_updates", 0)
    return {"gpus": REPLICA_GPUS * replicas, "data_parallel": replicas, "wall_s": wall,
            "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
            "simulated_s": result["sim_wall_s"], "ops": result["ops"], "flows": network.get("flows", 0),
            "rate_updates": network.get("rate_updates", 0), "events_per_s": events / wall,
            "iteration_time_s": result["iteration_time_s"]}


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
    rows = []
    try:
        for replicas in tqdm(ladder, desc="bench --scale", unit="rung", file=sys.stderr, disable=None):
            rows.append(run_case(replicas))
    except RuntimeError as err:  # a rung's simulate failed: its own error, in one line
        print(f"pipescope {err}", file=sys.stderr)
        return 1
    slope = exponent(rows)
    if plot:
        plot_scale(rows, plot)
    if as_json:
        print(json.dumps({"cases": rows, "exponent": slope, "target": TARGET}))
        return 0
    print(f"{'GPUs':>6} {'replicas':>8} {'wall':>8} {'peak RSS':>9} {'ops':>8} {'flows':>8} {'rate updates':>13} "
          f"{'events/s':>9}")
    for r in rows:
        print(f"{r['gpus']:>6} {r['data_parallel']:>8} {r['wall_s']:>7.1f}s {r['peak_rss_bytes'] / 2**30:>6.2f} GiB "
              f"{r['ops']:>8} {r['flows']:>8} {r['rate_updates']:>13} {r['events_per_s']:>9.0f}")
    print(f"exponent (wall ~ GPUs^k): {'n/a' if slope is None else f'{slope:.2f}'}; target at {TARGET['gpus']:,} "
          f"GPUs: {TARGET['wall_s']:g} s and {TARGET['peak_rss_bytes'] / 2**30:g} GiB (issue 30)")
    print(f"interleaved p={PIPELINE} v={CHUNKS} m={MICROBATCHES}, tensor {TENSOR}, GPT 128 x 16384 at seq 8192 on "
          f"dgx-h100 servers; each rung a whole `pipescope simulate` in its own process (start included)")
    return 0


def plot_scale(rows: list[dict], path: str) -> None:
    """Wall time against GPUs on log-log axes, with the fit and issue 30's target."""
    from pipescope.experiments.plots_style import plt, save_figure
    fig, ax = plt.subplots(figsize=(6, 4))
    gpus, walls, fit = [r["gpus"] for r in rows], [r["wall_s"] for r in rows], log_fit(rows)
    ax.loglog(gpus, walls, "o-", color="#4C72B0", label="measured (whole simulate)")
    if fit is not None:
        ax.loglog(gpus, np.exp(fit(np.log(gpus))), "--", color="grey", label=f"fit: wall ~ GPUs^{fit.coeffs[0]:.2f}")
    ax.loglog([TARGET["gpus"]], [TARGET["wall_s"]], "*", color="#C44E52", markersize=12,
              label=f"target: {TARGET['wall_s']:g} s at {TARGET['gpus']:,} GPUs")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("wall time (s)")
    ax.set_title("pipescope bench --scale")
    ax.margins(0.15)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)
