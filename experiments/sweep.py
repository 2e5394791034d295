"""Sweeps: an experiment file's grid, validated, run over any ``concurrent.futures.Executor``, kept as JSON lines.

An experiment file is a config (the sections of docs/cli.md) plus ``sweep:`` (dotted key -> list: the cartesian
product) and ``zip:`` (dotted key -> list, all the same length: varied together). ``expand`` turns it into runs,
each validated by ``load_config`` before anything runs. ``run_sweep`` fans them out in chunks over a process pool or
a Dask cluster (``Client.get_executor()``: one code path for both), appends one line per finished run to
``runs.jsonl`` keyed by a hash of its config (so a re-run skips them), and consolidates to ``results.parquet`` and
``results.csv``. docs/sweeps.md.

Example::

    from pipescope.experiments.sweep import expand, run_sweep
    report = run_sweep(expand("p3.16xlarge-gpt-2.2b-schedules"), "out", workers=2)
    report.frame.groupby("schedule.name")["iteration_time_s"].min()
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import fcntl
import hashlib
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from pipescope.config import EXPERIMENT_KEYS, Config, ConfigError, _merge, load_config, read_yaml
from pipescope.runner import run
from pipescope.simulator.files import write_atomic
from pipescope.simulator.result import SimResult
from pipescope.simulator.schedules import named_generator
from pipescope.simulator.units import short_repr

# Validation takes ~0.6 ms a run (mostly load_config), so the cap costs ~1 min before the first run; a bigger study is
# several files (or several --out folders), each resumable on its own.
MAX_RUNS = 100_000
MAX_DEFAULT_CHUNK = 64
METRICS = ("iteration_time_s", "throughput_samples_per_s", "bubble_rate", "peak_memory_bytes",
           "memory_capacity_bytes", "oom", "mfu", "gpus", "exposed_allreduce_s")


@dataclass(frozen=True)
class Run:
    """One point of the grid: its validated config, the swept values that made it, and its id (``run_id``)."""

    run_id: str
    config: Config
    overrides: dict[str, Any]


@dataclass(frozen=True)
class SweepPlan:
    """The runs of an experiment in grid order, duplicates (two combinations with one resolved config) dropped."""

    runs: list[Run]
    combinations: int
    keys: tuple[str, ...]  # the swept dotted keys, sweep's then zip's, in file order


@dataclass
class SweepReport:
    """What ``run_sweep`` did: the consolidated rows (grid order) and the counts behind the summary."""

    frame: pd.DataFrame  # one row per finished run
    ran: int  # runs finished by this call
    skipped: int  # runs already in runs.jsonl (resumed)
    lost: list[tuple[str, str]]  # (run_id, why) of runs no worker finished (re-run them by running the sweep again)
    wall_s: float
    out: Path
    unreadable: int = 0  # lines of runs.jsonl that could not be read when the sweep started


def expand(experiment: str | os.PathLike | Mapping[str, Any]) -> SweepPlan:
    """The runs of an experiment file (a path, or a shipped name as ``--config`` takes) or of its mapping.

    A file without ``sweep:`` or ``zip:`` is a one-run plan.

    Raises:
        ConfigError: one line naming the key, the value and what was expected: a malformed grid, more than
            MAX_RUNS runs, or any combination ``load_config`` refuses (or with an unknown schedule name).
    """
    raw = _read_experiment(experiment) if not isinstance(experiment, Mapping) else dict(experiment)
    base = {key: value for key, value in raw.items() if key not in EXPERIMENT_KEYS}
    axes = _axes(raw.get("sweep", {}), raw.get("zip", {}))
    count = math.prod(len(axis) for axis in axes)
    if count > MAX_RUNS:
        sizes = " x ".join(str(len(axis)) for axis in axes)
        raise ConfigError(f"sweep: {sizes} = {count:,} runs, expected at most {MAX_RUNS:,} (split the grid over "
                          f"several experiment files)", key="sweep")
    runs: dict[str, Run] = {}
    for parts in itertools.product(*axes):
        overrides = {key: value for part in parts for key, value in part.items()}
        config = validated_config(base, overrides)
        rid = run_id(config)
        runs.setdefault(rid, Run(rid, config, overrides))
    keys = tuple(key for axis in axes for key in axis[0])
    return SweepPlan(list(runs.values()), count, keys)


def _read_experiment(name: str | os.PathLike) -> dict:
    """The file as a mapping (``read_yaml``: size, alias and nesting limits), its errors naming FILE."""
    try:
        return read_yaml(os.fspath(name))
    except ConfigError as err:
        raise ConfigError(str(err).replace("--config:", "FILE:", 1), key="FILE") from None


def _axes(grid: Any, zipped: Any) -> list[list[dict[str, Any]]]:
    """Each ``sweep`` key is an axis of one-key choices; ``zip`` is one axis whose choices set every zip key."""
    sweep, zips = _lists("sweep", grid), _lists("zip", zipped)
    axes = [[{key: value} for value in values] for key, values in sweep.items()]
    for key in zips:
        if key in sweep:
            raise ConfigError(f"zip.{key}: also in sweep, expected each key in one of sweep and zip", key=f"zip.{key}")
    lengths = {key: len(values) for key, values in zips.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{key} has {n}" for key, n in lengths.items())
        raise ConfigError(f"zip: lists of different lengths ({shown}), expected all the same length", key="zip")
    if zips:
        axes.append([dict(zip(zips, values)) for values in zip(*zips.values())])
    return axes


def _lists(section: str, value: Any) -> dict[str, list]:
    """``sweep:`` or ``zip:`` checked: a mapping of dotted keys to non-empty lists (a key left empty is refused)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{section}: got {short_repr(value)}, expected a mapping of dotted keys to lists, "
                          f"e.g. schedule.stages: [4, 8]", key=section)
    for key, values in value.items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"{section}: key {short_repr(key)}, expected a dotted key such as schedule.stages",
                              key=section)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{section}.{key}: got {short_repr(values)}, expected a non-empty list of values",
                              key=f"{section}.{key}")
    return value


