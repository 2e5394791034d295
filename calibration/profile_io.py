"""Writing profiles atomically (``simulator.readers.files.write_atomic``: a temporary name in the same folder, renamed
into place), tables first and the JSON metadata last, so a killed run never leaves a profile that loads as valid.
Parquet when pyarrow is installed, CSV otherwise. No pickle anywhere."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import pandas as pd

from pipescope.simulator.readers.files import write_atomic
from pipescope.simulator.readers.profile_schema import TABLE_COLUMNS


def has_parquet() -> bool:
    try:
        import pyarrow  # noqa: F401 (only probing that it is there)
    except ImportError:
        return False
    return True


def ensure_writable(out: str | os.PathLike) -> Path:
    """Create ``out`` if needed and prove a file can be written there, before any slow measuring starts.

    Raises:
        ValueError: naming ``--out``, the path and why it is not writable.
    """
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ValueError(f"--out: got {str(out)!r}, expected a writable folder ({type(exc).__name__}: "
                         f"{getattr(exc, 'strerror', None) or exc})") from exc
    return path


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON, atomically."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def write_table(out: Path, table: str, rows: list[dict], parquet: bool | None = None) -> str:
    """Write ``rows`` as table ``table`` (columns in schema order first) and return the file name used.

    The table is serialised in memory first, so a value pandas or pyarrow cannot write fails before any file
    (temporary or not) exists; then one atomic write puts it in place.
    """
    frame = pd.DataFrame(rows)
    schema_cols = [c for c in TABLE_COLUMNS[table] if c in frame.columns]
    frame = frame[schema_cols + [c for c in frame.columns if c not in schema_cols]]
    use_parquet = has_parquet() if parquet is None else parquet
    name = f"{table}.parquet" if use_parquet else f"{table}.csv"
    buffer = io.BytesIO()
    if use_parquet:
        frame.to_parquet(buffer, index=False)
    else:
        frame.to_csv(buffer, index=False)
    write_atomic(out / name, buffer.getvalue())
    return name
