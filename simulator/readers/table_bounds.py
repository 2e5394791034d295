"""Bounds on a table file a user hands us (CSV or Parquet), checked before pandas or pyarrow reads a row.

Shared by calibration profiles (``simulator/profiled.py``) and plot inputs (``experiments/plots_inputs.py``). A file
of a few megabytes can cost gigabytes once parsed: pandas spends about 5 KB and 50 us per column while it reads a
CSV header (12 MB of column names took 78 s and 7.7 GB), and a Parquet file's compressed pages can unpack to far more
than the file. So both are bounded from what costs nothing to read: a CSV's first record and a Parquet footer.
Standard library only until a Parquet file is checked (pyarrow is imported then).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyarrow import Schema
    from pyarrow.parquet import FileMetaData

# A real table has tens of columns (a profile 12, a sweep's table about 60); at 10,000 pandas takes well
# under a second and 50 MB to read the names
MAX_COLUMNS = 10_000
MAX_HEADER_BYTES = 1 << 20  # a CSV header: 10,000 names of 100 bytes
_LINE_END = re.compile(rb"[\r\n]")


class TableTooBig(ValueError):
    """A table over a bound: the message says which bound, the size found and the most allowed; the caller names
    the file."""


def check_csv_header(path: str | os.PathLike) -> None:
    """Refuse a CSV whose header (its first record) is over MAX_HEADER_BYTES or names more than MAX_COLUMNS
    columns, reading at most MAX_HEADER_BYTES + 1 bytes. Commas inside quotes count too: never too few columns.

    Raises:
        TableTooBig: either bound exceeded.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as handle:
        prefix = handle.read(MAX_HEADER_BYTES + 1)
    header = _first_record(prefix)
    if header is None and len(prefix) > MAX_HEADER_BYTES:
        raise TableTooBig(f"its header (the first line) is over {MAX_HEADER_BYTES:,} bytes, expected at most "
                          f"{MAX_COLUMNS:,} column names")
    columns = (prefix if header is None else header).count(b",") + 1
    if columns > MAX_COLUMNS:
        raise TableTooBig(f"its header has {columns:,} comma-separated names, expected at most {MAX_COLUMNS:,} columns")


def _first_record(data: bytes) -> bytes | None:
    """``data`` up to its first line break outside double quotes (a quoted name may hold one, as pandas reads it),
    or None where no record ends in ``data``."""
    quotes, start = 0, 0
    for end in _LINE_END.finditer(data):
        quotes += data.count(b'"', start, end.start())
        if quotes % 2 == 0:
            return data[:end.start()]
        start = end.start()
    return None


def parquet_shape(path: str | os.PathLike, max_unpacked: int,
                  columns: Collection[str] | None = None) -> tuple[Schema, int]:
    """The Arrow schema (column names and types) and row count from a Parquet file's footer, before any row is read.

    Args:
        max_unpacked: the most bytes ``columns`` may take once decompressed (the footer's uncompressed sizes).
        columns: the columns the caller will read (default: all of them).

    Raises:
        TableTooBig: more than MAX_COLUMNS columns, or ``columns`` unpack to more than ``max_unpacked`` bytes.
        ImportError: pyarrow is not installed. pyarrow's own errors (a ValueError or OSError) for a file that is
            not Parquet.
    """
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    meta = file.metadata
    if meta.num_columns > MAX_COLUMNS:
        raise TableTooBig(f"it has {meta.num_columns:,} columns, expected at most {MAX_COLUMNS:,}")
    unpacked = _unpacked_bytes(meta, columns)
    if unpacked > max_unpacked:
        raise TableTooBig(f"it unpacks to {unpacked:,} bytes, expected at most {max_unpacked:,}")
    return file.schema_arrow, meta.num_rows


def _unpacked_bytes(meta: FileMetaData, columns: Collection[str] | None) -> int:
    """The uncompressed size the footer gives for ``columns`` (all: each row group's total). A nested column's
    leaves are named ``column.child...``; a leaf is counted under every name it could belong to (never too few)."""
    groups = range(meta.num_row_groups)
    if columns is None:
        return sum(meta.row_group(i).total_byte_size for i in groups)
    paths = [meta.schema.column(j).path for j in range(meta.num_columns)]
    leaves = [j for j, path in enumerate(paths) if any(path == c or path.startswith(c + ".") for c in columns)]
    return sum(meta.row_group(i).column(j).total_uncompressed_size for i in groups for j in leaves)
