"""``pipescope sweep``: run an experiment file's grid over a process pool or a Dask cluster (docs/sweeps.md)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipescope.config import ConfigError
from pipescope.experiments.cli import integer_flag, usage_error
from pipescope.experiments.processes import sigterm_as_ctrl_c
from pipescope.simulator.readers.units import counted

if TYPE_CHECKING:  # the simulator loads when a sweep runs, not for every 'pipescope --help'
    from pipescope.experiments.sweep import SweepPlan, SweepReport

EXIT_FAILED_RUNS = 1  # every run was tried, but some ended in an error or were lost with a worker
MAX_WORKERS = 1024
MAX_CHUNK = 10_000
DASK_ADDRESS = r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}"
SUMMARY_ROWS = 20


@dataclass(frozen=True)
class SweepOptions:
    """The flags, checked: where to run and write."""

    workers: int | None
    chunk_size: int | None
    dask: str | None
    out: Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``sweep`` parser to the ``pipescope`` subcommands."""
    p = sub.add_parser(
        "sweep", help="run an experiment file's grid over processes or Dask; resumable, to Parquet and CSV",
        description="Expand FILE's sweep: grid (the cartesian product of dotted keys) and zip: lists (varied "
                    "together), validate every run before any starts, run them in chunks over a process pool or a "
                    "Dask cluster, log one JSON line per finished run (a re-run skips those), and write "
                    "results.parquet and results.csv (docs/sweeps.md).")
    p.add_argument("file", metavar="FILE.yaml", help="experiment file: a config plus sweep: and zip: sections, or "
                   "the name of one in pipescope/configs")
    p.add_argument("--workers", metavar="N", help="worker processes of the pool or of --dask local (default: the "
                   f"CPUs this process may use; 1 to {MAX_WORKERS})")
    p.add_argument("--dask", metavar="local|tcp://HOST:PORT", help="run on Dask instead of a process pool: 'local' "
                   "starts a cluster listening on 127.0.0.1 only; tcp://HOST:PORT joins a running scheduler. That "
                   "address is trusted input: Dask unpickles what its scheduler and workers send, so name only a "
                   "cluster you control")
    p.add_argument("--out", metavar="DIR", help="folder for runs.jsonl, results.parquet and results.csv (default: "
                   "sweeps/<FILE's name>); running again into the same folder skips the runs already logged")
    p.add_argument("--chunk-size", metavar="K", help=f"runs per task (default: about 8 tasks per worker, at most "
                   f"64; 1 to {MAX_CHUNK:,})")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Check the flags and every run, sweep, print the summary; exit 2 (nothing run) on bad input."""
    from pipescope.experiments.sweep import expand

    try:
        options = _options(args)
        plan = expand(args.file)
    except (ConfigError, ValueError) as err:
        return usage_error(str(err))
    try:
        with sigterm_as_ctrl_c():
            report = _sweep(plan, options)
    except OSError as err:  # the log or a table (a full disk); dask_executor names --dask itself (a ConfigError)
        return usage_error(f"--out: cannot write {err.filename!r} ({err.strerror})" if err.filename
                           else f"sweep: {err}")
    print(summary(plan, report))
    failed = int((report.frame["status"] != "ok").sum()) if len(report.frame) else 0
    return EXIT_FAILED_RUNS if failed or report.lost else 0


def check_pool_flags(workers: int | None, dask: str | None) -> None:
    """ValueError naming the flag: a --dask address that is not local or tcp://HOST:PORT, --workers beside a remote
    cluster, or --dask without dask.distributed installed."""
    if dask is not None and dask != "local" and not re.fullmatch(DASK_ADDRESS, dask):
        raise ValueError(f"--dask: got {dask[:80]!r}, expected local or tcp://HOST:PORT")
    if dask not in (None, "local") and workers is not None:
        raise ValueError(f"--workers: got {workers} with --dask {dask}, expected no --workers: the cluster has its own")
    if dask is not None and importlib.util.find_spec("distributed") is None:
        raise ValueError("--dask: needs dask.distributed: pip install 'pipescope[sweep]'")


def _options(args: argparse.Namespace) -> SweepOptions:
    workers = integer_flag("--workers", args.workers, 1, MAX_WORKERS) if args.workers is not None else None
    chunk = integer_flag("--chunk-size", args.chunk_size, 1, MAX_CHUNK) if args.chunk_size is not None else None
    check_pool_flags(workers, args.dask)
    if importlib.util.find_spec("pyarrow") is None:
        raise ValueError("--out: results.parquet needs pyarrow: pip install 'pipescope[sweep]'")
    if args.out is not None and not args.out.strip():  # Path("") is the working folder: not what anyone asked for
        raise ValueError(f"--out: got {args.out!r}, expected a folder name (made if missing)")
    out = Path(args.out) if args.out is not None else Path("sweeps") / re.sub(r"\.ya?ml$", "", Path(args.file).name)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {str(out)!r} is a file, expected a folder (made if missing)")
    return SweepOptions(workers, chunk, args.dask, out)


def _sweep(plan: SweepPlan, options: SweepOptions) -> SweepReport:
    from pipescope.experiments.sweep import dask_executor, run_sweep

    if options.dask is None:
        return run_sweep(plan, options.out, workers=options.workers, chunk_size=options.chunk_size)
    with dask_executor(options.dask, options.workers) as (executor, threads):
        return run_sweep(plan, options.out, executor, threads, options.chunk_size)


def summary(plan: SweepPlan, report: SweepReport) -> str:
    """The counts, up to SUMMARY_ROWS rows of the swept keys and the main metrics, the first errors, the files."""
    frame = report.frame
    ok = int((frame["status"] == "ok").sum()) if len(frame) else 0
    rate = f" ({report.ran / report.wall_s:.1f} runs/s)" if report.ran else ""
    lines = [f"sweep: {len(plan.runs)} runs ({plan.combinations} combinations): {report.ran} run now, "
             f"{report.skipped} already logged, {ok} ok, {len(frame) - ok} error, {len(report.lost)} lost; "
             f"{report.wall_s:.1f} s{rate}"]
    if report.unreadable:
        lines.append(f"warning: {counted(report.unreadable, 'line')} of {os.path.join(report.out, 'runs.jsonl')} "
                     f"could not be read (damaged, or not what their run wrote) and were skipped; any run of this "
                     f"sweep they held ran again")
    if len(frame):
        lines.append(_table(frame, plan))
    errors = frame[frame["status"] != "ok"] if len(frame) else frame
    swept = [column for key in plan.keys for column in _columns_of(frame, key, plan)] if len(frame) else []
    lines += [f"error: {_point(row, swept)} (run {row['run_id']}): {row['error']}"
              for _, row in errors.head(3).iterrows()]
    points = {run.run_id: run.overrides for run in plan.runs}
    lines += [f"lost: {_point(points.get(rid, {}), list(points.get(rid, {})))} (run {rid}): {why}"
              for rid, why in report.lost[:3]]
    if report.lost:
        lines.append("lost runs ran on no worker to the end; run the same command again to retry them")
    lines.append(f"wrote {os.path.join(report.out, 'results.parquet')} and results.csv (one line per run in "
                 f"runs.jsonl)")
    return "\n".join(lines)


def _columns_of(frame, key: str, plan: SweepPlan) -> list[str]:
    """The table's columns for a swept key: its own; for a whole section (``costs: [{kind: uniform}, ...]``), the
    keys its values set; none for a key of another cost kind than the runs'."""
    if key in frame.columns:
        return [key]
    named = dict.fromkeys(f"{key}.{inner}" for run in plan.runs if isinstance(run.overrides.get(key), dict)
                          for inner in run.overrides[key])
    return [column for column in named if column in frame.columns]


def _point(values, keys: list[str]) -> str:
    """``schedule.name=zb-v, schedule.stages=8``: the swept keys and values of one run."""
    return ", ".join(f"{key}={values[key]}" for key in keys) or "the base config"


def _table(frame, plan: SweepPlan) -> str:
    shown = frame.head(SUMMARY_ROWS)
    swept = [column for key in plan.keys for column in _columns_of(frame, key, plan)]
    table = shown[[*swept, "status", "iteration_time_s", "throughput_samples_per_s", "tokens_per_s",
                   "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "bubble_rate"]].copy()
    table["peak_memory_GiB"] = shown["peak_memory_bytes"].astype("Float64") / 2**30
    table["oom"] = shown["oom"]
    text = table.to_string(index=False, float_format=lambda x: f"{x:.4g}")
    more = len(frame) - len(shown)
    return text + (f"\n... and {more} more rows in results.csv" if more > 0 else "")
