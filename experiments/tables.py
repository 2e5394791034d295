"""Writing result tables: the op timeline as Parquet (pyarrow) or CSV."""

from __future__ import annotations

import io

from pipescope.simulator.readers.files import write_atomic
from pipescope.simulator.result import SimResult


def write_timeline(result: SimResult, path: str) -> None:
    """Parquet when the name ends in .parquet (needs pyarrow), else CSV; atomic either way."""
    buffer = io.BytesIO()
    if path.lower().endswith(".parquet"):
        result.timeline.to_parquet(buffer, index=False)
    else:
        result.timeline.to_csv(buffer, index=False)
    write_atomic(path, buffer.getvalue())
