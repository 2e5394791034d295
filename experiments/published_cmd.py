"""``pipescope validate --published [NAME ...]``: simulate every run of the corpus of published measurements
(``experiments/published.py``) as its configuration says, through the sweep's executor path (a process pool or
Dask), and report predicted against measured with the signed error, per run, per source and in all
(docs/validation.md, "Published runs").

Where a source left settings unstated, each choice is simulated and the fastest that fits memory is taken, as the
run's authors would have, and the report says which.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import Executor
from typing import Any

from pipescope.config import ConfigError
from pipescope.experiments.published import (
    PublishedRun,
    choices,
    config_of,
    load_corpus,
    measured_value,
    relative_error,
    select,
)
from pipescope.simulator.readers.units import format_bytes

TARGETS = {"time_mean": 0.05, "time_worst": 0.10, "source_mean": 0.07, "memory_worst": 0.05}  # issue 27's


def run_published(runs: list[PublishedRun], executor: Executor | None = None, workers: int | None = None,
                  progress: bool = True) -> list[dict[str, Any]]:
    """One row per run: its best choice's prediction against the measurement.

    Raises:
        ConfigError: a run's configuration is refused before anything runs, naming the run and the key.
    """
    from pipescope.experiments.sweep import MemoryLog, Run, counted_bar, drain, process_pool, run_id, validated_config

    items: list[tuple[PublishedRun, dict[str, int], Run]] = []
    for run in runs:
        for chosen in choices(run):
            try:
                config = validated_config(config_of(run, chosen), {})
            except (ConfigError, ValueError) as err:  # the run's layout and machine file: named with the run
                raise ConfigError(f"--published: {run.name}: {err}", key="--published") from None
            items.append((run, chosen, Run(run_id(config), config, {})))
    # A time and a memory measurement of one run are one simulation; the largest first, so the last are short.
    unique = list({item[2].run_id: item[2] for item in sorted(items, key=lambda item: -item[0].gpus)}.values())
    workers = workers or len(os.sched_getaffinity(0))
    pool = executor or process_pool(min(workers, len(unique)))
    rows = MemoryLog()
    try:
        lost = drain(pool, [[each] for each in unique], rows, 2 * workers,
                     counted_bar(len(unique), "published", "run", progress), task=simulate_chunk)
    finally:
        if executor is None:
            pool.shutdown(wait=True, cancel_futures=True)
    results = {row["run_id"]: row for row in rows}
    for rid, why in lost:
        results[rid] = {"run_id": rid, "status": "error", "error": f"lost with a worker: {why}"}
    return [_best(run, [(chosen, results[r.run_id]) for each, chosen, r in items if each is run]) for run in runs]


def simulate_chunk(chunk: list) -> list[dict[str, Any]]:
    """Simulate each run of a chunk in a worker (the sweep's task signature); an error is a row, not an exception."""
    from pipescope.experiments.sweep import one_line
    from pipescope.runner import run

    rows = []
    for item in chunk:
        started = time.perf_counter()
        try:
            result = run(item.config)
        except Exception as err:  # one run's failure is its row; the others go on
            rows.append({"run_id": item.run_id, "status": "error", "error": one_line(err)})
            continue
        rows.append({"run_id": item.run_id, "status": "ok", "iteration_time_s": result.iteration_time_s,
                     "peak_memory_bytes": result.peak_memory_bytes, "oom": bool(result.oom), "mfu": result.mfu,
                     "hfu": result.hfu, "device_peaks": [d.peak_memory_bytes for d in result.devices],
                     "overheads": result.memory_overheads.as_dict(), "warnings": list(result.warnings),
                     "wall_s": time.perf_counter() - started})
    return rows


def _best(run: PublishedRun, tried: list[tuple[dict[str, int], dict]]) -> dict[str, Any]:
    """The run's row: of its choices, the fastest that fits (the fastest of all when none does)."""
    ok = [(chosen, row) for chosen, row in tried if row["status"] == "ok"]
    row = {"name": run.name, "source": run.source.name, "quantity": run.quantity, "gpus": run.gpus,
           "measured": measured_value(run), "measure": run.measure, "unstated": sorted(run.unstated)}
    if not ok:
        return {**row, "status": "error", "error": tried[0][1]["error"], "predicted": None, "error_rel": None}
    fits = [item for item in ok if not item[1]["oom"]] or ok
    chosen, best = min(fits, key=lambda item: item[1]["iteration_time_s"])
    predicted = best["iteration_time_s"] if run.quantity == "time" else _memory(run, best)
    return {**row, "status": "ok", "predicted": predicted, "error_rel": relative_error(predicted, row["measured"]),
            "chosen": chosen, "oom": best["oom"], "mfu": best["mfu"], "hfu": best["hfu"],
            "iteration_time_s": best["iteration_time_s"], "warnings": best["warnings"],
            "wall_s": sum(r.get("wall_s", 0) for _, r in ok)}


def _memory(run: PublishedRun, row: dict) -> int:
    """The predicted peak of the device the source measured (the largest when it names none), as its source
    measured it: torch's ``allocated`` only what its allocator handed out (not the CUDA context or NCCL's buffers),
    ``nvidia-smi`` the whole process with the allocator's reserve (``memory_overheads.nvidia_smi_bytes``)."""
    from pipescope.simulator.memory_overheads import Overheads, nvidia_smi_bytes

    peaks, overheads = row["device_peaks"], Overheads(**row["overheads"])
    peak = max(peaks) if run.device is None else peaks[run.device]  # the loader checked it is a pipeline device
    if run.source.memory_measure == "allocated":
        return peak - overheads.cuda_context - overheads.nccl
    return nvidia_smi_bytes(peak, overheads)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and worst absolute error per source and quantity, and over all runs of each quantity."""
    out: dict[str, Any] = {"sources": {}, "time": None, "memory": None}
    for quantity in ("time", "memory"):
        scored = [row for row in rows if row["quantity"] == quantity and row["status"] == "ok"]
        out[quantity] = _errors(scored)
        for source in sorted({row["source"] for row in scored}):
            out["sources"].setdefault(source, {})[quantity] = _errors([r for r in scored if r["source"] == source])
    out["failed"] = [row["name"] for row in rows if row["status"] != "ok"]
    return out


def _errors(rows: list[dict]) -> dict[str, Any] | None:
    if not rows:
        return None
    errors = [abs(row["error_rel"]) for row in rows]
    worst = max(rows, key=lambda row: abs(row["error_rel"]))
    return {"runs": len(rows), "mean_abs_error": statistics.fmean(errors),
            "median_abs_error": statistics.median(errors), "worst_abs_error": abs(worst["error_rel"]),
            "worst": worst["name"], "mean_signed_error": statistics.fmean(row["error_rel"] for row in rows)}


def table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The per-run table and the per-source summary, for a person."""
    lines = [f"{'run':<34} {'GPUs':>5} {'measured':>12} {'predicted':>12} {'error':>8}  chosen"]
    for row in rows:
        chosen = ", ".join(f"{key}={value}" for key, value in row.get("chosen", {}).items()) or ""
        if row["status"] != "ok":
            lines.append(f"{row['name']:<34} {row['gpus']:>5} {_value(row, row['measured']):>12} "
                         f"{'error':>12}           {row['error']}")
            continue
        flag = " (OOM)" if row["oom"] else ""
        lines.append(f"{row['name']:<34} {row['gpus']:>5} {_value(row, row['measured']):>12} "
                     f"{_value(row, row['predicted']):>12} {row['error_rel']:>+8.1%}  {chosen}{flag}")
    lines += ["", f"{'source':<24} {'of':<7} {'runs':>4} {'mean |error|':>13} {'worst':>8}"]
    for source, scored in summary["sources"].items():
        lines += [_summary_line(source, quantity, errors) for quantity, errors in scored.items() if errors]
    lines += [_summary_line("all", quantity, summary[quantity]) for quantity in ("time", "memory") if summary[quantity]]
    if summary["failed"]:
        lines.append(f"failed: {', '.join(summary['failed'])}")
    lines += [f"warning: {row['name']}: {warning}" for row in rows for warning in row.get("warnings", ())]
    return "\n".join(lines)


def _summary_line(name: str, quantity: str, errors: dict) -> str:
    return (f"{name:<24} {quantity:<7} {errors['runs']:>4} {errors['mean_abs_error']:>13.1%} "
            f"{errors['worst_abs_error']:>8.1%}  ({errors['worst']})")


def _value(row: dict, value: float) -> str:
    """Seconds, or bytes in the source's own unit (the zero-bubble paper's GB of 10^9 bytes, nvidia-smi's GiB)."""
    if row["quantity"] == "time":
        return f"{value:.3f} s"
    return f"{value / 1e9:.2f} GB" if row["measure"] == "peak_memory_gb" else format_bytes(int(value))


def as_json(rows: list[dict[str, Any]], summary: dict[str, Any], wall_s: float) -> str:
    return json.dumps({"runs": rows, "summary": summary, "targets": TARGETS, "wall_s": wall_s},
                      default=lambda value: None if isinstance(value, float) and not math.isfinite(value) else value)


def cmd_published(args: argparse.Namespace, names: list[str], workers: int | None) -> int:
    """Run the corpus (or the runs and sources ``names``), print the table or JSON, draw ``--plot``; exit 1 when a
    run failed or the worst error, in time or memory, is above ``--max-error``; 2 on bad input."""
    started = time.perf_counter()
    runs = select(load_corpus(args.corpus), names)
    if args.dask is None:
        rows = run_published(runs, workers=workers, progress=not args.no_progress)  # the bar on stderr
    else:
        from pipescope.experiments.sweep import dask_executor

        with dask_executor(args.dask, workers) as (executor, threads):
            rows = run_published(runs, executor, threads, progress=not args.no_progress)
    summary = summarize(rows)
    print(as_json(rows, summary, time.perf_counter() - started) if args.json else table(rows, summary))
    if args.plot:
        from pipescope.experiments.plots_published import write_published_plot

        write_published_plot(rows, args.plot)
    limit = args.max_error
    worst = max(((summary[quantity]["worst_abs_error"], summary[quantity]["worst"])
                 for quantity in ("time", "memory") if summary[quantity]), default=(0.0, None))
    if limit is not None and worst[0] > limit:  # the exit code's reason, where a person reads it
        print(f"pipescope: the worst error, {worst[0]:.1%} ({worst[1]}), is above --max-error {limit:g}",
              file=sys.stderr)
    return 1 if limit is not None and worst[0] > limit or summary["failed"] else 0
