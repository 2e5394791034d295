"""The calibration profile format: file names, columns, schema version and the checks readers run.

Standard library only: ``calibration/`` writes profiles by it and ``simulator/profiled.py`` reads them, so it
lives on the simulator's side (data flows calibration -> profile -> cost model) and never pulls in torch.
See ``calibration/profiles/README.md`` for the format in prose.

Every profile file is hostile input: the metadata checks here and the column rules below (applied by
``simulator/profiled.py``) refuse anything else with one ``ProfileError`` line naming the file, the key or
column (and row), the value and what was expected.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipescope.simulator.models import PRECISIONS
from pipescope.simulator.readers.units import short_repr

# Bump on any change a reader of the previous version would misread; readers refuse other versions.
SCHEMA_VERSION = 1

COMPUTE_META = "profile.json"
COMMS_META = "comms.json"
GEMMS_META = "gemms.json"
# Each metadata file's kind, the command that writes it and the config key that names its folder.
META_KINDS = {COMPUTE_META: ("compute", "pipescope calibrate", "costs.profile"),
              COMMS_META: ("comms", "pipescope calibrate-comms", "costs.profile"),
              GEMMS_META: ("gemms", "pipescope calibrate-gemms", "costs.gemms")}

# Components and ops of the timings table (see the README for what each one times).
LAYER, EMBEDDING, OUTPUT, OUTPUT_SHARD, OPTIMIZER = "layer", "embedding", "output", "output_shard", "optimizer"
COMPONENTS = (LAYER, EMBEDDING, OUTPUT, OUTPUT_SHARD, OPTIMIZER)
OPS = ("F", "I", "W", "B", "R", "S", "T", "S2", "T2", "step")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")

# Bounds on what a reader accepts. MAX_NUMBER (2**53) is the largest integer a float64 holds exactly, so no count
# read from a profile is rounded, overflows a float or wraps an int64; the cost model bounds op times further
# (simulator/costs.py MAX_OP_SECONDS). Real profiles are a few kilobytes of metadata and a few thousand rows.
MAX_NUMBER = 2**53
MAX_METADATA_BYTES = 1 << 20
MAX_TABLE_BYTES = 16 << 20
MAX_TABLE_ROWS = 1_000_000
# The rule columns of a Parquet table once decompressed, from its footer before reading (a million rows of random
# times: 25 MB of Parquet, 36 MB unpacked). Text is read dictionary-encoded: a word repeated in every row is held once.
MAX_TABLE_UNPACKED_BYTES = 4 * MAX_TABLE_BYTES

# How a reader checks each column it relies on, per table (writers may add columns; readers ignore extras).
# A tuple: text, one of those values. "count": a whole number >= 0. "positive": a whole number >= 1. "point": a
# measured microbatch size or sequence length, a whole number >= 1 (the timings table's optimizer rows measure no
# point and store 0). "ns": a time >= 0 in nanoseconds, at most costs.MAX_OP_SECONDS. "bytes": a number >= 0;
# "bytes?" also NaN (not measured). "rate": a number > 0 (bytes per second). Every number must be finite and at
# most MAX_NUMBER.
TIMING_RULES: dict[str, tuple[str, ...] | str] = {
    "component": COMPONENTS, "op": OPS, "microbatch_size": "point", "seq": "point", "shards": "positive",
    "params": "count", "tensors": "count", "median_ns": "ns", "p10_ns": "ns", "p90_ns": "ns", "min_ns": "ns",
    "reps": "positive",
}
MEMORY_RULES: dict[str, tuple[str, ...] | str] = {
    "component": (LAYER, EMBEDDING, OUTPUT), "microbatch_size": "point", "seq": "point", "params": "count",
    "tensors": "count", "param_bytes": "bytes", "activation_bytes": "bytes", "weight_grad_bytes": "bytes",
    "boundary_bytes": "bytes", "peak_backward_bytes": "bytes?",
}
COMMS_FIT_RULES: dict[str, tuple[str, ...] | str] = {
    "collective": COLLECTIVES, "world_size": "positive", "lo_bytes": "count", "hi_bytes": "count",
    "latency_ns": "ns", "bandwidth": "rate", "points": "positive",
}
# At most this many matmul shapes per GEMM table (16 sizes cubed): calibrate-gemms writes no more, and the cost model
# looks each matmul up in all of them.
MAX_GEMM_SHAPES = 4_096
# One matmul shape, (m x k) times (k x n), and its time: "duration" is "ns" above 0, since a rate divides by it.
GEMM_RULES: dict[str, tuple[str, ...] | str] = {"m": "positive", "n": "positive", "k": "positive",
                                                "median_ns": "duration"}
COLUMN_RULES = {"timings": TIMING_RULES, "memory": MEMORY_RULES, "comms_fit": COMMS_FIT_RULES, "gemms": GEMM_RULES}

# Table name -> columns every reader relies on, in the order writers put them first.
TIMING_COLUMNS = tuple(TIMING_RULES)
MEMORY_COLUMNS = tuple(MEMORY_RULES)
COMMS_COLUMNS = (  # written by calibrate-comms for people and plots; the simulator reads only comms_fit
    "collective", "world_size", "nbytes", "median_ns", "p10_ns", "p90_ns", "reps", "algbw_gbps", "busbw_gbps",
)
COMMS_FIT_COLUMNS = tuple(COMMS_FIT_RULES)
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "timings": TIMING_COLUMNS,
    "memory": MEMORY_COLUMNS,
    "comms": COMMS_COLUMNS,
    "comms_fit": COMMS_FIT_COLUMNS,
    "gemms": tuple(GEMM_RULES),  # calibrate-gemms adds the spread and TFLOP/s, for people
}
TABLE_SUFFIXES = (".parquet", ".csv")

# Metadata keys checked when present (integers from 1 to MAX_NUMBER; lists of them, not empty).
META_INTEGERS = ("model.layers", "model.hidden", "model.heads", "model.seq", "model.vocab", "vocab_shards")
META_INTEGER_LISTS = ("seqs", "microbatch_sizes")


class ProfileError(ValueError):
    """A profile that cannot be read: missing or malformed file, other schema version, missing or bad column."""


class _BadNumber(ValueError):
    """A JSON number no reader can use (NaN, Infinity, or a float beyond float64's range)."""


def _refuse(text: str) -> float:
    raise _BadNumber(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(text)
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, ValueError on a key given twice (json keeps the last one silently)."""
    meta = dict(pairs)
    if len(meta) < len(pairs):
        seen = [key for key, _ in pairs]
        raise ValueError(f"key {next(k for k in seen if seen.count(k) > 1)!r} appears twice")
    return meta


def read_metadata(profile_dir: str | os.PathLike, name: str = COMPUTE_META) -> dict:
    """Load and check a profile's JSON metadata (``check_metadata``).

    Args:
        profile_dir: the folder ``pipescope calibrate --out`` wrote.
        name: ``profile.json`` (compute), ``comms.json`` or ``gemms.json`` (``META_KINDS``).

    Raises:
        ProfileError: the file is missing, too large, not UTF-8 JSON, holds NaN/Infinity or an out-of-range
            number, is not an object, has another schema version or a malformed key.
    """
    path = Path(profile_dir) / name
    kind, writer, key = META_KINDS[name]
    if not Path(profile_dir).is_dir():
        raise ProfileError(f"{key}: {str(profile_dir)!r} is not a folder; expected a {writer} output folder")
    if not path.is_file():
        raise ProfileError(f"{key}: {str(profile_dir)!r} has no {name}; expected a {writer} output")
    try:
        size = path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise ProfileError(f"{path}: {size} bytes; expected JSON metadata of at most {MAX_METADATA_BYTES} bytes")
        meta = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_refuse, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except _BadNumber as exc:
        raise ProfileError(f"{path}: number {exc} is not a finite float; expected JSON metadata") from None
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise ProfileError(f"{path}: unreadable ({one_line(exc)}); expected JSON metadata") from None
    if not isinstance(meta, dict):
        raise ProfileError(f"{path}: a JSON {type(meta).__name__}; expected a JSON object of metadata")
    check_version(meta, str(path))
    check_metadata(meta, str(path))
    if meta.get("kind", kind) != kind:  # absent in hand-made profiles: the file name says which it is
        raise ProfileError(f"{path}: kind={short_repr(meta['kind'])}; expected {kind!r}")
    return meta


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one short line (its type, then the first line of its message): for wrapped library errors."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def check_version(meta: dict, where: str) -> None:
    """Refuse metadata of any schema version but this one, saying which way the mismatch goes."""
    version = meta.get("schema_version") if isinstance(meta, dict) else None
    if version == SCHEMA_VERSION and not isinstance(version, bool):
        return
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        hint = "written by a newer pipescope; upgrade pipescope"
    else:
        hint = "re-run `pipescope calibrate`"
    raise ProfileError(f"{where}: schema_version={short_repr(version)}; expected {SCHEMA_VERSION} ({hint})")


def is_count(value: Any) -> bool:
    """An int (not a bool) from 1 to MAX_NUMBER."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_NUMBER


def check_metadata(meta: dict, where: str) -> None:
    """Check the metadata keys readers use: ``tables`` a mapping of table names to plain Parquet/CSV file names
    in the folder; when present, ``model`` a mapping, its integer fields and ``vocab_shards`` integers from 1 to
    MAX_NUMBER, ``seqs`` and ``microbatch_sizes`` non-empty lists of them, ``precision`` one of PRECISIONS."""
    tables = meta.get("tables")
    if not isinstance(tables, dict):
        raise ProfileError(f"{where}: tables={short_repr(tables)}; expected a mapping of table names to file names")
    for table, name in tables.items():
        if not (isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..")
                and "\\" not in name and name.endswith(TABLE_SUFFIXES)):
            raise ProfileError(f"{where}: tables.{table}={short_repr(name)}; expected a file name in the profile "
                               "folder ending in .parquet or .csv")
    model = meta.get("model", {})
    if not isinstance(model, dict):
        raise ProfileError(f"{where}: model={short_repr(model)}; expected a mapping (name, layers, hidden, ...)")
    for key in META_INTEGERS:
        section, _, field = key.rpartition(".")
        owner = model if section == "model" else meta
        if field in owner and not is_count(owner[field]):
            raise ProfileError(f"{where}: {key}={short_repr(owner[field])}; expected an integer from 1 to "
                               f"{MAX_NUMBER:,}")
    for key in META_INTEGER_LISTS:
        values = meta.get(key, [1])
        if not isinstance(values, list) or not values or not all(is_count(v) for v in values):
            raise ProfileError(f"{where}: {key}={short_repr(values)}; expected a non-empty list of integers from 1 to "
                               f"{MAX_NUMBER}")
    precision = meta.get("precision", "fp32")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ProfileError(f"{where}: precision={short_repr(precision)}; expected one of {', '.join(PRECISIONS)}")


def check_columns(columns: Iterable[str], table: str, where: str) -> None:
    """Raise ProfileError naming the first column ``table`` needs that ``columns`` lacks or holds twice."""
    present = list(columns)
    missing = [c for c in TABLE_COLUMNS[table] if c not in present]
    if missing:
        expected = ", ".join(TABLE_COLUMNS[table])
        raise ProfileError(f"{where}: column {missing[0]!r} missing; expected columns {expected}")
    twice = [c for c in TABLE_COLUMNS[table] if present.count(c) > 1]
    if twice:
        raise ProfileError(f"{where}: column {twice[0]!r} appears {present.count(twice[0])} times; expected once")


def table_path(profile_dir: str | os.PathLike, meta: dict, table: str) -> Path:
    """Where the metadata says ``table`` lives (Parquet or CSV), checked to exist and to be of a sane size."""
    tables = meta.get("tables")
    name = tables.get(table) if isinstance(tables, dict) else None
    if not name or not isinstance(name, str):
        raise ProfileError(f"{Path(profile_dir)}: metadata lists no table {table!r}; expected one under 'tables'")
    path = Path(profile_dir) / name
    try:
        size = path.stat().st_size if path.is_file() else None
    except OSError as exc:  # a name too long for the file system, a folder we may not read
        raise ProfileError(f"{path}: unreadable ({one_line(exc)}); expected the {table!r} table") from None
    if size is None:
        raise ProfileError(f"{path}: missing; expected the {table!r} table the metadata names")
    if size > MAX_TABLE_BYTES:
        raise ProfileError(f"{path}: {size} bytes; expected a {table!r} table of at most {MAX_TABLE_BYTES} bytes")
    return path
