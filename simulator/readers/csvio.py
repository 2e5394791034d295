"""torch.distributed.pipelining's schedule CSV: one row per rank, one cell per action,
an empty cell is an idle step (docs/schedules.md section 8).

Every file is treated as hostile: its size is bounded before it is parsed (``MAX_CSV_BYTES``, ``MAX_CSV_CELLS``,
``MAX_CSV_ACTIONS``), and anything wrong with it is a one-line ValueError naming the row (and cell) and what was
expected; the caller names the file.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections import Counter

from pipescope.simulator.readers.files import write_atomic
from pipescope.simulator.ir import COLLECTIVE_KINDS, COMPUTE_KINDS, VOCAB_KINDS, Action, Schedule, parse_cell
from pipescope.simulator.readers.units import short_repr

# Bounds on a schedule CSV, checked before parsing, so a hostile file costs neither gigabytes nor minutes. A
# 1F1B schedule with p = 2,000 and m = 4 takes 0.2 MB, 16,000 cells; torch's dump of GPipe at that size, with an
# idle cell per step, 8 million cells. Checking a schedule costs about 10 us per action: 2 million take ~30 s.
MAX_CSV_BYTES = 64 << 20  # 64 MiB
MAX_CSV_CELLS = 16_000_000  # cells, idle ones included (counted as commas plus line breaks)
MAX_CSV_ACTIONS = 2_000_000  # actions (non-empty cells; an OVERLAP_F_B cell counts its sub-actions)


def to_csv_text(schedule: Schedule, compute_only: bool = True) -> str:
    """Render the schedule as torch's CSV (compute-only by default: no send/recv cells). ValueError when the schedule
    holds vocabulary-parallel S/T passes or collectives, which torch's CSV cannot express."""
    extra = next((a for acts in schedule.device_actions for a in acts
                  if a is not None and (a.kind in VOCAB_KINDS or a.kind in COLLECTIVE_KINDS)), None)
    if extra is not None:
        raise ValueError(f"schedule {schedule.name!r} holds {extra}: torch's CSV has no vocabulary-parallel S/T passes "
                         f"or collectives; expected schedule.vocab naive or redistribute to export a CSV")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in schedule.device_actions:
        kept = [a for a in actions if not compute_only or a is None or a.kind in COMPUTE_KINDS]
        writer.writerow(_cells(kept, schedule.overlapped))
    return out.getvalue()


def _cells(actions: list, overlapped: frozenset) -> list[str]:
    """One row's cells: "" for an idle step, an F&B pair that follows itself as torch's ``(F;B)OVERLAP_F_B``."""
    cells, i = [], 0
    while i < len(actions):
        a = actions[i]
        pair = (a, actions[i + 1]) if i + 1 < len(actions) else None
        if pair in overlapped:
            cells.append(f"({pair[0]};{pair[1]})OVERLAP_F_B")
            i += 2
            continue
        cells.append("" if a is None else str(a))
        i += 1
    return cells


def write_csv(schedule: Schedule, path: str) -> None:
    """Write the compute-only CSV atomically (a killed run never leaves half a file)."""
    write_atomic(path, to_csv_text(schedule))


_ACTION_START = re.compile(r"(?:^|,)[ \t]*[0-9]", re.MULTILINE)


def _check_size(text: str) -> None:
    """ValueError if ``text`` is over the bounds or holds a NUL byte (before any parsing)."""
    if len(text) > MAX_CSV_BYTES:
        raise ValueError(f"{len(text)} characters, expected at most {MAX_CSV_BYTES} ({MAX_CSV_BYTES >> 20} MiB) "
                         f"for a schedule CSV")
    nul = text.find("\0")
    if nul >= 0:
        raise ValueError(f"line {text.count(chr(10), 0, nul) + 1} holds a NUL byte, expected a text file of "
                         f"comma-separated actions")
    actions = len(_ACTION_START.findall(text))  # cells that start with a stage number: one action at least each
    if actions > MAX_CSV_ACTIONS:
        raise ValueError(f"{actions} cells hold actions, expected at most {MAX_CSV_ACTIONS} (MAX_CSV_ACTIONS) in a "
                         f"schedule CSV")
    cells = text.count(",") + text.count("\n") + text.count("\r") + 1  # a bound: quoted commas count too
    if cells > MAX_CSV_CELLS:
        raise ValueError(f"about {cells} cells, expected at most {MAX_CSV_CELLS} (MAX_CSV_CELLS) for a schedule CSV")


Where = tuple[int, int, int, str]  # an action's stage, and the row, cell and text it first appears in


