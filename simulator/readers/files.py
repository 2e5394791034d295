"""Reading small text files a user hands us, and writing result and profile files atomically (standard library
only).

Every writer in pipescope (schedule CSVs, traces, plots, tables, calibration profiles) goes through
``write_atomic``, so they share one rule for temporary files, permissions and error messages; YAML and GraphML files
are read through ``read_small_text``, which never reads more than its limit.
"""

from __future__ import annotations

import os
import stat
import tempfile


def read_small_text(path: str, limit: int, where: str, too_big: str, kind: str) -> str:
    """The UTF-8 text of ``path``, refused past ``limit`` bytes (never reading more than the limit).

    Raises:
        ValueError: ``{where}: ...``: unreadable, not a regular file (a FIFO would block the open forever, a device
            never end), larger than ``limit`` (``expected {too_big}``), or a byte that is not UTF-8 (``expected a
            UTF-8 {kind} file``).
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{where}: not a regular file (a folder, FIFO or device), expected a {kind} file")
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as err:
        raise ValueError(f"{where}: cannot read it ({err.strerror})") from None
    if len(data) > limit:
        raise ValueError(f"{where}: larger than {limit:,} bytes, expected {too_big}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: byte {err.start} is not UTF-8, expected a UTF-8 {kind} file") from None


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
    # the folder as the OS resolves it: ``sub/../x.csv`` needs ``sub`` made, which normalising the path would skip
    folder = os.path.dirname(path) or os.curdir
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
