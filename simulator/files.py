"""Writing result and profile files atomically (standard library only).

Every writer in pipescope (schedule CSVs, traces, plots, tables, calibration profiles) goes through
``write_atomic``, so they share one rule for temporary files, permissions and error messages.
"""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` via a temporary file in the same folder and a rename.

    A killed run leaves either the old file or the new one, never half a file; the temporary file is removed
    on failure. Missing parent folders are created. The file is made ``0o644`` (mkstemp makes ``0o600``, and
    results and profiles are meant to be shared). No fsync: this guards against a dying process, not a dying
    machine.

    Raises:
        OSError: naming ``path``, not the temporary file.
    """
    payload = data.encode() if isinstance(data, str) else data
    try:
        _write_then_rename(os.fspath(path), payload)
    except OSError as err:
        raise OSError(err.errno, err.strerror, os.fspath(path)) from None


def _write_then_rename(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
