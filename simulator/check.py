"""Schedule checker: structure (every op exactly once, on the right device, W after I) and deadlock freedom.

Deadlocks are found by the engine itself: the lowered program replayed with every compute op one time unit and
free transfers, which also gives the lockstep step count (results visible the next step, as in torch's dry run).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from pipescope.simulator.engine import Engine, gc_paused
from pipescope.simulator.ir import (
    COMM_KINDS,
    COMPUTE_KINDS,
    STAGE_KINDS,
    Action,
    ActionKind,
    Role,
    Schedule,
    ScheduleError,
    capped,
)
from pipescope.simulator.lowering import lower
from pipescope.simulator.network import FifoLinks
from pipescope.simulator.program import KIND_CODE, KINDS, Columns, compile_program, unit_durations

K = ActionKind
PLACED_KINDS = COMM_KINDS | STAGE_KINDS  # not compute, but run on their stage's device: sends, receives, UNSHARD...


def check(schedule: Schedule) -> int:
    """Raise ScheduleError if the schedule is malformed or deadlocks.

    Returns:
        The number of unit-time lockstep steps the schedule takes (compute only: transfers are free, so an op runs
        the step after its inputs; torch's dry run also spends steps on sends and receives, so it counts more).
    """
    problems = structure_problems(schedule)
    if problems:
        raise ScheduleError(problems)
    return unit_steps(schedule)


def unit_steps(schedule: Schedule) -> int:
    """The engine's makespan with every compute op one unit long and free transfers (ScheduleError on deadlock)."""
    with gc_paused():
        program = compile_program(lower(schedule), unit_durations(schedule.num_stages), [0] * schedule.num_stages)
        times = Engine(program, FifoLinks.fixed_delay(0)).run()
    return max(times.entry_end, default=0)


def _positions(schedule: Schedule) -> dict[Action, list[tuple[int, int]]]:
    where: dict[Action, list[tuple[int, int]]] = {}
    for device, actions in enumerate(schedule.device_actions):
        for step, action in enumerate(actions):
            if action is not None and action.kind in COMPUTE_KINDS:
                where.setdefault(action, []).append((device, step))
    return where


def _placement_problems(schedule: Schedule) -> Iterator[str]:
    """One line per misplaced op, generated: a hostile file can hold millions, and ``capped`` keeps only a few."""
    if len(schedule.device_actions) != schedule.num_devices:
        yield f"schedule has {len(schedule.device_actions)} device lists, expected {schedule.num_devices}"
    for stage, device in enumerate(schedule.stage_to_device):
        if not 0 <= device < schedule.num_devices:
            yield f"stage {stage} mapped to device {device}, expected 0..{schedule.num_devices - 1}"
    for device, actions in enumerate(schedule.device_actions):
        for step, action in enumerate(actions):
            if action is None:
                continue
            if action.kind in PLACED_KINDS:
                yield from _placed_problems(schedule, device, step, action)
            if action.kind not in COMPUTE_KINDS:
                continue
            if not 0 <= action.stage < schedule.num_stages:
                yield f"device {device} step {step}: {action} has stage outside 0..{schedule.num_stages - 1}"
            elif schedule.stage_to_device[action.stage] != device:
                home = schedule.stage_to_device[action.stage]
                yield (f"device {device} step {step}: {action} but stage {action.stage} is on device {home}"
                       f" (a stage on two devices)")
            if not 0 <= action.microbatch < schedule.total_microbatches:
                yield (f"device {device} step {step}: {action} has microbatch outside "
                       f"0..{schedule.total_microbatches - 1}")


def _placed_problems(schedule: Schedule, device: int, step: int, action: Action) -> list[str]:
    """A send, receive or per-stage action must name an existing stage and sit on that stage's device; a send or
    receive must name a microbatch in range."""
    where, stages, total = f"device {device} step {step}: {action}", schedule.num_stages, schedule.total_microbatches
    if not 0 <= action.stage < stages:
        return [f"{where} has stage outside 0..{stages - 1}"]
    problems = []
    if schedule.stage_to_device[action.stage] != device:
        problems.append(f"{where} but stage {action.stage} is on device {schedule.stage_to_device[action.stage]}, "
                        f"expected it there")
    if action.kind in COMM_KINDS and not 0 <= action.microbatch < total:
        problems.append(f"{where} has microbatch outside 0..{total - 1}")
    return problems


MAX_LISTED_PER_STAGE = 8


def _coverage_problems(schedule: Schedule, where: dict[Action, list[tuple[int, int]]]) -> Iterator[str]:
    for action, places in where.items():
        if len(places) > 1:  # a row of one op 900,000 times: its first places, not a 40 MB line
            listed = ", ".join(capped(f"device {d} step {k}" for d, k in places))
            yield f"{action} appears {len(places)} times ({listed})"
    kinds: dict[int, dict[int, set[ActionKind]]] = {}
    for action in where:
        kinds.setdefault(action.stage, {}).setdefault(action.microbatch, set()).add(action.kind)
    for stage in range(schedule.num_stages):
        yield from _stage_coverage(schedule, stage, kinds.get(stage, {}))


def _stage_coverage(schedule: Schedule, stage: int, kinds: dict[int, set[ActionKind]]) -> list[str]:
    """What is missing for one stage, at most MAX_LISTED_PER_STAGE lines: every microbatch its pipeline runs
    (``Schedule.runs``) needs its ops, and one it does not run must have none.

    The scan walks only the stage's own microbatches and stops early, so a file claiming 10^9 microbatches does not
    hang the checker.
    """
    m, total = schedule.num_microbatches, schedule.total_microbatches
    own = schedule.microbatches_of(stage // schedule.pipeline_stages)
    in_range = [mb for mb in kinds if 0 <= mb < total]
    if len(in_range) == schedule.iterations * (own.stop - own.start) and all(  # len() of 10^30 overflows
            schedule.runs(stage, mb) and _microbatch_problem(stage, mb, kinds[mb]) is None for mb in in_range):
        return []
    further = f"stage {stage}: further microbatches not listed"  # only where one more problem was found
    problems = [f"stage {stage} microbatch {mb}: runs in another pipeline"
                for mb in sorted(in_range) if not schedule.runs(stage, mb)][:MAX_LISTED_PER_STAGE + 1]
    if len(problems) > MAX_LISTED_PER_STAGE:
        return problems[:MAX_LISTED_PER_STAGE] + [further]
    for mb in (it * m + k for it in range(schedule.iterations) for k in own):
        problem = _microbatch_problem(stage, mb, kinds.get(mb, set()))
        if problem is not None:
            if len(problems) == MAX_LISTED_PER_STAGE:
                return problems + [further]
            problems.append(problem)
    return problems


def _microbatch_problem(stage: int, mb: int, has: set[ActionKind]) -> str | None:
    if K.F not in has:
        return f"stage {stage} microbatch {mb}: missing F ({stage}F{mb})"
    if K.B in has and has & {K.I, K.W}:
        return f"stage {stage} microbatch {mb}: has both B and I/W"
    if K.B not in has and not {K.I, K.W} <= has:
        missing = " and ".join(sorted({K.I, K.W} - has)) if has & {K.I, K.W} else "B (or I and W)"
        return f"stage {stage} microbatch {mb}: missing {missing}"
    return None


def _order_problems(where: dict[Action, list[tuple[int, int]]]) -> Iterator[str]:
    for action, places in where.items():
        if action.kind is not ActionKind.W:
            continue
        grad = Action(action.stage, ActionKind.I, action.microbatch)
        for (device, step), (i_device, i_step) in zip(places, where.get(grad, [])):
            if device == i_device and step < i_step:
                yield f"device {device} step {step}: {action} comes before its {grad} (step {i_step})"


def structure_problems(schedule: Schedule) -> list[str]:
    """What is wrong with the schedule's shape, one line each (empty when well formed): the first
    ``MAX_LISTED_PROBLEMS`` and ``... and N more lines`` (``ir.capped``), so a million bad rows print a few lines.

    A vectorised pass proves the common case (well formed) quickly; only a schedule it cannot prove runs the
    line-by-line checks that name each problem.
    """
    if _well_formed(schedule):
        return []
    if len(schedule.device_actions) != schedule.num_devices or any(
            not 0 <= d < schedule.num_devices for d in schedule.stage_to_device):
        return capped(_placement_problems(schedule))
    where = _positions(schedule)
    # a stage's coverage may end in a "further microbatches not listed" note: N counts lines, not problems
    return capped(itertools.chain(_placement_problems(schedule), _coverage_problems(schedule, where),
                                  _order_problems(where)), unit=" lines")


def _well_formed(schedule: Schedule) -> bool:
    """True when every compute op is on its stage's device, in range, once, every (stage, microbatch) has F and
    either B or both I and W, and each W comes after its I; sends, receives and per-stage actions name a stage in
    range, on its device. False means "look closer", not "malformed"."""
    p = schedule.num_devices
    if len(schedule.device_actions) != p or any(not 0 <= d < p for d in schedule.stage_to_device):
        return False
    try:  # indices beyond int64 (a hand-built schedule) overflow; Columns refuses those beyond its MAX_INDEX
        return _placed_ok(schedule) and _compute_ok(schedule)
    except (OverflowError, ScheduleError):
        return False


def _placed_ok(schedule: Schedule) -> bool:
    """Every send, receive and per-stage action names a stage in range, on that stage's device, and every send and
    receive a microbatch in range."""
    per_device = [[a for a in acts if a is not None and a.kind in PLACED_KINDS] for acts in schedule.device_actions]
    ops = [a for acts in per_device for a in acts]
    if not ops:
        return True
    cols = Columns.of(ops, np.repeat(np.arange(len(per_device)), [len(acts) for acts in per_device]))
    if cols.stage.min() < 0 or cols.stage.max() >= schedule.num_stages:
        return False
    if (np.asarray(schedule.stage_to_device)[cols.stage] != cols.device).any():
        return False
    mb = cols.microbatch[cols.role != Role.STAGE]
    return not len(mb) or bool(mb.min() >= 0 and mb.max() < schedule.total_microbatches)


def _compute_ok(schedule: Schedule) -> bool:
    """The compute ops: on their stage's device, in range, once each, complete, each W after its I."""
    p, stages, total = schedule.num_devices, schedule.num_stages, schedule.total_microbatches
    per_device = [[a for a in acts if a is not None and a.kind in COMPUTE_KINDS] for acts in schedule.device_actions]
    ops = [a for acts in per_device for a in acts]
    runs = stages * total // schedule.pipelines  # (stage, microbatch) pairs that run: a microbatch's pipeline's
    if len(ops) > 4 * runs or len(ops) < 2 * runs or stages * total > 50_000_000:
        return False
    device = np.repeat(np.arange(p), [len(acts) for acts in per_device])
    cols = Columns.of(ops, device)
    stage, mb = cols.stage, cols.microbatch
    if stage.min() < 0 or stage.max() >= stages or mb.min() < 0 or mb.max() >= total:
        return False
    if (np.asarray(schedule.stage_to_device)[stage] != device).any():
        return False
    where = np.full((len(KINDS), stages, total), -1, dtype=np.int64)  # position of each op, -1 if absent
    where[cols.kind, stage, mb] = np.arange(len(ops))
    if (where >= 0).sum() != len(ops):
        return False  # an op appears twice
    f, i, w, b = (where[KIND_CODE[k]] >= 0 for k in (K.F, K.I, K.W, K.B))
    m, length = schedule.num_microbatches, schedule.pipeline_stages  # Schedule.runs, over every pair at once
    mine = (np.arange(total) % m * schedule.pipelines // m)[None, :] == (np.arange(stages) // length)[:, None]
    backward_ok = np.where(mine, (b & ~i & ~w) | (~b & i & w), ~(b | i | w))
    return bool((f == mine).all() and backward_ok.all()
                and (where[KIND_CODE[K.W]] > where[KIND_CODE[K.I]])[i].all())
