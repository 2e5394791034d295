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
import functools
import hashlib
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import signal
import stat
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pandas as pd

from pipescope.experiments.processes import stops_deferred
from pipescope.config import (PARALLEL_SPELLINGS, Config, ConfigError, _merge, config_tree, load_config, read_yaml,
                              without_grid)
from pipescope.runner import run
from pipescope.simulator.costs import UniformCostsConfig
from pipescope.simulator.readers.files import write_atomic
from pipescope.simulator.models import SPEC_KEYS
from pipescope.simulator.result import SimResult
from pipescope.simulator.schedules import named_generator
from pipescope.simulator.readers.units import short_repr

# Validation takes ~0.6 ms a run (mostly load_config), so the cap costs ~1 min before the first run; a bigger study is
# several files (or several --out folders), each resumable on its own.
MAX_RUNS = 100_000
MAX_DEFAULT_CHUNK = 64
# Each metric a row holds, what an ok row holds there (float: any finite number), and whether it may be null there
# (an error row holds null in every one). A logged row that breaks this was changed after it was written: its run
# runs again.
METRIC_KINDS: dict[str, tuple[type, bool]] = {
    "iteration_time_s": (float, False), "throughput_samples_per_s": (float, False), "bubble_rate": (float, False),
    "peak_memory_bytes": (int, False), "memory_capacity_bytes": (int, True), "oom": (bool, False),
    "mfu": (float, True), "hfu": (float, True), "tokens_per_s": (float, True), "tokens_per_s_per_gpu": (float, True),
    "tflops_per_gpu": (float, True), "gpus": (int, False), "exposed_allreduce_s": (float, False),
    "warnings": (str, False)}
WARNINGS_SEPARATOR = " | "  # a row's warnings in one cell (the tables hold scalars)
# What an ok row's numbers can be at all (default: at least 0): a log edited to a negative time or a bubble of 5 is
# damage, and its run runs again rather than reaching the tables and the plots, which refuse such values.
METRIC_RANGES: dict[str, tuple[float, float]] = {"bubble_rate": (0, 1), "gpus": (1, math.inf)}
METRICS = tuple(METRIC_KINDS)
ROW_FIELDS = ("run_id", "status", "error", *METRICS, "run_wall_s")  # every row's columns besides its config's
ROW_FIELD_SET = frozenset(ROW_FIELDS)
# runs.jsonl is re-read on every run, and a user may hand us anything there. A row is about 2 KB (60 columns), so a
# longer line is damage, skipped without being held; the log of five full sweeps (5 x MAX_RUNS rows) is 1 GB.
MAX_LINE_BYTES = 64 << 10
MAX_LOG_BYTES = 1 << 30
INT64 = 1 << 63  # Parquet's integers: a bigger one in a row would stop the table being written