def _parse_rows(text: str) -> tuple[list[tuple[Action | None, ...]], dict[bool, Where], set[tuple[Action, Action]]]:
    """Per row, its actions (None for an idle cell); for compute actions (key True) and the others (False), the
    highest stage one names and where it first appears; and the (forward, backward) pairs of OVERLAP_F_B cells."""
    reader = csv.reader(io.StringIO(text), strict=True)  # an unclosed quote is an error, not a cell to the end
    device_actions: list[tuple[Action | None, ...]] = []
    blank: list[int] = []  # blank rows since the last non-blank one (trailing blank lines are not idle ranks)
    highest: dict[bool, Where] = {}
    pairs: set[tuple[Action, Action]] = set()
    count = 0
    try:
        for row in reader:
            rank = len(device_actions) + len(blank)
            acts: list[Action | None] = []
            for c, cell in enumerate(row):
                try:
                    parsed = parse_cell(cell)
                except ValueError as err:
                    raise ValueError(f"row {rank} cell {c}: {err}") from None
                if not parsed:
                    acts.append(None)
                    continue
                count += len(parsed)
                if count > MAX_CSV_ACTIONS:
                    raise ValueError(f"row {rank}: more than {MAX_CSV_ACTIONS} actions (MAX_CSV_ACTIONS), expected "
                                     f"at most that many in a schedule CSV")
                for action in parsed:
                    compute = action.kind in COMPUTE_KINDS
                    top = highest.get(compute)
                    if top is None or action.stage > top[0]:
                        highest[compute] = (action.stage, rank, c, cell.strip())
                acts.extend(parsed)
                if len(parsed) == 2 and cell.strip().endswith(")OVERLAP_F_B"):
                    pairs.add((parsed[0], parsed[1]))
            if not any(a is not None for a in acts):
                blank.append(rank)
                continue
            if blank:
                raise ValueError(f"row {blank[0]} is blank, expected one row of actions per rank")
            if not any(a is not None and a.kind in COMPUTE_KINDS for a in acts):
                raise ValueError(f"row {rank} has no compute action (F, I, W or B), expected every rank to run a "
                                 f"stage")
            device_actions.append(tuple(acts))
    except csv.Error as err:
        rank = len(device_actions) + len(blank)
        raise ValueError(f"row {rank} (line {reader.line_num}): {err}, expected short comma-separated cells "
                         f"such as 0F0") from None
    return device_actions, highest, pairs


def from_csv_text(text: str, num_microbatches: int | None = None, name: str = "csv") -> Schedule:
    """Parse torch's CSV into a Schedule.

    Stages are placed on the device where they first appear; the checker reports a stage that shows up on a second
    device. An ``OVERLAP_F_B`` cell becomes its actions in order, a pair of them kept as the schedule's
    ``overlapped``. Without ``num_microbatches`` it is taken as one more than the highest microbatch seen. A file
    whose first half of the stages runs only each iteration's first half of the microbatches and whose second half
    runs only the rest holds two pipelines (``Schedule.pipelines``: DualPipe's and Chimera's CSVs); as one it could
    never be valid.

    Raises:
        ValueError: one line naming the row (and cell) and what was expected: the text is over the bounds
            (``MAX_CSV_BYTES``, ``MAX_CSV_CELLS``, ``MAX_CSV_ACTIONS``), holds a NUL byte, a cell that is not an
            action, a blank row between ranks, a rank without compute actions, stages that are not ``0..S-1``, or
            a send/recv/per-stage action naming a stage outside them.
    """
    text = text.removeprefix("\ufeff")
    _check_size(text)
    if num_microbatches is not None and num_microbatches < 1:
        raise ValueError(f"microbatches: got {num_microbatches}, expected at least 1")
    device_actions, highest, pairs = _parse_rows(text)
    if not device_actions:
        raise ValueError("schedule CSV holds no compute actions")
    # a stage lives on the device that runs most of its compute actions (the first such device on a tie), so one
    # stray action is what the checker names, not the stage's own
    counts: dict[int, Counter[int]] = {}
    seen_mb = 0
    for device, actions in enumerate(device_actions):
        for a in actions:
            if a is not None and a.kind in COMPUTE_KINDS:
                counts.setdefault(a.stage, Counter())[device] += 1
                seen_mb = max(seen_mb, a.microbatch + 1)
    home = {stage: max(devices, key=lambda d: (devices[d], -d)) for stage, devices in counts.items()}
    num_stages = len(home)
    top, rank, cell, shown = highest[True]
    if top >= num_stages:  # stages must be 0..S-1; list gaps only as far as S+5 (indices may be huge)
        missing = [s for s in range(min(top, num_stages + 5)) if s not in home][:5]
        raise ValueError(f"row {rank} cell {cell}: {short_repr(shown, 40)} uses stage {top} but the file has no "
                         f"compute action for stage(s) {missing}, expected its {num_stages} stages numbered "
                         f"0..{num_stages - 1}")
    top, rank, cell, shown = highest.get(False, (-1, 0, 0, ""))
    if top >= num_stages:
        raise ValueError(f"row {rank} cell {cell}: {short_repr(shown, 40)} names stage {top}, expected a stage in "
                         f"0..{num_stages - 1} (the stages the file's compute actions use)")
    m = num_microbatches or seen_mb
    return Schedule(
        name=name,
        num_devices=len(device_actions),
        num_microbatches=m,
        stage_to_device=tuple(home[s] for s in range(num_stages)),
        device_actions=tuple(device_actions),
        overlapped=frozenset(pairs),
        pipelines=2 if _two_pipelines(device_actions, num_stages, m) else 1,
    )


def _two_pipelines(device_actions: list, num_stages: int, m: int) -> bool:
    """Whether the compute actions split into two pipelines (``from_csv_text``)."""
    if num_stages % 2 or m % 2:
        return False
    halves = {(a.stage >= num_stages // 2, a.microbatch % m >= m // 2)
              for actions in device_actions for a in actions if a is not None and a.kind in COMPUTE_KINDS}
    return halves == {(False, False), (True, True)}


def read_csv(path: str, num_microbatches: int | None = None) -> Schedule:
    """Read a schedule CSV: at most ``MAX_CSV_BYTES`` of UTF-8 text (ValueError otherwise; the caller names the file,
    OSError if it cannot be read)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError("not a regular file, expected a schedule CSV file")
    with open(path, "rb") as handle:
        data = handle.read(MAX_CSV_BYTES + 1)
    if len(data) > MAX_CSV_BYTES:
        raise ValueError(f"larger than {MAX_CSV_BYTES} bytes ({MAX_CSV_BYTES >> 20} MiB, MAX_CSV_BYTES), expected "
                         f"a smaller schedule CSV")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(f"line {line}: byte {data[err.start]:#04x} at offset {err.start} is not UTF-8, expected a "
                         f"UTF-8 text file") from None
    return from_csv_text(text, num_microbatches, name=f"csv:{path}")
