"""Send/recv lowering and torch's unit-time dry run, re-implemented without torch (SCHEDULES.md section 8).

torch.distributed.pipelining checks schedules by lowering a compute-only order to send/recv actions
(``_add_send_recv``) and replaying that program in unit time (``_simulate_comms_compute``). These are the
same two passes over our IR, with torch's placement and readiness rules, so for any compute-only order
``add_send_recv`` gives torch's lowered order action for action and ``lockstep_comms`` torch's step count.
``comm_steps`` chains them. ``simulator.check.lockstep`` is the compute-only count (comms free); this is the
count torch reports, which also spends a step on every SEND and RECV.

Standard library only: the simulator never imports torch (tests compare against torch where installed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipescope.simulator.check import ScheduleError
from pipescope.simulator.ir import COMM_KINDS, COMPUTE_KINDS, STAGE_KINDS, Action, Schedule

Timeline = list[list[Action | None]]
"""Per device, one entry per step: the action run at that step, or ``None`` where the device waited."""


def comm_pair(action: Action, stage_to_device: Sequence[int]) -> tuple[Action, Action] | None:
    """The SEND on ``action``'s device and the RECV on its consumer's device, or None when nothing crosses.

    F(s) sends its output to stage s+1, I(s)/B(s) the input gradient to stage s-1 (W sends nothing); no
    transfer when the peer stage is on the same device or does not exist (torch's ``_has_comms``).
    """
    s, kind, mb = action
    if kind == "F":
        peer, send, recv = s + 1, "SEND_F", "RECV_F"
    elif kind in ("I", "B"):
        peer, send, recv = s - 1, "SEND_B", "RECV_B"
    else:
        return None
    if not 0 <= peer < len(stage_to_device) or stage_to_device[peer] == stage_to_device[s]:
        return None
    return Action(s, send, mb), Action(peer, recv, mb)


def _needs(action: Action, num_stages: int) -> tuple[int, list[Action]]:
    """(stage whose device's history is consulted, actions any ONE of which lets ``action`` run).

    An empty list means always ready. These are torch's rules, weaker than ``simulator.ir.producers``:
    an I/B does not wait for its own F, nor a W for its I, since the dry run checks only transfers.
    """
    s, kind, mb = action
    if kind == "F":
        return s, ([Action(s, "RECV_F", mb), Action(s - 1, "F", mb)] if s > 0 else [])
    if kind in ("I", "B"):
        if s == num_stages - 1:
            return s, []
        return s, [Action(s, "RECV_B", mb), Action(s + 1, "I", mb), Action(s + 1, "B", mb)]
    if kind == "SEND_F":
        return s, [Action(s, "F", mb)]
    if kind == "SEND_B":
        return s, [Action(s, "I", mb), Action(s, "B", mb)]
    if kind == "RECV_F":  # the matching SEND must have run on the sender's device
        return s - 1, [Action(s - 1, "SEND_F", mb)]
    if kind == "RECV_B":
        return s + 1, [Action(s + 1, "SEND_B", mb)]
    return s, []  # W and torch's per-stage actions


def _waits_line(device: int, position: int, action: Action, needs: list[Action], where: int | None = None) -> str:
    place = "" if where is None else f" (on device {where})"
    return f"device {device} position {position}: {action} waits for {' or '.join(map(str, needs))}{place}"


def _lowering_input(schedule: Schedule) -> list[list[Action]]:
    """Per device, its actions without idle steps; comm actions mean the schedule is lowered already."""
    lists = []
    for device, actions in enumerate(schedule.device_actions):
        kept = [a for a in actions if a is not None]
        comm = next((a for a in kept if a.kind in COMM_KINDS), None)
        if comm is not None:
            raise ValueError(f"device {device} already has comm action {comm}; add_send_recv expects a "
                             f"compute-only schedule (use lockstep_comms on a lowered one)")
        lists.append(kept)
    return lists


def add_send_recv(schedule: Schedule) -> Schedule:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B the way torch's ``_add_send_recv`` does.

    Rounds over devices in order 0..p-1: a device places its next action if it is ready on that device
    (an F(s>0) once ``sRECV_F`` or its own F(s-1) is placed there, an I/B below the last stage once
    ``sRECV_B`` or its own I/B(s+1) is; anything else at once). Placing it appends the action and, when it
    feeds another device, its SEND right after it, plus the peer's RECV at the end of the peer's list, so a
    RECV lands where the consumer's list stands when the producer is placed. Later devices in the same round
    already see what earlier ones placed. Idle ``None`` steps are dropped first (torch's dry run filters
    them too); torch's per-stage actions (UNSHARD, RESHARD, REDUCE_GRAD) are kept in place, always ready,
    and take a round like any action, as in torch's runtime lowering.

    Args:
        schedule: a compute-only schedule (comm actions raise ValueError).

    Returns:
        The same schedule with lowered ``device_actions`` (no idle steps).

    Raises:
        ScheduleError: a round placed nothing (torch: "Malformed compute schedule"); one line per unfinished device
            names its next action, its position (idle steps not counted) and what it waits for.
    """
    lists = _lowering_input(schedule)
    home = schedule.stage_to_device
    out: list[list[Action]] = [[] for _ in lists]
    placed: list[set[Action]] = [set() for _ in lists]
    cursor = [0] * len(lists)
    active = [d for d, acts in enumerate(lists) if acts]
    while active:
        progress = False
        for d in active:
            action = lists[d][cursor[d]]
            # torch consults the placing rank's own list here (the runtime's view), not the stage's home
            needs = _needs(action, schedule.num_stages)[1]
            if needs and not any(n in placed[d] for n in needs):
                continue
            progress = True
            cursor[d] += 1
            out[d].append(action)
            placed[d].add(action)
            pair = comm_pair(action, home) if action.kind in COMPUTE_KINDS else None
            if pair is not None:
                send, recv = pair
                out[d].append(send)
                placed[d].add(send)
                out[home[recv.stage]].append(recv)
                placed[home[recv.stage]].add(recv)
        active = [d for d in active if cursor[d] < len(lists[d])]
        if not progress:
            raise ScheduleError(["cannot place sends/recvs: " + _waits_line(
                d, cursor[d], lists[d][cursor[d]], _needs(lists[d][cursor[d]], schedule.num_stages)[1])
                for d in active])
    return dataclasses.replace(schedule, device_actions=tuple(tuple(acts) for acts in out))


def _dry_run_input(schedule: Schedule) -> list[list[Action]]:
    """Per device, the actions the dry run executes: no idle steps, no per-stage actions (no dependencies)."""
    lists = [[a for a in acts if a is not None and a.kind not in STAGE_KINDS] for acts in schedule.device_actions]
    for device, acts in enumerate(lists):
        for action in acts:
            peer = _needs(action, schedule.num_stages)[0]
            if not (0 <= action.stage < schedule.num_stages and 0 <= peer < schedule.num_stages):
                raise ValueError(f"device {device}: {action} names a stage outside 0..{schedule.num_stages - 1}")
    return lists


def simulate_comms(schedule: Schedule) -> tuple[Timeline, list[str]]:
    """torch's ``_simulate_comms_compute`` on a comms-lowered schedule: its step-by-step timeline.

    One step is one sweep of torch's loop. First pass, devices 0..p-1 in order: a device whose list is not
    done runs its next action if ready, else records ``None`` (waits). Second pass, in the same step: each
    device that waited retries, again in device order, and runs its next action if it is ready now. Readiness
    looks at what has already run, including earlier in the same step: first-pass actions of every device for
    the second pass, and of lower-numbered devices within a pass; so a SEND and its RECV may share a step.
    Ready means: F(s>0) after ``sRECV_F`` or F(s-1) ran on stage s's device; I/B(s) below the last stage
    after ``sRECV_B``, I(s+1) or B(s+1) ran there; SEND_F after its F, SEND_B after its I or B, on the same
    device; RECV_F(s) after SEND_F(s-1) ran on stage s-1's device, RECV_B(s) after SEND_B(s+1) ran on stage
    s+1's device; F(0), the last stage's I/B, and every W at once. Every action takes exactly one step.
    Idle ``None`` steps in the input are dropped (waits come only from readiness), as are torch's per-stage
    actions (its dry run rejects them). A device that finishes records nothing more.

    Returns:
        (timeline, stuck): stuck is empty when every action ran, else one line per unfinished device naming
        its position in its list (idle steps not counted), its next action and what that waits for.

    Raises:
        ValueError: an action names a stage (or peer stage) outside the pipeline.
    """
    lists = _dry_run_input(schedule)
    home, num_stages = schedule.stage_to_device, schedule.num_stages
    ran: list[set[Action]] = [set() for _ in lists]
    timeline: Timeline = [[] for _ in lists]
    cursor = [0] * len(lists)

    def ready(action: Action) -> bool:
        stage, needs = _needs(action, num_stages)
        return not needs or any(n in ran[home[stage]] for n in needs)

    active = [d for d, acts in enumerate(lists) if acts]
    while active:
        progress = False
        for d in active:
            action = lists[d][cursor[d]]
            if ready(action):
                timeline[d].append(action)
                ran[d].add(action)
                cursor[d] += 1
                progress = True
            else:
                timeline[d].append(None)
        active = [d for d in active if cursor[d] < len(lists[d])]
        for d in active:  # torch's "second pass": fill this step's wait if an action got unblocked meanwhile
            action = lists[d][cursor[d]]
            if timeline[d][-1] is None and ready(action):
                timeline[d][-1] = action
                ran[d].add(action)
                cursor[d] += 1
        active = [d for d in active if cursor[d] < len(lists[d])]
        if not progress:
            stuck = []
            for d in active:
                action = lists[d][cursor[d]]
                stage, needs = _needs(action, num_stages)
                stuck.append(_waits_line(d, cursor[d], action, needs, home[stage]))
            return timeline, stuck
    return timeline, []


def lockstep_comms(schedule: Schedule) -> tuple[int, list[str]]:
    """Unit-time replay of a comms-lowered schedule under torch's dry-run rules (see ``simulate_comms``).

    Returns:
        (steps, stuck): steps is torch's count, the length of the longest device timeline, i.e. the
        number of sweeps until the last device ran its last action (waits included; a device done early
        adds nothing). stuck is empty when every action ran; on deadlock, steps counts the sweeps made
        before no device could move.
    """
    timeline, stuck = simulate_comms(schedule)
    return max((len(t) for t in timeline), default=0), stuck


def comm_steps(schedule: Schedule) -> int:
    """torch's dry-run step count: ``lockstep_comms(add_send_recv(schedule))``.

    A schedule that already holds comm actions (a "compute_comms" CSV) is taken as lowered. Structure
    (every op once, on its stage's device) is ``simulator.check.check``'s job; this counts torch's steps.

    Raises:
        ScheduleError: sends/recvs cannot be placed, or the lowered program deadlocks; one line per
            stuck device.
    """
    lowered = schedule
    if not any(a is not None and a.kind in COMM_KINDS for acts in schedule.device_actions for a in acts):
        lowered = add_send_recv(schedule)
    steps, stuck = lockstep_comms(lowered)
    if stuck:
        raise ScheduleError(["deadlock: " + line for line in stuck])
    return steps
