"""Writing profiles atomically: every file goes to a temporary name in the same folder and is renamed into
place, tables first and the JSON metadata last, so a killed run never leaves a profile that loads as valid.
Parquet when pyarrow is installed, CSV otherwise. No pickle anywhere."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pandas as pd

from pipescope.simulator.profile_schema import TABLE_COLUMNS


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
    except OSError as exc:
        raise ValueError(f"--out: {str(out)!r}, expected a writable folder ({type(exc).__name__}: "
                         f"{exc.strerror or exc})") from exc
    return path


def _atomic(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path`` (same folder, so atomic)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a profile is meant to be shared like any file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON, atomically."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True, default=str)
            f.write("\n")

    _atomic(path, write)


def write_table(out: Path, table: str, rows: list[dict], parquet: bool | None = None) -> str:
    """Write ``rows`` as table ``table`` (columns in schema order first) and return the file name used."""
    frame = pd.DataFrame(rows)
    schema_cols = [c for c in TABLE_COLUMNS[table] if c in frame.columns]
    frame = frame[schema_cols + [c for c in frame.columns if c not in schema_cols]]
    use_parquet = has_parquet() if parquet is None else parquet
    name = f"{table}.parquet" if use_parquet else f"{table}.csv"
    if use_parquet:
        _atomic(out / name, lambda tmp: frame.to_parquet(tmp, index=False))
    else:
        _atomic(out / name, lambda tmp: frame.to_csv(tmp, index=False))
    return name
