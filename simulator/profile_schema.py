"""The calibration profile format: file names, columns, schema version and the checks readers run.

Standard library only: ``calibration/`` writes profiles by it and ``simulator/profiled.py`` reads them, so it
lives on the simulator's side (data flows calibration -> profile -> cost model) and never pulls in torch.
See ``calibration/profiles/README.md`` for the format in prose.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

# Bump on any change a reader of the previous version would misread; readers refuse other versions.
SCHEMA_VERSION = 1

COMPUTE_META = "profile.json"
COMMS_META = "comms.json"

# Table name -> columns every reader relies on (writers may add more; readers ignore extras).
TIMING_COLUMNS = (
    "component", "op", "microbatch_size", "seq", "shards", "params", "tensors",
    "median_ns", "p10_ns", "p90_ns", "min_ns", "reps",
)
MEMORY_COLUMNS = (
    "component", "microbatch_size", "seq", "params", "tensors", "param_bytes",
    "activation_bytes", "weight_grad_bytes", "boundary_bytes", "peak_backward_bytes",
)
COMMS_COLUMNS = (
    "collective", "world_size", "nbytes", "median_ns", "p10_ns", "p90_ns", "reps", "algbw_gbps", "busbw_gbps",
)
COMMS_FIT_COLUMNS = ("collective", "world_size", "lo_bytes", "hi_bytes", "latency_ns", "bandwidth", "points")
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "timings": TIMING_COLUMNS,
    "memory": MEMORY_COLUMNS,
    "comms": COMMS_COLUMNS,
    "comms_fit": COMMS_FIT_COLUMNS,
}

# Components and ops of the timings table (see the README for what each one times).
LAYER, EMBEDDING, OUTPUT, OUTPUT_SHARD, OPTIMIZER = "layer", "embedding", "output", "output_shard", "optimizer"
COMPONENTS = (LAYER, EMBEDDING, OUTPUT, OUTPUT_SHARD, OPTIMIZER)
OPS = ("F", "I", "W", "B", "R", "S", "T", "step")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


class ProfileError(ValueError):
    """A profile that cannot be read: missing file, other schema version, missing column."""


def read_metadata(profile_dir: str | os.PathLike, name: str = COMPUTE_META) -> dict:
    """Load and check a profile's JSON metadata.

    Args:
        profile_dir: the folder ``pipescope calibrate --out`` wrote.
        name: ``profile.json`` (compute) or ``comms.json``.

    Raises:
        ProfileError: the file is missing or unreadable, or its schema version is not ``SCHEMA_VERSION``.
    """
    path = Path(profile_dir) / name
    if not path.is_file():
        raise ProfileError(f"costs.profile: {str(profile_dir)!r} has no {name}; expected a pipescope calibrate output")
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: unreadable ({exc}); expected JSON metadata") from exc
    check_version(meta, str(path))
    return meta


def check_version(meta: dict, where: str) -> None:
    """Refuse metadata of any schema version but this one, saying which way the mismatch goes."""
    version = meta.get("schema_version") if isinstance(meta, dict) else None
    if version == SCHEMA_VERSION:
        return
    if isinstance(version, int) and version > SCHEMA_VERSION:
        hint = "written by a newer pipescope; upgrade pipescope"
    else:
        hint = "re-run `pipescope calibrate`"
    raise ProfileError(f"{where}: schema_version={version!r}; expected {SCHEMA_VERSION} ({hint})")


def check_columns(columns: Iterable[str], table: str, where: str) -> None:
    """Raise ProfileError naming the first column ``table`` needs that ``columns`` lacks."""
    present = set(columns)
    missing = [c for c in TABLE_COLUMNS[table] if c not in present]
    if missing:
        expected = ", ".join(TABLE_COLUMNS[table])
        raise ProfileError(f"{where}: column {missing[0]!r} missing; expected columns {expected}")


def table_path(profile_dir: str | os.PathLike, meta: dict, table: str) -> Path:
    """Where the metadata says ``table`` lives (Parquet or CSV), checked to exist."""
    name = meta.get("tables", {}).get(table)
    if not name:
        raise ProfileError(f"{Path(profile_dir)}: metadata lists no table {table!r}; expected one under 'tables'")
    path = Path(profile_dir) / name
    if not path.is_file():
        raise ProfileError(f"{path}: missing; expected the {table!r} table the metadata names")
    return path
