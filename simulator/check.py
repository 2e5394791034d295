"""Schedule checker: structure (every op exactly once, on the right device, W after I)
and deadlock freedom (a unit-time lockstep replay that names the stuck actions)."""

from __future__ import annotations

from pipescope.simulator.ir import COMPUTE_KINDS, Action, Schedule, producers


class ScheduleError(ValueError):
    """A malformed or deadlocking schedule; ``problems`` holds one line per finding."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        super().__init__("; ".join(shown))


def check(schedule: Schedule) -> int:
    """Raise ScheduleError if the schedule is malformed or deadlocks.

    Returns:
        The number of unit-time lockstep steps the schedule takes (compute only, results visible
        the next step; torch's dry run also spends steps on sends and receives, so it counts more).
    """
    problems = structure_problems(schedule)
    if problems:
        raise ScheduleError(problems)
    steps, stuck = lockstep(schedule)
    if stuck:
        raise ScheduleError(["deadlock: " + line for line in stuck])
    return steps


def _positions(schedule: Schedule) -> dict[Action, list[tuple[int, int]]]:
    where: dict[Action, list[tuple[int, int]]] = {}
    for device, actions in enumerate(schedule.device_actions):
        for step, action in enumerate(actions):
            if action is not None and action.kind in COMPUTE_KINDS:
                where.setdefault(action, []).append((device, step))
    return where


def _placement_problems(schedule: Schedule) -> list[str]:
    problems = []
    if len(schedule.device_actions) != schedule.num_devices:
        problems.append(f"schedule has {len(schedule.device_actions)} device lists, expected {schedule.num_devices}")
    for stage, device in enumerate(schedule.stage_to_device):
        if not 0 <= device < schedule.num_devices:
            problems.append(f"stage {stage} mapped to device {device}, expected 0..{schedule.num_devices - 1}")
    for device, actions in enumerate(schedule.device_actions):
        for step, action in enumerate(actions):
            if action is None or action.kind not in COMPUTE_KINDS:
                continue
            if not 0 <= action.stage < schedule.num_stages:
                problems.append(f"device {device} step {step}: {action} has stage outside 0..{schedule.num_stages - 1}")
            elif schedule.stage_to_device[action.stage] != device:
                home = schedule.stage_to_device[action.stage]
                problems.append(f"device {device} step {step}: {action} but stage {action.stage} is on device {home}"
                                f" (a stage on two devices)")
            if not 0 <= action.microbatch < schedule.total_microbatches:
                problems.append(f"device {device} step {step}: {action} has microbatch outside "
                                f"0..{schedule.total_microbatches - 1}")
    return problems


MAX_LISTED_PER_STAGE = 8


def _coverage_problems(schedule: Schedule, where: dict[Action, list[tuple[int, int]]]) -> list[str]:
    problems = []
    for action, places in where.items():
        if len(places) > 1:
            listed = ", ".join(f"device {d} step {k}" for d, k in places)
            problems.append(f"{action} appears {len(places)} times ({listed})")
    kinds: dict[int, dict[int, set[str]]] = {}
    for action in where:
        kinds.setdefault(action.stage, {}).setdefault(action.microbatch, set()).add(action.kind)
    for stage in range(schedule.num_stages):
        problems += _stage_coverage(stage, kinds.get(stage, {}), schedule.total_microbatches)
    return problems


def _stage_coverage(stage: int, kinds: dict[int, set[str]], total: int) -> list[str]:
    """What is missing for one stage, at most MAX_LISTED_PER_STAGE lines.

    The scan stops early, so a file claiming 10^9 microbatches does not hang the checker.
    """
    in_range = [mb for mb in kinds if 0 <= mb < total]
    if len(in_range) == total and all(_microbatch_problem(stage, mb, kinds[mb]) is None for mb in in_range):
        return []
    problems = []
    for mb in range(total):
        problem = _microbatch_problem(stage, mb, kinds.get(mb, set()))
        if problem is not None:
            problems.append(problem)
        if len(problems) == MAX_LISTED_PER_STAGE:
            problems.append(f"stage {stage}: further microbatches not listed")
            break
    return problems


def _microbatch_problem(stage: int, mb: int, has: set[str]) -> str | None:
    if "F" not in has:
        return f"stage {stage} microbatch {mb}: missing F ({stage}F{mb})"
    if "B" in has and has & {"I", "W"}:
        return f"stage {stage} microbatch {mb}: has both B and I/W"
    if "B" not in has and not {"I", "W"} <= has:
        missing = " and ".join(sorted({"I", "W"} - has)) if has & {"I", "W"} else "B (or I and W)"
        return f"stage {stage} microbatch {mb}: missing {missing}"
    return None


def _order_problems(where: dict[Action, list[tuple[int, int]]]) -> list[str]:
    problems = []
    for action, places in where.items():
        if action.kind != "W":
            continue
        grad = Action(action.stage, "I", action.microbatch)
        for (device, step), (i_device, i_step) in zip(places, where.get(grad, [])):
            if device == i_device and step < i_step:
                problems.append(f"device {device} step {step}: {action} comes before its {grad} (step {i_step})")
    return problems


def structure_problems(schedule: Schedule) -> list[str]:
    """Everything wrong with the schedule's shape, one line each (empty when well formed)."""
    problems = _placement_problems(schedule)
    if len(schedule.device_actions) != schedule.num_devices or any(
            not 0 <= d < schedule.num_devices for d in schedule.stage_to_device):
        return problems
    where = _positions(schedule)
    return problems + _coverage_problems(schedule, where) + _order_problems(where)


def lockstep(schedule: Schedule) -> tuple[int, list[str]]:
    """Replay in unit time: each step, every device whose next op has its inputs runs it.

    Results of a step are visible from the next step on, as in torch's dry run, so an op runs
    at step max(step of the op before it on its device, steps of its producers) + 1. That is
    computed with a worklist in one pass over the ops rather than step by step.

    Returns:
        (steps taken, stuck lines); stuck is empty when every op ran.
    """
    lists = [schedule.compute_actions(d) for d in range(schedule.num_devices)]
    present = frozenset(a for acts in lists for a in acts)
    step_of: dict[Action, int] = {}
    blocked: dict[Action, list[int]] = {}
    cursor = [0] * len(lists)
    last = [0] * len(lists)
    work, num_stages = list(range(len(lists))), schedule.num_stages
    while work:
        d = work.pop()
        while cursor[d] < len(lists[d]):
            action = lists[d][cursor[d]]
            level = last[d]
            for dep in producers(action, num_stages, present):
                if dep not in step_of:
                    blocked.setdefault(dep, []).append(d)
                    break
                level = max(level, step_of[dep])
            else:
                last[d] = step_of[action] = level + 1
                cursor[d] += 1
                work.extend(blocked.pop(action, ()))
                continue
            break
    if len(step_of) < len(present):
        needs = {lists[d][c]: producers(lists[d][c], schedule.num_stages, present)
                 for d, c in enumerate(cursor) if c < len(lists[d])}
        return max(step_of.values(), default=0), _stuck_lines(lists, cursor, needs, set(step_of))
    return max(step_of.values(), default=0), []


def _stuck_lines(lists: list[list[Action]], cursor: list[int], needs: dict[Action, list[Action]],
                 done: set[Action]) -> list[str]:
    lines = []
    for device, acts in enumerate(lists):
        if cursor[device] < len(acts):
            action = acts[cursor[device]]
            waiting = ", ".join(str(p) for p in needs[action] if p not in done)
            lines.append(f"device {device} op {cursor[device]}: {action} waits for {waiting}")
    return lines
