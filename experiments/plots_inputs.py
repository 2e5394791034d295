"""Reading what ``pipescope plot`` draws from: a Chrome trace, a timeline file, a sweep's table, a ``validate --json``
report. Every file is hostile input: bounded before it is parsed, and every problem is one ``ValueError`` line
naming the file and what was expected."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import re
from typing import Any

import numpy as np
import pandas as pd

from pipescope.experiments.plots_data import SWEEP_COLUMNS, RunData, from_ops, lanes
from pipescope.simulator.readers.table_bounds import TableTooBig, check_csv_header, parquet_shape
from pipescope.simulator.trace import KIND_NAMES, STALL

MAX_FILE_BYTES = 512 * 2**20  # read (after gunzip); a trace of the largest run pipescope simulates is about this
MAX_UNPACKED_BYTES = 4 * MAX_FILE_BYTES  # a Parquet file's columns once decompressed
MAX_ROWS = 5_000_000  # actions or sweep rows: the largest run has about 3.5 million
# A trace's events, counted before parsing: each becomes Python dicts of about 400 bytes, so a trace costs far more
# memory than a timeline of the same rows (plot a big run from its timeline).
MAX_TRACE_EVENTS = 2_000_000
MAX_INDEX = 10**9  # stages, microbatches (as ir.MAX_ACTION_INDEX)
MAX_DEVICE = 99_999  # the config's limit on GPUs placed is 100,000
MAX_NS = 1 << 53  # as timeline.MAX_RUN_NS: 104 days
TIMELINE_COLUMNS = ("device", "stream", "kind", "stage", "microbatch", "start_ns", "end_ns")
VALIDATE_FIELDS = ("schedule", "stages", "microbatches", "predicted_iteration_time_s", "measured_iteration_time_s",
                   "iteration_time_error", "per_device")
ACTION_KIND = re.compile(r"^[0-9]{1,10}([A-Z_]{1,20})[0-9]")  # 2F0, 0SEND_F3, 3ALL_REDUCE7.b1[...], 3OPT7
KIND_OF_CATEGORY = {name: kind for kind, name in KIND_NAMES.items()}


def _name(path: str) -> str:
    return repr(path[:200])


def read_bytes(path: str) -> bytes:
    """The file's bytes (gunzipped for ``.gz``), at most MAX_FILE_BYTES; ValueError if missing or larger."""
    if not os.path.isfile(path):
        raise ValueError(f"INPUT: {_name(path)} does not exist or is not a file")
    try:
        with (gzip.open(path) if path.lower().endswith(".gz") else open(path, "rb")) as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"INPUT: {_name(path)}: cannot read it: {err}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"INPUT: {_name(path)} is over {MAX_FILE_BYTES >> 20} MiB, expected a smaller file")
    return data


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def read_json(path: str) -> Any:
    """A JSON document; NaN and Infinity (which JSON does not have) are refused."""
    data = read_bytes(path)
    # Bounds before any object is built: a trace event is an object of about 7 commas and 2 braces (its args),
    # and a file of 500 MiB of '{},' or '1,' would build hundreds of millions of Python objects
    objects, values = data.count(b"{"), data.count(b",")
    if objects > 3 * MAX_TRACE_EVENTS or values > 12 * MAX_TRACE_EVENTS:
        raise ValueError(f"INPUT: {_name(path)} holds {objects:,} JSON objects and {values:,} commas, more than a "
                         f"trace of {MAX_TRACE_EVENTS:,} events (a run that big plots from its --timeline)")
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:
        if str(err).startswith("INPUT:"):
            raise
        raise ValueError(f"INPUT: {_name(path)} is not valid JSON ({str(err)[:120]})") from None


def json_kind(doc: Any) -> str:
    """``trace``, ``validate``, ``simulate`` (a ``simulate --json`` summary) or ``unknown``."""
    if isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        return "trace"
    if isinstance(doc, dict) and "predicted_iteration_time_s" in doc:
        return "validate"
    if isinstance(doc, dict) and "iteration_time_s" in doc and "per_device" in doc:
        return "simulate"
    return "unknown"