def validated_config(base: dict, overrides: dict[str, Any]) -> Config:
    """The base config with one combination set, through the normal loader (a copy: ``_merge`` edits in place)."""
    tree = copy.deepcopy(base)
    for key, value in overrides.items():
        _merge(tree, key.split("."), value)
    config = load_config(raw=tree)
    _check_schedule_name(config.schedule.name)
    return config


def _check_schedule_name(name: str) -> None:
    """A generator name typo fails here, before any run, not once per run (torch: and csv: are checked when run)."""
    if name.startswith(("torch:", "csv:")):
        return
    try:
        named_generator(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def config_columns(config: Config) -> dict[str, Any]:
    """The config as flat dotted columns (``schedule.stages``) of JSON scalars: enums as their value, integer lists
    as ``5,6,6,5`` (the ``--set`` spelling)."""
    return dict(_flatten(config, ""))


def _flatten(section: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """Walks the dataclasses themselves: ``dataclasses.asdict`` deep-copies every value, and took most of the time."""
    for field in dataclasses.fields(section):
        key, value = field.name, getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            yield from _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, enum.Enum):
            yield f"{prefix}{key}", value.value
        elif isinstance(value, (tuple, list)):
            yield f"{prefix}{key}", ",".join(str(item) for item in value)
        else:
            yield f"{prefix}{key}", value


def run_id(config: Config) -> str:
    """16 hex digits of the SHA-256 of the config's columns: the same config always gets the same id."""
    text = json.dumps(config_columns(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"pipescope-run-v1 {text}".encode()).hexdigest()[:16]


def run_chunk(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Run each config in a worker and return one row each; a failing run becomes an error row, not an exception."""
    return [_run_row(item) for item in runs]


def _run_row(item: Run) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = run(item.config)
    except Exception as err:  # any failure is one run's result; the sweep goes on
        return _row(item.run_id, config_columns(item.config), None, _one_line(err), time.perf_counter() - started)
    # the run's config: what the file left unset filled in with what ran (``runner._with_what_ran``)
    return _row(item.run_id, config_columns(result.config), result, None, time.perf_counter() - started)


def _one_line(err: Exception) -> str:
    """Our errors are one line naming the key; anything else also names its type."""
    text = " ".join(str(err).split())
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"


def _row(rid: str, columns: dict, result: SimResult | None, error: str | None, wall_s: float) -> dict[str, Any]:
    metrics = _metrics(result) if result is not None else dict.fromkeys(METRICS)
    return {"run_id": rid, "status": "error" if error else "ok", "error": error, **columns, **metrics,
            "run_wall_s": wall_s}


def _metrics(result: SimResult) -> dict[str, Any]:
    return {"iteration_time_s": result.iteration_time_s, "throughput_samples_per_s": result.throughput_samples_per_s,
            "bubble_rate": result.bubble_rate, "peak_memory_bytes": result.peak_memory_bytes,
            "memory_capacity_bytes": result.memory_capacity_bytes, "oom": bool(result.oom), "mfu": result.mfu,
            "gpus": result.records.num_devices, "exposed_allreduce_s": result.exposed_allreduce_s}


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which stops the sweep (else each worker prints a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class WorkerPool(ProcessPoolExecutor):
    """A process pool whose workers a second Ctrl-C can stop at once (``kill``): the pool's own shutdown lets every
    worker finish the task it holds first."""

    def kill(self) -> None:
        # ProcessPoolExecutor keeps its worker processes by pid in _processes (since 3.2); asking the workers for
        # their pids instead misses any that a warm worker's answering for it left idle
        for pid in list(self._processes or {}):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def process_pool(workers: int) -> WorkerPool:
    """A pool whose workers fork from a server that imported the simulator once: fast to start, and safe beside
    threads (tqdm's monitor, a Dask client) where a plain fork is not."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    pool = WorkerPool(workers, mp_context=context, initializer=_ignore_sigint)
    # Start every worker now. The pool starts them one per submit otherwise, and a shutdown that lands (Ctrl-C,
    # SIGTERM) while one is still starting can leave it without the sentinel it waits for: shutdown then hangs.
    try:
        for started in [pool.submit(os.getpid) for _ in range(workers)]:
            started.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    return pool


@contextmanager
def dask_executor(address: str, workers: int | None = None) -> Iterator[tuple[Executor, int]]:
    """(executor, worker threads) of a Dask cluster: ``local`` starts one on 127.0.0.1 (``workers`` processes of one
    thread, no dashboard); a ``tcp://HOST:PORT`` address joins a running scheduler, which is trusted (Dask's
    protocol unpickles what the scheduler sends)."""
    from distributed import Client, LocalCluster

    cluster = None
    if address == "local":
        # Loopback only; no dashboard, and the scheduler's own HTTP server on a free loopback port, not :8787.
        cluster = LocalCluster(n_workers=workers or len(os.sched_getaffinity(0)), threads_per_worker=1, processes=True,
                               host="127.0.0.1", dashboard_address=None, silence_logs=logging.ERROR,
                               scheduler_kwargs={"dashboard_address": "127.0.0.1:0"})
        client = Client(cluster)
    else:
        client = Client(address, timeout="20s")
    try:
        yield client.get_executor(), max(1, sum(client.nthreads().values()))
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def default_chunk_size(runs: int, workers: int) -> int:
    """About 8 chunks per worker: few enough to amortise per-task overhead, enough to balance uneven runs."""
    return max(1, min(MAX_DEFAULT_CHUNK, math.ceil(runs / (8 * workers))))


def run_sweep(plan: SweepPlan, out: str | os.PathLike, executor: Executor | None = None, workers: int | None = None,
              chunk_size: int | None = None, progress: bool = True) -> SweepReport:
    """Run the plan's unfinished runs and consolidate ``out``/results.parquet and results.csv.

    Args:
        executor: any ``concurrent.futures.Executor`` (``dask_executor``'s, say); None: a process pool of
            ``workers`` (default: the CPUs this process may use), shut down at the end.
        workers: also the number of chunks kept in flight (two per worker).
        progress: a tqdm bar (rate and ETA) on stderr.
    """
    started = time.perf_counter()
    workers = workers or len(os.sched_getaffinity(0))
    with RunLog(Path(out) / "runs.jsonl") as log:
        done, unreadable = log.finished_ids()
        todo = [item for item in plan.runs if item.run_id not in done]
        size = chunk_size or default_chunk_size(len(todo), workers)
        chunks = [todo[i:i + size] for i in range(0, len(todo), size)]
        own = executor is None and bool(chunks)
        pool = process_pool(min(workers, len(chunks))) if own else executor
        ids = [item.run_id for item in plan.runs]
        try:
            bar = counted_bar(len(plan.runs), "sweep", "run", progress, len(plan.runs) - len(todo))
            lost = drain(pool, chunks, log, 2 * workers, bar)
        except KeyboardInterrupt:  # the tables of what is logged, to look at; the same command resumes the rest
            partial = write_results(Path(out), ids)
            print(f"pipescope: interrupted: wrote {Path(out) / 'results.parquet'} and results.csv with the "
                  f"{len(partial)} of {len(ids)} runs logged; run the same command again to resume", file=sys.stderr)
            raise
        finally:
            if own:
                pool.shutdown(wait=True, cancel_futures=True)
        frame = write_results(Path(out), ids)
    return SweepReport(frame, len(todo) - len(lost), len(plan.runs) - len(todo), lost, time.perf_counter() - started,
                       Path(out), unreadable)


def counted_bar(total: int, desc: str, unit: str, enabled: bool, initial: int = 0):
    """A tqdm bar on stderr over ``total`` items (the sweep's runs, the planner's configs), off when not
    ``enabled``; ``drain`` enters it and updates it a chunk at a time."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit=unit, desc=desc, disable=not enabled, smoothing=0.1)


def drain(executor: Executor, chunks: list[list[Run]], log: RunLog, window: int, bar, task=None
          ) -> list[tuple[str, str]]:
    """Submit chunks, at most ``window`` in flight, and log each chunk's rows as it ends (one fsync a chunk). ``task``
    (default ``run_chunk``) runs one chunk in a worker; the planner passes its own, and an in-memory ``log``. A chunk
    whose task failed (a worker died) is lost, not logged, so running the sweep again retries it. On Ctrl-C the
    chunks already running are waited for and logged; a second Ctrl-C stops our own pool's workers at once, and
    their chunks are not logged."""
    pending: dict[Future, list[Run]] = {}
    queue, lost = iter(chunks), []
    with bar:
        try:
            while True:
                for chunk in itertools.islice(queue, max(0, window - len(pending))):
                    try:
                        pending[executor.submit(task or run_chunk, chunk)] = chunk
                    except Exception as err:  # a broken executor (a pool whose worker died) takes no more tasks
                        lost.extend((item.run_id, _one_line(err)) for rest in [chunk, *queue] for item in rest)
                if not pending:
                    return lost
                _collect(wait(pending, return_when=FIRST_COMPLETED)[0], pending, log, bar, lost)
        except KeyboardInterrupt:
            running = {future: chunk for future, chunk in pending.items() if not future.cancel()}
            bar.write(f"pipescope: stopping: logging the {len(running)} chunks still running (Ctrl-C again to "
                      f"stop them unlogged)", file=sys.stderr)
            try:
                _collect(wait(running)[0], running, log, bar, lost)
            except KeyboardInterrupt:  # the second: the workers stop now, their chunks unlogged (a re-run runs them)
                if isinstance(executor, WorkerPool):
                    executor.kill()
                raise
            raise


def _collect(finished: set[Future], pending: dict[Future, list[Run]], log: RunLog, bar, lost: list) -> None:
    """Log the rows of each finished chunk; a chunk whose task failed (not its runs: the executor) is lost."""
    for future in finished:
        chunk = pending.pop(future)
        try:
            rows = future.result()
        except Exception as err:  # the executor failed, not the run: retried on re-run
            lost.extend((item.run_id, _one_line(err)) for item in chunk)
            continue
        log.append(rows)
        bar.update(len(rows))


class RunLog:
    """``runs.jsonl``: one JSON object per finished run, appended and fsynced a chunk at a time, so a killed sweep
    keeps every run it logged; locked, so two sweeps never write one folder at once."""

    def __init__(self, path: Path):
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a+b")  # closed by __exit__
        except OSError as err:
            raise ConfigError(f"--out: cannot write {str(path)!r} ({err.strerror}), expected a writable folder",
                              key="--out") from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise ConfigError(f"--out: {str(path.parent)!r} is being written by another sweep, expected a folder no "
                              f"running sweep uses", key="--out") from None
        self._drop_torn_tail()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def _drop_torn_tail(self) -> None:
        """A line cut short by a kill (no newline yet) is not a finished run: cut it, so appends start clean."""
        size = self._file.seek(0, os.SEEK_END)
        if size == 0:
            return
        self._file.seek(size - 1)
        if self._file.read(1) != b"\n":  # read the whole log only in this rare case
            self._file.seek(0)
            self._file.truncate(self._file.read().rfind(b"\n") + 1)

    def finished_ids(self) -> tuple[set[str], int]:
        """The run ids logged, and how many lines could not be read (damaged by hand or by a disk: their runs run
        again, and the summary says so)."""
        rows, unreadable = scan_rows(self.path)
        return {row["run_id"] for row in rows}, unreadable

    def append(self, rows: list[dict[str, Any]]) -> None:
        self._file.write(b"".join(json.dumps(row).encode() + b"\n" for row in rows))
        self._file.flush()
        os.fsync(self._file.fileno())


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every complete, readable line of a runs.jsonl (a torn or unreadable line is skipped: that run runs again)."""
    return scan_rows(path)[0]


def scan_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """``read_rows``, and the number of non-blank lines it skipped."""
    rows, unreadable = [], 0
    with open(path, "rb") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except ValueError:
                unreadable += bool(line.strip())
                continue
            if isinstance(row, dict) and isinstance(row.get("run_id"), str):
                rows.append(row)
            else:
                unreadable += 1
    return rows, unreadable


def write_results(out: Path, run_ids: Sequence[str] | None = None) -> pd.DataFrame:
    """``out``/results.parquet and results.csv from runs.jsonl: the last line of each run, in ``run_ids`` order (the
    plan's; None: every run logged), written atomically. Returns the DataFrame."""
    latest = {row["run_id"]: row for row in read_rows(out / "runs.jsonl")}
    rows = [latest[rid] for rid in (run_ids if run_ids is not None else list(latest)) if rid in latest]
    keys = list(dict.fromkeys(key for row in rows for key in row))
    frame = pd.DataFrame({key: _typed([row.get(key) for row in rows]) for key in keys})
    for name, write in (("results.parquet", frame.to_parquet), ("results.csv", frame.to_csv)):
        buffer = io.BytesIO()
        write(buffer, index=False)
        write_atomic(out / name, buffer.getvalue())
    return frame


def _typed(values: list) -> Any:
    """A column with nulls that keeps its type: integers stay Int64 (not float), booleans boolean."""
    kinds = {type(value) for value in values if value is not None}
    if kinds in ({bool}, {int}, {str}):
        return pd.array(values, dtype={bool: "boolean", int: "Int64", str: "str"}[kinds.pop()])
    if kinds and kinds <= {int, float}:
        return pd.array([math.nan if value is None else float(value) for value in values], dtype="float64")
    return pd.array(values, dtype=object)
