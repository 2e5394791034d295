"""A lowered schedule compiled into the flat arrays the engine and the test oracle walk.

Every non-idle action of every device is an entry. Compute entries carry their duration and the signals they wait
for; SEND entries start a transfer (a flow), RECV entries name the flow their consumer waits for, collective entries
join a flow shared by their group. Signals ``0..n-1`` are entry completions, ``n + f`` the end of flow ``f``. What an
action waits for comes from ``simulator.lowering.program_inputs``, the one dependency rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from pipescope.simulator.ir import ScheduleError
from pipescope.simulator.costs import StageCost
from pipescope.simulator.ir import COMPUTE_KINDS, ROLE, Action, ActionKind, Collective, ProgramAction, Role, Schedule
from pipescope.simulator.lowering import program_inputs

K = ActionKind


class Step(IntEnum):
    """What the engine does at an entry (``Role`` as a small int: the replay loop compares it per entry)."""

    COMPUTE = 0
    SEND = 1
    RECV = 2  # nothing to do: its consumer waits for the flow
    STAGE = 3  # torch's per-stage actions: nothing to do
    COLLECTIVE = 4


STEP = {Role.COMPUTE: Step.COMPUTE, Role.SEND: Step.SEND, Role.RECV: Step.RECV, Role.STAGE: Step.STAGE,
        Role.COLLECTIVE: Step.COLLECTIVE}
# The compute kind that produces a SEND's data and the one that consumes a RECV's (I or B for the backward).
SENT_BY = {K.SEND_F: (K.F,), K.SEND_B: (K.I, K.B)}
RECEIVED_FROM = {K.RECV_F: (-1, K.SEND_F), K.RECV_B: (1, K.SEND_B)}


@dataclass
class Program:
    """Flat arrays of one lowered schedule (entries device-major, in list order)."""

    actions: list[ProgramAction]
    device: list[int]
    step: list[Step]
    device_entries: list[list[int]]
    duration: list[int]
    waits: list[list[int]]
    flow_of: list[int]  # per entry: its flow for SEND, RECV and collectives, else -1
    flow_src: list[int] = field(default_factory=list)  # transfers: sender; collectives: -1
    flow_dst: list[int] = field(default_factory=list)  # transfers: receiver; collectives: -1
    flow_bytes: list[int] = field(default_factory=list)
    flow_producer: list[int] = field(default_factory=list)  # transfers: the compute entry whose output it carries
    flow_collective: list[Collective | None] = field(default_factory=list)

    @property
    def num_entries(self) -> int:
        return len(self.actions)

    @property
    def num_flows(self) -> int:
        return len(self.flow_src)


def op_durations(stage_costs: Sequence[StageCost], recompute: bool) -> dict[tuple[int, ActionKind], int]:
    """ns of every (stage, compute kind): F, I, W from the stage's costs, B = I + W, recompute before backwards."""
    table = {}
    for stage, c in enumerate(stage_costs):
        extra = c.recompute_ns if recompute else 0
        table[stage, K.F] = c.forward_ns
        table[stage, K.I] = c.input_grad_ns + extra
        table[stage, K.W] = c.weight_grad_ns
        table[stage, K.B] = c.input_grad_ns + c.weight_grad_ns + extra
    return table


def unit_durations(num_stages: int) -> dict[tuple[int, ActionKind], int]:
    """Every compute op one time unit: the lockstep step count of ``simulator.check``."""
    return {(stage, kind): 1 for stage in range(num_stages) for kind in COMPUTE_KINDS}


