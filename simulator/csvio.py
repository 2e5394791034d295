"""torch.distributed.pipelining's schedule CSV: one row per rank, one cell per action,
an empty cell is an idle step (docs/schedules.md section 8)."""

from __future__ import annotations

import csv
import io

from pipescope.simulator.files import write_atomic
from pipescope.simulator.ir import COMPUTE_KINDS, Schedule, parse_cell


def to_csv_text(schedule: Schedule, compute_only: bool = True) -> str:
    """Render the schedule as torch's CSV (compute-only by default: no send/recv cells)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in schedule.device_actions:
        kept = [a for a in actions if not compute_only or a is None or a.kind in COMPUTE_KINDS]
        writer.writerow(["" if a is None else str(a) for a in kept])
    return out.getvalue()


def write_csv(schedule: Schedule, path: str) -> None:
    """Write the compute-only CSV atomically (a killed run never leaves half a file)."""
    write_atomic(path, to_csv_text(schedule))


def from_csv_text(text: str, num_microbatches: int | None = None, name: str = "csv") -> Schedule:
    """Parse torch's CSV into a Schedule.

    Stages are placed on the device where they first appear; the checker reports a
    stage that shows up on a second device. An ``OVERLAP_F_B`` cell becomes its actions in
    order. Without ``num_microbatches`` it is taken as one more than the highest microbatch seen.
    """
    rows = list(csv.reader(io.StringIO(text.removeprefix("\ufeff"))))
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # trailing blank lines are not idle ranks
    empty = [rank for rank, row in enumerate(rows) if not any(cell.strip() for cell in row)]
    if empty:
        raise ValueError(f"row {empty[0]} is blank, expected one row of actions per rank")
    device_actions = []
    for rank, row in enumerate(rows):
        try:
            cells = [parse_cell(cell) or [None] for cell in row]
            device_actions.append(tuple(a for actions in cells for a in actions))
        except ValueError as err:
            raise ValueError(f"row {rank}: {err}") from None
    compute = [(d, a) for d, acts in enumerate(device_actions)
               for a in acts if a is not None and a.kind in COMPUTE_KINDS]
    if not compute:
        raise ValueError("schedule CSV holds no compute actions")
    home: dict[int, int] = {}
    for device, action in compute:
        home.setdefault(action.stage, device)
    if max(home) >= len(home):  # stages must be 0..S-1; look only as far as S+5 (indices may be huge)
        missing = [s for s in range(len(home) + 5) if s not in home][:5]
        raise ValueError(f"schedule CSV uses stage {max(home)} but has no action for stage(s) {missing}")
    num_stages = len(home)
    if num_microbatches is not None and num_microbatches < 1:
        raise ValueError(f"microbatches(={num_microbatches}) must be >= 1")
    seen_mb = max(a.microbatch for _, a in compute) + 1
    return Schedule(
        name=name,
        num_devices=len(device_actions),
        num_microbatches=num_microbatches or seen_mb,
        stage_to_device=tuple(home[s] for s in range(num_stages)),
        device_actions=tuple(device_actions),
    )


def read_csv(path: str, num_microbatches: int | None = None) -> Schedule:
    with open(path, encoding="utf-8") as handle:
        return from_csv_text(handle.read(), num_microbatches, name=f"csv:{path}")