@dataclass(frozen=True)
class Run:
    """One point of the grid: its validated config, the swept values that made it, and its id (``run_id``)."""

    run_id: str
    config: Config
    overrides: dict[str, Any]

    @functools.cached_property
    def columns(self) -> dict[str, Any]:
        """``config_columns(config)``, worked out once: a sweep checks the run's logged row against it twice (before
        it runs anything, and for the tables), and it is most of the time that takes."""
        return config_columns(self.config)


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
    base = without_grid(raw)[0]
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
    _check_disjoint(sweep, zips)
    lengths = {key: len(values) for key, values in zips.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{key} has {n}" for key, n in lengths.items())
        raise ConfigError(f"zip: lists of different lengths ({shown}), expected all the same length", key="zip")
    if zips:
        axes.append([dict(zip(zips, values)) for values in zip(*zips.values())])
    return axes


def _check_disjoint(sweep: dict[str, list], zips: dict[str, list]) -> None:
    """No config key is set by two grid keys: the same key in sweep and zip, or a key inside a swept section that
    one of the section's values sets too (``schedule: [{stages: 3}]`` beside ``schedule.stages``: one would silently
    win). A key inside a section whose values leave it unset is applied after the section (``validated_config``)."""
    axes = {f"sweep.{key}": values for key, values in sweep.items()} | {f"zip.{key}": values
                                                                        for key, values in zips.items()}
    for key in zips:
        if key in sweep:
            raise ConfigError(f"zip.{key}: also in sweep, expected each key in one of sweep and zip", key=f"zip.{key}")
    for key, values in axes.items():
        prefix = key.split(".", 1)[1] + "."
        for inner in axes:
            path = inner.split(".", 1)[1]
            if path.startswith(prefix) and any(_sets(value, path[len(prefix):].split(".")) for value in values):
                raise ConfigError(f"{inner}: also set by a value of {key}, expected each config key in one place "
                                  f"of sweep and zip", key=inner)


def _sets(value: Any, path: list[str]) -> bool:
    """Whether a section's value (a mapping) holds the dotted ``path``."""
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def _lists(section: str, value: Any) -> dict[str, list]:
    """``sweep:`` or ``zip:`` checked: a mapping of dotted keys to non-empty lists (a key left empty is refused)."""
    if value is None:
        raise ConfigError(f"{section}: is empty, expected a mapping of dotted keys to lists, e.g. schedule.stages: "
                          f"[4, 8] (or no {section} key)", key=section)
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
    homes = {key: PARALLEL_SPELLINGS.get(key, key) for key in value}  # parallel.data sweeps cluster.data_parallel
    for key, home in homes.items():
        if home != key and home in value:
            raise ConfigError(f"{section}.{key}: beside {section}.{home}, expected one of them (both name the same "
                              f"setting)", key=f"{section}.{key}")
    return {homes[key]: values for key, values in value.items()}


def validated_config(base: dict, overrides: dict[str, Any]) -> Config:
    """The base config with one combination set, through the normal loader (a copy: ``_merge`` edits in place)."""
    tree = config_tree(raw=copy.deepcopy(base))  # the base's degrees at their homes, where the grid's keys set them
    for key, value in sorted(overrides.items(), key=lambda item: item[0].count(".")):  # a section, then keys in it
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
        return _row(item.run_id, item.columns, None, one_line(err), time.perf_counter() - started)
    return _row(item.run_id, resolved_columns(item, result), result, None, time.perf_counter() - started)


def resolved_columns(item: Run, result: SimResult) -> dict[str, Any]:
    """The run's config columns, each it left unset filled in with what ran: the precision, layer split, preset and
    schedule size ``run`` resolved, the schedule's iterations, and the model's shape and architecture (family, key/value
    heads, MLP width: a ``from_hf`` run's too; not read under uniform costs).
    A value the run overrode stays as asked (a profile's own precision: the run warns), so a row is its run's
    columns with only the nulls filled, which ``row_ok`` checks."""
    ran, s = config_columns(result.config), result.schedule
    ran |= {"schedule.stages": s.num_devices, "schedule.microbatches": s.num_microbatches,
            "schedule.chunks": s.chunks, "iterations": s.iterations}
    if not isinstance(result.config.costs, UniformCostsConfig):
        spec = result.config.model.spec()
        ran |= {f"model.{key}": getattr(spec, key) for key in SPEC_KEYS}
        ran |= {"model.kv_heads": spec.kv_heads or spec.heads, "model.ffn_hidden": spec.ffn}  # None: as GPT's
    return {key: ran.get(key) if value is None else value for key, value in item.columns.items()}


def one_line(err: Exception) -> str:
    """Our errors are one line naming the key; anything else also names its type (and only it, when it says
    nothing: an error row always has an error)."""
    text = " ".join(str(err).split())
    if not text:
        return type(err).__name__
    return text if isinstance(err, ValueError) else f"{type(err).__name__}: {text}"


def _row(rid: str, columns: dict, result: SimResult | None, error: str | None, wall_s: float) -> dict[str, Any]:
    metrics = _metrics(result) if result is not None else dict.fromkeys(METRICS)
    return {"run_id": rid, "status": "ok" if error is None else "error", "error": error, **columns, **metrics,
            "run_wall_s": wall_s}


def _metrics(result: SimResult) -> dict[str, Any]:
    return {"iteration_time_s": result.iteration_time_s, "throughput_samples_per_s": result.throughput_samples_per_s,
            "bubble_rate": result.bubble_rate, "peak_memory_bytes": result.peak_memory_bytes,
            "memory_capacity_bytes": result.memory_capacity_bytes, "oom": bool(result.oom), "mfu": result.mfu,
            "hfu": result.hfu, "tokens_per_s": result.tokens_per_s, "tokens_per_s_per_gpu": result.tokens_per_s_per_gpu,
            "tflops_per_gpu": result.tflops_per_gpu, "gpus": result.gpus,
            "exposed_allreduce_s": result.exposed_allreduce_s, "warnings": WARNINGS_SEPARATOR.join(result.warnings)}


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
    # Start every worker now, whole: the pool starts them one per submit otherwise, and a stop (Ctrl-C, SIGTERM)
    # while one is starting leaves it unknown to the pool's shutdown (processes.stops_deferred), which then hangs or
    # leaves it running.
    try:
        with stops_deferred():
            for started in [pool.submit(os.getpid) for _ in range(workers)]:
                started.result()
    except BaseException:
        pool.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    return pool


@contextmanager
def dask_executor(address: str, workers: int | None = None) -> Iterator[tuple[Executor, int]]:
    """(executor, worker threads) of a Dask cluster: ``local`` starts one on 127.0.0.1 (``workers`` processes of one
    thread, no dashboard); a ``tcp://HOST:PORT`` address joins a running scheduler, which is trusted (Dask's
    protocol unpickles what the scheduler sends).

    Raises:
        ConfigError: ``--dask: ...``, one line, when the scheduler cannot be reached or the local cluster not started.
    """
    from distributed import Client, LocalCluster

    cluster = None
    try:  # only these calls reach for the cluster: an OSError anywhere else (a full disk) is not --dask's fault
        if address == "local":
            # Loopback only; no dashboard, and the scheduler's own HTTP server on a free loopback port, not :8787.
            cluster = LocalCluster(n_workers=workers or len(os.sched_getaffinity(0)), threads_per_worker=1,
                                   processes=True, host="127.0.0.1", dashboard_address=None,
                                   silence_logs=logging.ERROR, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"})
            client = Client(cluster)
        else:
            client = Client(address, timeout="20s")
    except OSError as err:
        expected = "a Dask cluster started on 127.0.0.1" if address == "local" else "a running Dask scheduler"
        raise ConfigError(f"--dask: {address!r}: {err}, expected {expected}", key="--dask") from None
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
        done, unreadable = log.finished_ids(plan.runs)
        todo = [item for item in plan.runs if item.run_id not in done]
        size = chunk_size or default_chunk_size(len(todo), workers)
        chunks = [todo[i:i + size] for i in range(0, len(todo), size)]
        own = executor is None and bool(chunks)
        pool = process_pool(min(workers, len(chunks))) if own else executor
        try:
            bar = counted_bar(len(plan.runs), "sweep", "run", progress, len(plan.runs) - len(todo))
            lost = drain(pool, chunks, log, 2 * workers, bar)
        except KeyboardInterrupt:  # the tables of what is logged, to look at; the same command resumes the rest
            partial = write_results(Path(out), plan.runs)
            print(f"pipescope: interrupted: wrote {Path(out) / 'results.parquet'} and results.csv with the "
                  f"{len(partial)} of {len(plan.runs)} runs logged; run the same command again to resume",
                  file=sys.stderr)
            raise
        finally:
            if own:
                pool.shutdown(wait=True, cancel_futures=True)
        frame = write_results(Path(out), plan.runs)
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
    their chunks are not logged. With an in-memory ``log`` (the planner's) nothing would keep those rows, so the
    first Ctrl-C stops the workers at once."""
    pending: dict[Future, list[Run]] = {}
    queue, lost = iter(chunks), []
    with bar:
        try:
            while True:
                for chunk in itertools.islice(queue, max(0, window - len(pending))):
                    try:
                        pending[executor.submit(task or run_chunk, chunk)] = chunk
                    except Exception as err:  # a broken executor (a pool whose worker died) takes no more tasks
                        lost.extend((item.run_id, one_line(err)) for rest in [chunk, *queue] for item in rest)
                if not pending:
                    return lost
                _collect(wait(pending, return_when=FIRST_COMPLETED)[0], pending, log, bar, lost)
        except KeyboardInterrupt:
            if isinstance(log, MemoryLog):  # nothing outlives this process to keep their rows: stop them now
                _kill_own(executor)
                raise
            running = {future: chunk for future, chunk in pending.items() if not future.cancel()}
            bar.write(f"pipescope: stopping: logging the {len(running)} chunks still running (Ctrl-C again to "
                      f"stop them unlogged)", file=sys.stderr)
            try:
                _collect(wait(running)[0], running, log, bar, lost)
            except KeyboardInterrupt:  # the second: the workers stop now, their chunks unlogged (a re-run runs them)
                _kill_own(executor)
                raise
            raise


def _kill_own(executor: Executor) -> None:
    """Stop the workers of our own pool at once (a caller's executor, a Dask cluster's, is left to its owner)."""
    if isinstance(executor, WorkerPool):
        executor.kill()


def _collect(finished: set[Future], pending: dict[Future, list[Run]], log: RunLog, bar, lost: list) -> None:
    """Log the rows of each finished chunk; a chunk whose task failed (not its runs: the executor) is lost."""
    for future in finished:
        chunk = pending.pop(future)
        try:
            rows = future.result()
        except Exception as err:  # the executor failed, not the run: retried on re-run
            lost.extend((item.run_id, one_line(err)) for item in chunk)
            continue
        log.append(rows)
        bar.update(len(rows))


class MemoryLog(list):
    """An in-memory stand-in for the run log, for a task whose rows are not a sweep's (the planner's, validate
    --published's): ``drain`` appends each finished chunk's rows."""

    def append(self, rows: list) -> None:  # type: ignore[override]
        self.extend(rows)


class RunLog:
    """``runs.jsonl``: one JSON object per finished run, appended and fsynced a chunk at a time, so a killed sweep
    keeps every run it logged; locked, so two sweeps never write one folder at once."""

    def __init__(self, path: Path):
        self.path = path
        _check_log(path)
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
        """A line cut short by a kill (no newline yet) is not a finished run: cut it, so appends start clean. The
        last newline is looked for from the end, a block at a time: a tail of gigabytes is never held."""
        size = cut = self._file.seek(0, os.SEEK_END)
        while cut > 0:
            start = max(0, cut - MAX_LINE_BYTES)
            self._file.seek(start)
            newline = self._file.read(cut - start).rfind(b"\n")
            if newline >= 0:
                cut = start + newline + 1
                break
            cut = start
        if cut < size:
            self._file.truncate(cut)

    def finished_ids(self, runs: Sequence[Run]) -> tuple[set[str], int]:
        """The ids of ``runs`` logged, and how many lines could not be read (damaged by hand or by a disk: their runs
        run again, and the summary says so)."""
        rows, unreadable = scan_rows(self.path, {item.run_id: item for item in runs})
        return {row["run_id"] for row in rows}, unreadable

    def append(self, rows: list[dict[str, Any]]) -> None:
        try:
            self._file.write(b"".join(json.dumps(row).encode() + b"\n" for row in rows))
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:  # a full disk, say: name the log (the CLI's --out error), not whatever was running
            raise OSError(err.errno, err.strerror, str(self.path)) from None


FILE_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
              stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


def _check_log(path: Path, max_bytes: int | None = MAX_LOG_BYTES) -> None:
    """ConfigError (``--out: ...``) unless the log is missing or a regular file of at most ``max_bytes``. Checked
    before it is opened: a FIFO blocks, a device never ends or cannot be synced, and a log that big is no sweep's
    (reading it would take minutes and gigabytes)."""
    try:
        info = path.stat()
    except OSError:  # missing (the sweep creates it), or unreadable: opening it says why
        return
    if not stat.S_ISREG(info.st_mode):
        kind = FILE_KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise ConfigError(f"--out: {str(path)!r} is {kind}, expected a regular file (the sweep's log of finished "
                          f"runs)", key="--out")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ConfigError(f"--out: {str(path)!r} is {info.st_size:,} bytes, expected at most {max_bytes:,} "
                          f"(MAX_LOG_BYTES) for a sweep's log of about 2 KB a run; use a new --out folder",
                          key="--out")


def read_rows(path: Path, runs: Mapping[str, Run] | None = None) -> list[dict[str, Any]]:
    """Every complete, readable line of a runs.jsonl (a torn or damaged line is skipped: that run runs again)."""
    return scan_rows(path, runs)[0]


def scan_rows(path: Path, runs: Mapping[str, Run] | None = None) -> tuple[list[dict[str, Any]], int]:
    """``read_rows``, and the number of non-blank lines it skipped as damaged (``row_ok``).

    With ``runs`` (a plan's, by id), only rows of those runs are kept, each checked against its run; a row of
    another run (an earlier version of the experiment file) is left out and not counted.
    """
    _check_log(path, None)  # the size only when a sweep starts: the log it writes may pass MAX_LOG_BYTES
    rows, unreadable = [], 0
    with open(path, "rb") as handle:
        for line in _lines(handle):
            if line is not None and not line.strip():
                continue
            row = _parsed(line)
            if row is not None and runs is not None and row["run_id"] not in runs:
                continue
            if row is not None and row_ok(row, runs[row["run_id"]] if runs is not None else None):
                rows.append(row)
            else:
                unreadable += 1
    return rows, unreadable


def _lines(handle: BinaryIO) -> Iterator[bytes | None]:
    """The log's lines, each read with a bound: one longer than MAX_LINE_BYTES (no row is) comes as None, skipped a
    block at a time, so a line of gigabytes costs no memory."""
    while line := handle.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = handle.readline(MAX_LINE_BYTES)
        yield None


def _parsed(line: bytes | None) -> dict[str, Any] | None:
    """The line's JSON object if it has a string run_id; None for anything else (too long, not JSON, nested deeper
    than the parser's recursion limit)."""
    if line is None:
        return None
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return row if isinstance(row, dict) and isinstance(row.get("run_id"), str) else None


def row_ok(row: dict[str, Any], run: Run | None) -> bool:
    """True when ``row`` is what ``_row`` writes: status ``ok`` (error null, metrics as METRIC_KINDS says) or
    ``error`` (its error a string, every metric null), a finite run_wall_s, and config columns that are those of
    ``run`` (when known), a value differing only where the config left the key unset and the run filled it in.
    Anything else was changed after it was written: used, it would be a wrong answer or stop the tables."""
    if not ROW_FIELD_SET <= row.keys() or row["status"] not in ("ok", "error"):
        return False
    if row["status"] == "error":  # an error row has its error and no metrics
        valid = _scalar_ok(row["error"], str) and all(row[key] is None for key in METRICS)
    else:
        valid = row["error"] is None and all(_metric_ok(key, row[key], kind) or nullable and row[key] is None
                                             for key, (kind, nullable) in METRIC_KINDS.items())
    return valid and _scalar_ok(row["run_wall_s"], float) and _columns_ok(row, run)


def _metric_ok(key: str, value: Any, kind: type) -> bool:
    """An ok row's metric: a scalar of its kind and, a number, within what it can be (``METRIC_RANGES``)."""
    if not _scalar_ok(value, kind):
        return False
    low, high = METRIC_RANGES.get(key, (0, math.inf))
    return kind not in (int, float) or low <= value <= high


def _columns_ok(row: dict[str, Any], run: Run | None) -> bool:
    """The row's other columns are scalars the tables can hold and, given ``run``, exactly its config columns, a
    value differing only where the config left the key unset (null) and the run filled it in. (A filled value, like a
    metric, can be edited undetected: the log has no checksum.)"""
    config = {key: value for key, value in row.items() if key not in ROW_FIELD_SET}
    if not all(value is None or _scalar_ok(value, type(value)) for value in config.values()):
        return False
    if run is None:
        return True
    planned = run.columns
    return config.keys() == planned.keys() and all(
        want is None or (type(config[key]) is type(want) and config[key] == want) for key, want in planned.items())


def _scalar_ok(value: Any, kind: type) -> bool:
    """``value`` is a JSON scalar of ``kind`` that the tables can hold: a bool for bool, an int within int64 for int,
    a finite int or float for float (never NaN or infinity), a string for str."""
    if type(value) is int and kind in (int, float):
        return -INT64 <= value < INT64
    if type(value) is float and kind is float:
        return math.isfinite(value)
    return type(value) is kind and kind in (bool, str)


def write_results(out: Path, runs: Sequence[Run] | None = None) -> pd.DataFrame:
    """``out``/results.parquet and results.csv from runs.jsonl: the last line of each run, in ``runs`` order (the
    plan's, each line checked against its run; None: every run logged), written atomically. Returns the DataFrame."""
    by_id = {item.run_id: item for item in runs} if runs is not None else None
    latest = {row["run_id"]: row for row in read_rows(out / "runs.jsonl", by_id)}
    rows = [latest[rid] for rid in (by_id if by_id is not None else list(latest)) if rid in latest]
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
    if len(kinds) > 1:  # rows read without their plan are not checked against it: text, not an ArrowTypeError
        return pd.array([None if value is None else str(value) for value in values], dtype="str")
    return pd.array(values, dtype=object)