def compile_program(program: Schedule, durations: Mapping[tuple[int, ActionKind], int],
                    stage_bytes: Sequence[int]) -> Program:
    """Resolve every entry's duration, inputs and flow once, before replaying.

    Args:
        program: a lowered schedule (``simulator.lowering.lower``).
        durations: ns per (stage, compute kind).
        stage_bytes: bytes a stage sends on (its output, or the gradient of its input).

    Raises:
        ScheduleError: an action twice, an input the program never produces, a RECV without its SEND, or a consumer
            placed before its RECV (it could never run).
    """
    lists = [[a for a in acts if a is not None] for acts in program.device_actions]
    out = Program([a for acts in lists for a in acts], [d for d, acts in enumerate(lists) for _ in acts], [], [], [],
                  [], [])
    first = 0
    for acts in lists:
        out.device_entries.append(list(range(first, first + len(acts))))
        first += len(acts)
    index = _index(out.actions)
    _add_flows(out, program, index, stage_bytes)
    compute = frozenset(a for a in index if a.kind in COMPUTE_KINDS)
    home, num_stages = program.stage_to_device, program.num_stages
    out.step.extend(STEP[ROLE[a.kind]] for a in out.actions)
    for i, action in enumerate(out.actions):
        if out.step[i] is not Step.COMPUTE:
            out.duration.append(0)
            out.waits.append([])
            continue
        out.duration.append(durations[action.stage, action.kind])
        out.waits.append([_signal(out, index, i, needed)
                          for needed in program_inputs(action, home, num_stages, compute)])
    return out


def _index(actions: list[ProgramAction]) -> dict[Action, int]:
    index: dict[Action, int] = {}
    for i, action in enumerate(actions):
        if ROLE[action.kind] in (Role.STAGE, Role.COLLECTIVE):
            continue  # no data flows through them; torch may repeat UNSHARD/RESHARD for a stage
        if action in index:
            raise ScheduleError([f"{action} appears twice; run the checker for details"])
        index[action] = i
    return index


def _signal(out: Program, index: dict[Action, int], consumer: int, needed: Action) -> int:
    """The signal entry ``consumer`` waits on for ``needed`` (a compute op, or a RECV's flow)."""
    j = index.get(needed)
    if j is None:
        raise ScheduleError([f"{out.actions[consumer]} needs {needed}, which the program never runs"])
    if out.step[j] is Step.COMPUTE:
        return j  # on this device; if it comes later there, the engine reports the deadlock
    if out.device[j] != out.device[consumer] or j > consumer:
        raise ScheduleError([f"deadlock: device {out.device[consumer]}: {out.actions[consumer]} waits for {needed}, "
                             f"which device {out.device[j]} only posts after it"])
    return out.num_entries + out.flow_of[j]


def _add_flows(out: Program, program: Schedule, index: dict[Action, int], stage_bytes: Sequence[int]) -> None:
    """One flow per SEND (its RECV shares it) and one per distinct collective."""
    out.flow_of.extend([-1] * out.num_entries)
    home = program.stage_to_device
    collectives: dict[Collective, int] = {}
    for i, action in enumerate(out.actions):
        kind = action.kind
        if kind in SENT_BY:
            peer = action.stage + (1 if kind is K.SEND_F else -1)
            producer = next((index[p] for p in (Action(action.stage, k, action.microbatch) for k in SENT_BY[kind])
                             if p in index), None)
            if producer is None or not 0 <= peer < len(home) or producer > i:
                raise ScheduleError([f"device {out.device[i]}: {action} has no {SENT_BY[kind][0]} before it to send"])
            out.flow_of[i] = _new_flow(out, out.device[i], home[peer], stage_bytes[action.stage], producer, None)
        elif type(action) is Collective:
            if action not in collectives:
                collectives[action] = _new_flow(out, -1, -1, action.nbytes, -1, action)
            out.flow_of[i] = collectives[action]
    for i, action in enumerate(out.actions):
        if action.kind in RECEIVED_FROM:
            offset, send_kind = RECEIVED_FROM[action.kind]
            send = index.get(Action(action.stage + offset, send_kind, action.microbatch))
            if send is None:
                raise ScheduleError([f"device {out.device[i]}: {action} has no matching "
                                     f"{Action(action.stage + offset, send_kind, action.microbatch)}"])
            out.flow_of[i] = out.flow_of[send]


def _new_flow(out: Program, src: int, dst: int, nbytes: int, producer: int, collective: Collective | None) -> int:
    out.flow_src.append(src)
    out.flow_dst.append(dst)
    out.flow_bytes.append(nbytes)
    out.flow_producer.append(producer)
    out.flow_collective.append(collective)
    return len(out.flow_src) - 1
