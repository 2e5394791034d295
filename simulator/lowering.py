"""Send/recv lowering: the compute-only schedule becomes the program the engine runs (docs/schedules.md section 8).

``add_send_recv`` places SEND/RECV actions exactly as torch.distributed.pipelining's ``_add_send_recv`` does, so the
program pipescope simulates is the one torch's runtime (and this project's real executor) runs, action for action
(tests compare with torch where it is installed). ``program_inputs`` says what each action of that program waits for.

Standard library only: the simulator never imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Sequence
from heapq import heappop, heappush
from typing import Any

from pipescope.simulator.ir import (COMM_KINDS, COMPUTE_KINDS, STAGE_KINDS, Action, ActionKind, Collective,
                                   ProgramAction, Schedule, ScheduleError, WeightUpdate, producers)

K = ActionKind
# Per compute kind: (peer stage offset, SEND kind, RECV kind); W sends nothing.
_SENDS = {K.F: (1, K.SEND_F, K.RECV_F), K.I: (-1, K.SEND_B, K.RECV_B), K.B: (-1, K.SEND_B, K.RECV_B)}


def comm_pair(action: Action, stage_to_device: Sequence[int],
              pipeline_stages: int | None = None) -> tuple[Action, Action] | None:
    """The SEND on ``action``'s device and the RECV on its consumer's device, or None when nothing crosses.

    F(s) sends its output to stage s+1, I(s)/B(s) the input gradient to stage s-1 (W sends nothing); no
    transfer when the peer stage is on the same device or does not exist (torch's ``_has_comms``), or is in
    another pipeline (``Schedule.pipelines``; ``pipeline_stages`` is one's length, None: all the stages).
    """
    s, kind, mb = action
    sends = _SENDS.get(kind)
    if sends is None:
        return None
    peer = s + sends[0]
    if not 0 <= peer < len(stage_to_device) or stage_to_device[peer] == stage_to_device[s]:
        return None
    if pipeline_stages and peer // pipeline_stages != s // pipeline_stages:
        return None
    return Action(s, sends[1], mb), Action(peer, sends[2], mb)


def _placement_needs(action: Action, num_stages: int, pipeline_stages: int | None = None) -> list[Action]:
    """Actions any ONE of which, already placed on this device, lets ``action`` be placed (empty: at once).

    torch's rules, weaker than ``simulator.ir.producers``: an I/B does not wait for its own F, nor a W for its I,
    since placement only looks at what crosses devices. A pipeline's first and last stages (``pipeline_stages``,
    as ``producers``) wait for nothing before and after them.
    """
    s, kind, mb = action.stage, action.kind, action.microbatch
    length = pipeline_stages or num_stages
    if kind is K.F:
        return [Action(s, K.RECV_F, mb), Action(s - 1, K.F, mb)] if s % length else []
    if (kind is K.I or kind is K.B) and s < num_stages - 1 and (s + 1) % length:
        return [Action(s, K.RECV_B, mb), Action(s + 1, K.I, mb), Action(s + 1, K.B, mb)]
    return []


def _waits_line(device: int, position: int, action: Action, needs: list[Action]) -> str:
    return f"device {device} position {position}: {action} waits for {' or '.join(map(str, needs))}"


def _lowering_input(schedule: Schedule) -> list[list[Action]]:
    """Per device, its actions without idle steps; comm actions mean the schedule is lowered already."""
    lists = []
    for device, actions in enumerate(schedule.device_actions):
        kept = [a for a in actions if a is not None]
        comm = next((a for a in kept if a.kind in COMM_KINDS), None)
        if comm is not None:
            raise ValueError(f"device {device} already has comm action {comm}; add_send_recv expects a "
                             f"compute-only schedule (a lowered schedule runs as it is)")
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
    home, num_stages, length = schedule.stage_to_device, schedule.num_stages, schedule.pipeline_stages
    # Both rules depend on (stage, kind) only, the microbatch passes through: resolve them once per pair.
    rules = _per_stage_kind(lambda a: ([(n.stage, n.kind) for n in _placement_needs(a, num_stages, length)],
                                       comm_pair(a, home, length) if a.kind in COMPUTE_KINDS else None), lists)
    out: list[list[Action]] = [[] for _ in lists]
    placed: list[set[tuple]] = [set() for _ in lists]
    cursor = [0] * len(lists)
    # A round visits only the devices that may be ready: those that placed in the last round, and those a RECV
    # reached since they last waited (nothing else changes what a waiting device sees). This round's are in `now`, a
    # heap popped in rank order; a RECV reaching a higher rank wakes it this round, a lower one next round (`later`).
    # Equal to visiting every device every round, but linear in the actions rather than rounds x devices.
    now = [d for d, acts in enumerate(lists) if acts]
    later: list[int] = []
    queued = [False] * len(lists)  # in `now` or `later`
    for d in now:
        queued[d] = True
    while now:
        while now:
            d = heappop(now)
            queued[d] = False
            action = lists[d][cursor[d]]
            stage, kind, mb = action[0], action[1], action[2]
            here = placed[d]
            # torch consults the placing rank's own list here (the runtime's view), not the stage's home
            wanted, pair = rules[stage, kind]
            for st, kd in wanted:  # a for-else, not any(): this loop runs once per action placed
                if (st, kd, mb) in here:
                    break
            else:
                if wanted:
                    continue  # waits until a RECV reaches it
            cursor[d] += 1
            out[d].append(action)
            here.add(action)  # only compute ops and RECVs are ever needed: SENDs are not recorded
            if cursor[d] < len(lists[d]):
                later.append(d)
                queued[d] = True
            if pair is not None:
                send, recv = _NEW(Action, (pair[0].stage, pair[0].kind, mb)), _NEW(Action, (pair[1].stage,
                                                                                          pair[1].kind, mb))
                peer = home[recv.stage]
                out[d].append(send)
                out[peer].append(recv)
                placed[peer].add(recv)
                if not queued[peer] and cursor[peer] < len(lists[peer]):
                    queued[peer] = True
                    if peer > d:
                        heappush(now, peer)
                    else:
                        later.append(peer)
        now, later = sorted(later), []
    stuck = [d for d in range(len(lists)) if cursor[d] < len(lists[d])]
    if stuck:
        raise ScheduleError(["deadlock: cannot place sends/recvs: " + _waits_line(
            d, cursor[d], lists[d][cursor[d]], _placement_needs(lists[d][cursor[d]], num_stages, length))
            for d in stuck])
    return dataclasses.replace(schedule, device_actions=tuple(tuple(acts) for acts in out))


_NEW = tuple.__new__  # builds an Action in C; the NamedTuple's own __new__ is Python code, hot in this loop


def _per_stage_kind(rule: Callable[[Action], Any], lists: list[list[Action]]) -> dict[tuple[int, ActionKind], Any]:
    """``rule`` of a microbatch-0 stand-in for every (stage, kind) in the lists."""
    pairs = {(a.stage, a.kind) for acts in lists for a in acts}
    return {(stage, kind): rule(Action(stage, kind, 0)) for stage, kind in pairs}


MAX_ACTIVE_STAGES = 3  # torch's _add_unshard_reshard default: stages whose weights a device holds gathered at once
_REDUCED_BY = (K.W, K.B)  # the ops after whose m-th a stage's gradients are complete (torch's _requires_reduce_grad)


def add_unshard_reshard(actions: Sequence[Action | None], max_active: int = MAX_ACTIVE_STAGES) -> list[Action]:
    """One device's compute-only list with FSDP's UNSHARD and RESHARD, placed by torch.distributed.pipelining's rule
    (``_add_unshard_reshard``; docs/parallelism.md, "torch's FSDP actions"): before each action, the next
    ``max_active`` distinct stages the list will compute are gathered (UNSHARD, in order of use) and a gathered stage
    not among them is freed first (RESHARD); every stage still gathered is freed at the end.

    The gathered stages are a ``set`` as in torch, so stages are freed in the same order as torch frees them."""
    ops = [a for a in actions if a is not None]
    active: set[int] = set()
    out: list[Action] = []
    for action, upcoming in zip(ops, _upcoming_stages(ops, max_active)):
        for stage in [s for s in active if s not in upcoming]:
            active.remove(stage)
            out.append(Action(stage, K.RESHARD, -1))
        for stage in [s for s in upcoming if s not in active]:
            active.add(stage)
            out.append(Action(stage, K.UNSHARD, -1))
        out.append(action)
    for stage in list(active):
        out.append(Action(stage, K.RESHARD, -1))
    return out


def _upcoming_stages(ops: list[Action], count: int) -> list[list[int]]:
    """Per position, the next ``count`` distinct stages from it on, in order of first use: built backwards, each from
    the next one's, so a device's list costs its length times ``count`` (torch scans ahead from every action)."""
    out: list[list[int]] = [[] for _ in ops]
    upcoming: list[int] = []
    for i in range(len(ops) - 1, -1, -1):
        stage = ops[i].stage
        upcoming = [stage] + [s for s in upcoming if s != stage][:count - 1]
        out[i] = upcoming
    return out


def add_reduce_grad(actions: Sequence[Action], microbatches: int) -> list[Action]:
    """``actions`` with a REDUCE_GRAD of each stage right after its ``microbatches``-th W or B, where its
    gradients are complete (torch's ``_add_reduce_grad``)."""
    seen: dict[int, int] = {}
    out: list[Action] = []
    for action in actions:
        out.append(action)
        if action.kind in _REDUCED_BY:
            seen[action.stage] = seen.get(action.stage, 0) + 1
            if seen[action.stage] == microbatches:
                out.append(Action(action.stage, K.REDUCE_GRAD, -1))
    return out


def add_fsdp_actions(schedule: Schedule) -> Schedule:
    """``schedule`` (compute-only, without torch's per-stage actions: ValueError otherwise) with torch's FSDP actions
    on every device, as torch's runtime adds them before its send/recv lowering: ``add_unshard_reshard``, then
    ``add_reduce_grad``."""
    held = next((a for acts in schedule.device_actions for a in acts if a is not None and a.kind in STAGE_KINDS), None)
    if held is not None:
        raise ValueError(f"schedule already holds {held}; add_fsdp_actions expects a compute-only schedule")
    lists = tuple(tuple(add_reduce_grad(add_unshard_reshard(acts), schedule.num_microbatches))
                  for acts in _lowering_input(schedule))
    return dataclasses.replace(schedule, device_actions=lists)


def stage_actions(schedule: Schedule) -> set[ActionKind]:
    """Which of torch's per-stage actions (UNSHARD, RESHARD, REDUCE_GRAD) the lists hold: ``add_fsdp_actions``
    adds all three; torch's CSV of a stage without FSDP holds REDUCE_GRAD alone."""
    return {a.kind for acts in schedule.device_actions for a in acts if a is not None and a.kind in STAGE_KINDS}


def has_fsdp_actions(schedule: Schedule) -> bool:
    """The lists hold torch's UNSHARD actions, which gather a stage's weights under ZeRO-3 without resharding."""
    return K.UNSHARD in stage_actions(schedule)


def lower(schedule: Schedule) -> Schedule:
    """The program the engine runs: ``add_send_recv(schedule)``, or the schedule itself when it is lowered already
    (a torch "compute_comms" CSV, or a hand-built program with collectives and sends/recvs)."""
    return schedule if schedule.is_lowered else add_send_recv(schedule)


def program_inputs(action: Action, home: Sequence[int], num_stages: int, present: Container[Action],
                   pipeline_stages: int | None = None) -> list[Action]:
    """What ``action`` waits for in a lowered program: its producers (``simulator.ir.producers``, the one
    dependency rule), each one on another device replaced by the RECV of its transfer on this device."""
    here = home[action.stage]
    inputs = []
    for producer in producers(action, num_stages, present, pipeline_stages):
        pair = comm_pair(producer, home, pipeline_stages) if home[producer.stage] != here else None
        inputs.append(producer if pair is None else pair[1])
    return inputs


LAG_WITHOUT_FLUSH = 2  # iterations between a gradient and the first forward that needs its update (2BW, no step op)
NORM_BYTES = 8  # clipping's squared gradient norm, one float64, all-reduced over a replica's pipeline


def step_group(update: WeightUpdate, m: int, microbatch: int) -> int:
    """The optimizer step a microbatch's gradient belongs to: its own under PipeDream (one step per backward), else
    its iteration's. The executor (``executor/weights.py``) uses the same rule."""
    return microbatch if update is WeightUpdate.ASYNC_STASH else microbatch // m


def step_microbatch(update: WeightUpdate, m: int, group: int) -> int:
    """The microbatch a step's ``sOPTk`` and its all-reduce ``sALL_REDUCEk`` are named by: the group's last."""
    return group if update is WeightUpdate.ASYNC_STASH else (group + 1) * m - 1


def step_points(actions: Sequence[ProgramAction], update: WeightUpdate, m: int) -> dict[int, list[tuple[int, int]]]:
    """Position in a device's lowered list -> (stage, step group) whose gradients are complete after it: the stage's
    last W or B of the group, or the SEND_B right after it (a step must not hold back the gradient the previous
    stage waits for). Where schedules without a flush step, in the simulator and in the executor."""
    last: dict[tuple[int, int], int] = {}
    for at, a in enumerate(actions):
        if a is not None and (a.kind is K.W or a.kind is K.B):
            last[a.stage, step_group(update, m, a.microbatch)] = at
    points: dict[int, list[tuple[int, int]]] = {}
    for (stage, group), at in sorted(last.items(), key=lambda item: item[1]):
        a = actions[at]
        if at + 1 < len(actions) and actions[at + 1] == Action(a.stage, K.SEND_B, a.microbatch):
            at += 1
        points.setdefault(at, []).append((stage, group))
    return points


def defers_steps(update: WeightUpdate, data_parallel: int) -> bool:
    """2BW with replicas steps late, hiding its all-reduce behind the next iteration (``add_optimizer_steps``)."""
    return update is WeightUpdate.TWO_BW and data_parallel > 1


def gradient_buffers(deferred: bool) -> int:
    """Gradient buffers per stage that the memory ledger counts: 2 where steps are deferred (``defers_steps``: the
    gradients still to apply and the next iteration's), else 1."""
    return 2 if deferred else 1


def add_optimizer_steps(program: Schedule, deferred: bool = False, grad_bytes: Sequence[int] = ()) -> Schedule:
    """``program`` with each stage's optimizer steps (``sOPTk``, see ``step_microbatch``) where the real executor
    runs them (docs/schedules.md "The optimizer step").

    A flush schedule steps after the device's last op: first, where the stages form several pipelines (DualPipe's
    two copies of the model), each model stage's gradients all-reduced between the devices that hold a copy of it
    (``grad_bytes[s]`` of schedule stage ``s``; ``copy_syncs``), then clipping's norm all-reduce (``NORM_BYTES``
    over the pipeline's devices, a ``Collective``), then its stages in order, as a training loop calls ``step()``
    after the backward. 2BW steps each stage after its last backward of each iteration, PipeDream after every backward
    (``step_points``); they clip each stage's own norm, so there is no collective.

    ``deferred`` (2BW with data parallelism): each step goes instead just before the stage's first forward of
    iteration k + ``LAG_WITHOUT_FLUSH``, the first that needs its update (or at the device's end), as
    PipeDream-2BW's runtime runs it: the gradient all-reduce then overlaps the next iteration, at the price of a
    second gradient buffer (the ledger's ``gradient_buffers``). The executor keeps one buffer and steps at once.
    """
    m, update = program.num_microbatches, program.weight_update
    lists = [[a for a in acts if a is not None] for acts in program.device_actions]
    if update is WeightUpdate.FLUSH:
        group = tuple(range(program.num_devices))
        for k in range(program.iterations):
            last = step_microbatch(update, m, k)
            norm = [Collective(-1, K.ALL_REDUCE, last, group, NORM_BYTES)] if len(group) > 1 else []
            copies = copy_syncs(program, last, grad_bytes)
            for device, acts in enumerate(lists):
                stages = [s for s, d in enumerate(program.stage_to_device) if d == device]
                acts += copies[device] + norm + [Action(s, K.OPT, last) for s in stages]
        return dataclasses.replace(program, device_actions=tuple(tuple(acts) for acts in lists))
    out = []
    for acts in lists:
        after, before = step_points(acts, update, m), {}
        if deferred:
            after, before = _deferred(acts, after, m)

        def steps(points: dict[int, list[tuple[int, int]]], at: int) -> list[Action]:
            return [Action(s, K.OPT, step_microbatch(update, m, g)) for s, g in points.get(at, ())]

        out.append([b for at, a in enumerate(acts) for b in [*steps(before, at), a, *steps(after, at)]])
    return dataclasses.replace(program, device_actions=tuple(tuple(acts) for acts in out))


def copy_syncs(program: Schedule, microbatch: int, grad_bytes: Sequence[int]) -> list[list[Collective]]:
    """Per device, the all-reduces that sum the copies of each model stage it holds (``Schedule.pipelines`` > 1),
    in model-stage order on every device so that each pair meets; none with one pipeline."""
    out: list[list[Collective]] = [[] for _ in range(program.num_devices)]
    if program.pipelines == 1:
        return out
    holders: dict[int, list[int]] = {}
    for s in range(program.num_stages):
        holders.setdefault(program.model_stage(s), []).append(s)
    for model_stage, stages in sorted(holders.items()):
        group = tuple(sorted({program.stage_to_device[s] for s in stages}))
        if len(group) > 1:
            nbytes = grad_bytes[stages[0]] if grad_bytes else 0
            for d in group:
                out[d].append(Collective(model_stage, K.ALL_REDUCE, microbatch, group, nbytes))
    return out


def _deferred(actions: list, points: dict[int, list[tuple[int, int]]], m: int
              ) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[tuple[int, int]]]]:
    """``points`` (steps after a position) moved to just before the stage's first forward of iteration
    group + LAG_WITHOUT_FLUSH: (steps after a position, steps before a position); a step with no such forward
    goes after the last action."""
    firsts: dict[tuple[int, int], int] = {}
    for at, a in enumerate(actions):
        if a.kind is K.F:
            firsts.setdefault((a.stage, a.microbatch // m), at)
    after: dict[int, list[tuple[int, int]]] = {}
    before: dict[int, list[tuple[int, int]]] = {}
    for at in sorted(points):
        for stage, group in points[at]:
            target = firsts.get((stage, group + LAG_WITHOUT_FLUSH))
            if target is None:
                after.setdefault(len(actions) - 1, []).append((stage, group))
            else:
                before.setdefault(target, []).append((stage, group))
    return after, before
