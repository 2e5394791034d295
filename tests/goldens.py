"""Regenerating the golden torch schedule CSVs under tests/golden (test-only; needs torch).

``cd tests && python -c "import goldens; goldens.write_golden('golden', 'GPipe', 4, 8)"``; the tests compare the
goldens with what the installed torch builds (test_torch_replay.py) and use them without torch.
"""

from __future__ import annotations

import os

from pipescope.calibration.torch_schedules import canonical_name, torch_schedule
from pipescope.simulator.readers.csvio import write_csv

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def golden_name(name: str, stages: int, microbatches: int) -> str:
    """File name of a golden torch schedule CSV: ``torch_<ScheduleName>_p<P>_m<M>.csv``."""
    return f"torch_{canonical_name(name)}_p{stages}_m{microbatches}.csv"


def golden_path(name: str, stages: int, microbatches: int) -> str:
    return os.path.join(GOLDEN, golden_name(name, stages, microbatches))


def write_golden(folder: str, name: str, stages: int, microbatches: int, chunks: int = 1) -> str:
    """Write torch's order as our compute-only CSV (torch's text form) under ``folder``; returns the path."""
    path = os.path.join(folder, golden_name(name, stages, microbatches))
    write_csv(torch_schedule(name, stages, microbatches, chunks), path)
    return path