def _integer(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
            value != int(value) or not low <= value <= high:
        raise ValueError(f"{what}: got {str(value)[:60]!r}, expected an integer from {low:,} to {high:,}")
    return int(value)


def _ns(value: Any, what: str) -> int:
    """Microseconds (a trace's ``ts``) as integer ns."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_NS / 1e3:
        raise ValueError(f"{what}: got {str(value)[:60]!r}, expected microseconds from 0 to {MAX_NS / 1e3:.0f}")
    return round(value * 1e3)


def run_from_trace(doc: dict, path: str, microbatches: int | None) -> RunData:
    """A Chrome trace (``simulate --trace``): op rows from its ``X`` events, memory from its counters, links from
    its ``network`` process."""
    events = doc["traceEvents"]
    if len(events) > MAX_TRACE_EVENTS:
        raise ValueError(f"INPUT: {_name(path)} has {len(events):,} events, expected at most {MAX_TRACE_EVENTS:,}")
    try:
        threads, network = _trace_names(events)
        rows, memory, links, stalls = [], {}, {}, []
        for i, e in enumerate(events):
            phase, pid = e.get("ph"), e.get("pid")
            if phase == "X" and e.get("cat") == STALL:  # an op's wait between its units, inside the op's event
                start = _ns(e.get("ts"), f"traceEvents[{i}].ts")
                stalls.append((_integer(pid, f"traceEvents[{i}].pid", 0, MAX_DEVICE), start,
                               start + _ns(e.get("dur", 0), f"traceEvents[{i}].dur")))
            elif phase == "X" and pid == network:
                start = _ns(e.get("ts"), f"traceEvents[{i}].ts")
                links.setdefault(threads.get(_thread(e, i), "link"), []).append(
                    (start, start + _ns(e.get("dur", 0), f"traceEvents[{i}].dur")))
            elif phase == "X":
                rows.append(_trace_op(e, i, threads))
            elif phase == "C" and e.get("name") == "memory":
                gib = _args(e, i).get("GiB")
                if isinstance(gib, bool) or not isinstance(gib, int | float) or not 0 <= gib <= 2**30:
                    raise ValueError(f"traceEvents[{i}].args.GiB: got {str(gib)[:40]!r}, expected a number of GiB "
                                     f"from 0 to 2^30")
                bytes_in_use = gib * 2**30
                memory.setdefault(_integer(pid, f"traceEvents[{i}].pid", 0, MAX_DEVICE), []).append(
                    (_ns(e.get("ts"), f"traceEvents[{i}].ts"), round(bytes_in_use)))
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"INPUT: {_name(path)}: {str(err)[:200]}") from None
    if not rows:
        raise ValueError(f"INPUT: {_name(path)} holds no ops, expected a Chrome trace from 'pipescope simulate "
                         f"--trace'")
    ops = pd.DataFrame(rows, columns=["device", "stream", "kind", "stage", "microbatch", "start_ns", "end_ns"])
    try:
        ops = ops.assign(lane=lanes(ops.pop("stream")))
    except ValueError as err:
        raise ValueError(f"INPUT: {_name(path)}: thread name: {err}") from None
    curves = [_curve(memory.get(d, [])) for d in range(max(memory) + 1)] if memory else []
    name = doc.get("otherData", {}).get("schedule", "run") if isinstance(doc.get("otherData"), dict) else "run"
    run = from_ops(ops, curves, f"{str(name)[:60]}: {os.path.basename(path)}", microbatches, links)
    return dataclasses.replace(run, stalls=np.array(stalls, dtype=np.int64).reshape(-1, 3))


def _trace_names(events: list) -> tuple[dict, int | None]:
    """Each (pid, tid)'s lane name and the pid of the ``network`` process (None without one)."""
    threads, network = {}, None
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ValueError("traceEvents: expected a list of objects")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[_thread(e, i)] = str(_args(e, i).get("name", ""))[:100]
        elif e.get("ph") == "M" and e.get("name") == "process_name" and _args(e, i).get("name") == "network":
            network = _thread(e, i)[0]
    return threads, network


def _thread(e: dict, i: int) -> tuple:
    """An event's (pid, tid), each a number, a name or absent (they key the lane names)."""
    for key in ("pid", "tid"):
        if not isinstance(e.get(key), int | float | str | None):
            raise ValueError(f"traceEvents[{i}].{key}: got {str(e.get(key))[:40]!r}, expected a number or a name")
    return e.get("pid"), e.get("tid")


def _args(e: dict, i: int) -> dict:
    """An event's ``args`` object ({} when absent)."""
    args = e.get("args")
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise ValueError(f"traceEvents[{i}].args: got {str(args)[:40]!r}, expected an object")
    return args


def _trace_op(e: dict, i: int, threads: dict) -> tuple:
    """One op row from an ``X`` event: its kind from its action's text (or its category), its lane from its
    thread's name."""
    args, where = _args(e, i), f"traceEvents[{i}]"
    match = ACTION_KIND.match(str(args.get("action", ""))[:100])
    kind = match.group(1) if match else KIND_OF_CATEGORY.get(e.get("cat"))
    if kind is None:
        raise ValueError(f"{where}: got action {str(args.get('action'))[:40]!r}, expected one like '2F0'")
    start = _ns(e.get("ts"), f"{where}.ts")
    return (_integer(e.get("pid"), f"{where}.pid", 0, MAX_DEVICE), threads.get(_thread(e, i), ""),
            kind, _integer(args.get("stage"), f"{where}.args.stage", -1, MAX_INDEX),
            _integer(args.get("microbatch"), f"{where}.args.microbatch", -1, MAX_INDEX), start,
            start + _ns(e.get("dur"), f"{where}.dur"))


def _curve(points: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """A device's (times, bytes) in time order; events of one instant keep their order (a free before the
    allocation that follows it)."""
    points.sort(key=lambda point: point[0])
    return np.array([t for t, _ in points], dtype=np.int64), np.array([b for _, b in points], dtype=np.int64)


def read_table(path: str, needed: tuple[str, ...], what: str, only_needed: bool = False) -> pd.DataFrame:
    """A Parquet or CSV file's rows, with ``needed`` among its columns; at most MAX_ROWS rows. ``only_needed``: read
    those columns alone (a timeline's; a sweep's figures read every config column), so that what another column
    holds costs nothing."""
    read = list(needed) if only_needed else None
    if not os.path.isfile(path):
        raise ValueError(f"INPUT: {_name(path)} does not exist or is not a file")
    if os.path.getsize(path) > MAX_FILE_BYTES:
        raise ValueError(f"INPUT: {_name(path)} is over {MAX_FILE_BYTES >> 20} MiB, expected a smaller file")
    parquet = path.lower().endswith(".parquet")
    try:
        columns, rows = _parquet_shape(path, read) if parquet else (_csv_columns(path), None)
    except TableTooBig as err:
        raise ValueError(f"INPUT: {_name(path)}: {err}") from None
    except (ValueError, OSError, TypeError, KeyError, NotImplementedError) as err:
        raise ValueError(f"INPUT: {_name(path)} is not a readable {'Parquet' if parquet else 'CSV'} table "
                         f"({str(err)[:120]})") from None
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ValueError(f"INPUT: {_name(path)} has no column {missing[0]!r}, expected {what} with columns "
                         f"{', '.join(needed)}")
    if rows is not None and rows > MAX_ROWS:
        raise ValueError(f"INPUT: {_name(path)} has {rows:,} rows, expected at most {MAX_ROWS:,}")
    try:
        frame = pd.read_parquet(path, columns=read) if parquet else \
            pd.read_csv(path, nrows=MAX_ROWS + 1, low_memory=False, usecols=read)
    except (ValueError, OSError, TypeError, KeyError, NotImplementedError) as err:
        raise ValueError(f"INPUT: {_name(path)}: cannot read its rows ({str(err)[:120]})") from None
    if len(frame) > MAX_ROWS:
        raise ValueError(f"INPUT: {_name(path)} has over {MAX_ROWS:,} rows, expected at most {MAX_ROWS:,}")
    return frame


def _parquet_shape(path: str, columns: list[str] | None) -> tuple[list[str], int]:
    """Column names and row count from the file's footer, before reading any row; ``columns`` (None: all) at most
    MAX_UNPACKED_BYTES once decompressed (``table_bounds.parquet_shape``)."""
    try:
        arrow, rows = parquet_shape(path, MAX_UNPACKED_BYTES, columns)
    except ImportError:
        raise ValueError("Parquet needs pyarrow: pip install 'pipescope[sweep]' (or give a .csv)") from None
    return list(arrow.names), rows


def _csv_columns(path: str) -> list[str]:
    """The header's names, bounded first (``table_bounds.check_csv_header``): pandas would take minutes and
    gigabytes over a header of millions of names."""
    check_csv_header(path)
    return list(pd.read_csv(path, nrows=0).columns)


def integers(frame: pd.DataFrame, columns: tuple[str, ...], path: str, low: int, high: int) -> pd.DataFrame:
    """``columns`` as int64, each value an integer from ``low`` to ``high``; ValueError naming the first bad one."""
    out = {}
    for column in columns:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = ~(values.between(low, high) & (values == values.round()))
        if bad.any():
            raise ValueError(f"INPUT: {_name(path)}: {column}: got {str(frame[column][bad].iloc[0])[:40]!r}, "
                             f"expected an integer from {low:,} to {high:,}")
        out[column] = values.astype(np.int64)
    return frame.assign(**out)


def run_from_timeline(path: str, microbatches: int | None) -> RunData:
    """A timeline file (``simulate --timeline``): its action rows; it holds no memory."""
    frame = read_table(path, TIMELINE_COLUMNS, "a timeline (simulate --timeline)", only_needed=True)
    frame = integers(frame, ("device",), path, 0, MAX_DEVICE)
    frame = integers(frame, ("stage", "microbatch"), path, -1, MAX_INDEX)
    frame = integers(frame, ("start_ns", "end_ns"), path, 0, MAX_NS)
    if (frame["end_ns"] < frame["start_ns"]).any():
        raise ValueError(f"INPUT: {_name(path)}: expected every end_ns at or after its start_ns")
    if frame.empty:
        raise ValueError(f"INPUT: {_name(path)} has no rows, expected a timeline (simulate --timeline)")
    try:
        lane = lanes(frame["stream"])
    except ValueError as err:
        raise ValueError(f"INPUT: {_name(path)}: {err}") from None
    ops = frame[["device", "stage", "microbatch", "start_ns", "end_ns"]].assign(
        lane=lane, kind=frame["kind"].astype(str).str.slice(0, 20))
    return from_ops(ops, [], f"timeline {os.path.basename(path)}", microbatches)


def read_sweep(path: str, figure: str) -> pd.DataFrame:
    """A sweep's rows that finished (``status`` ok, where the table has one), with the columns ``figure`` (bubble or
    throughput) plots as numbers."""
    frame = read_table(path, SWEEP_COLUMNS[figure], "a sweep table (pipescope sweep)")
    if "status" in frame:
        frame = frame[frame["status"].astype(str) == "ok"]
    name, x, y = SWEEP_COLUMNS[figure]
    if len(frame) and frame[x].isna().all():  # uniform costs have no model: its shape keys stay empty
        raise ValueError(f"INPUT: {_name(path)}: {x} is empty in every run (a sweep under uniform costs has no "
                         f"model); expected a sweep over {x} under analytic or profile costs")
    extra = ("cluster.data_parallel",) if figure == "throughput" and "cluster.data_parallel" in frame else ()
    frame = integers(frame, (x, *extra), path, 1, MAX_INDEX)
    values = pd.to_numeric(frame[y], errors="coerce")
    high = 1.0 if y == "bubble_rate" else math.inf
    bad = ~values.between(0, high) | ~np.isfinite(values)
    if bad.any():
        raise ValueError(f"INPUT: {_name(path)}: {y}: got {str(frame[y][bad].iloc[0])[:40]!r}, expected a number "
                         f"from 0 to {high:g}")
    if frame.empty:
        raise ValueError(f"INPUT: {_name(path)} has no finished run (status 'ok') to plot")
    return frame.assign(**{y: values, name: frame[name].astype(str).str.slice(0, 60)})


def read_validate(doc: Any, path: str) -> dict:
    """A ``validate --json`` report with the fields ``validate_figure`` reads, each checked."""
    missing = [f for f in VALIDATE_FIELDS if f not in doc]
    if missing:
        raise ValueError(f"INPUT: {_name(path)} has no field {missing[0]!r}, expected a 'pipescope validate --json' "
                         f"report")
    devices = doc["per_device"]
    if not isinstance(devices, list) or not 1 <= len(devices) <= 4096:
        raise ValueError(f"INPUT: {_name(path)}: per_device: expected a list of 1 to 4,096 devices")
    for key in ("predicted_iteration_time_s", "measured_iteration_time_s"):
        if _number(doc[key], key, path) <= 0:
            raise ValueError(f"INPUT: {_name(path)}: {key}: got {doc[key]!r}, expected a time above 0")
    seen = set()
    for i, d in enumerate(devices):
        if not isinstance(d, dict):
            raise ValueError(f"INPUT: {_name(path)}: per_device[{i}]: expected an object")
        memory = ("predicted_peak_memory_bytes", "measured_peak_memory_bytes") if "predicted_peak_memory_bytes" in d \
            else ()
        for key in ("predicted_busy_s", "measured_busy_s", *memory):
            if _number(d.get(key), f"per_device[{i}].{key}", path) < 0:
                raise ValueError(f"INPUT: {_name(path)}: per_device[{i}].{key}: got {d[key]!r}, expected >= 0")
        try:
            _integer(d.get("device"), f"per_device[{i}].device", 0, MAX_DEVICE)
        except ValueError as err:
            raise ValueError(f"INPUT: {_name(path)}: {err}") from None
        if d["device"] in seen:
            raise ValueError(f"INPUT: {_name(path)}: per_device[{i}].device: got {d['device']!r} twice, expected "
                             "each device once")
        seen.add(d["device"])
    # the title's error, from the two times it sits above, not the stored field (which could say anything)
    error = doc["predicted_iteration_time_s"] / doc["measured_iteration_time_s"] - 1
    return {**doc, "iteration_time_error": error, "schedule": str(doc["schedule"])[:60],
            "stages": str(doc["stages"])[:10], "microbatches": str(doc["microbatches"])[:10]}


def _number(value: Any, what: str, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
            abs(value) > 1e18:
        raise ValueError(f"INPUT: {_name(path)}: {what}: got {str(value)[:40]!r}, expected a finite number")
    return float(value)


def compute_rows(path: str) -> pd.DataFrame:
    """A timeline file's compute rows (device, kind, start_ns, end_ns), for the overlay."""
    data = run_from_timeline(path, None)
    return data.ops[data.ops["lane"] == "compute"]
