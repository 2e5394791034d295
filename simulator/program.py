"""A lowered schedule compiled into the flat arrays the engine and the test oracle walk.

Every non-idle action of every device is an entry. Compute entries carry their duration and the signals they wait
for; SEND entries start a transfer (a flow), RECV entries name the flow their consumer waits for, collective entries
join a flow shared by their group. Signals ``0..n-1`` are entry completions, ``n + f`` the end of flow ``f``. What an
action waits for comes from ``simulator.lowering.program_inputs``, the one dependency rule.

Only compute ops and collectives take stream time, so a device's stream walks just those (``device_steps``): the
SENDs after one are launched when it ends (``launches``), and RECVs and torch's per-stage actions need no visit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from pipescope.simulator.costs import StageCost
from pipescope.simulator.ir import (
    COMPUTE_KINDS,
    ROLE,
    Action,
    ActionKind,
    Collective,
    ProgramAction,
    Role,
    Schedule,
    ScheduleError,
)
from pipescope.simulator.lowering import program_inputs

K = ActionKind


KINDS = tuple(ActionKind)
KIND_CODE = {kind: code for code, kind in enumerate(KINDS)}
ROLES = tuple(Role)
ROLE_CODE = np.array([ROLE[kind] for kind in KINDS], dtype=np.int8)  # kind code -> Role
# The compute kind that produces a SEND's data and the one that consumes a RECV's (I or B for the backward).
SENT_BY = {K.SEND_F: (K.F,), K.SEND_B: (K.I, K.B)}
RECEIVED_FROM = {K.RECV_F: (-1, K.SEND_F), K.RECV_B: (1, K.SEND_B)}


@dataclass
class Program:
    """Flat arrays of one lowered schedule (entries device-major, in list order).

    Lists for the replay loops (indexing a list is what they do per event), numpy columns for everything vectorised.
    """

    actions: list[ProgramAction]
    device: list[int]
    role: list[Role]
    device_steps: list[list[int]]  # per device, its compute and collective entries in order
    launches: list[tuple[int, ...]]  # per entry: the flows its SENDs start when it ends
    duration: list[int]
    waits: list[list[int]]
    flow_of: list[int]  # per entry: its flow for SEND, RECV and collectives, else -1
    columns: Columns
    flow_src: list[int] = field(default_factory=list)  # transfers: sender; collectives: -1
    flow_dst: list[int] = field(default_factory=list)  # transfers: receiver; collectives: -1
    flow_bytes: list[int] = field(default_factory=list)
    flow_producer: list[int] = field(default_factory=list)  # transfers: the compute entry whose output it carries
    flow_collective: list[Collective | None] = field(default_factory=list)
    # Collectives that do not hold the stream (simulator.replicas' gradient all-reduces): per compute entry, the
    # (flow, ns after the entry's start) at which each of its device's members joins one.
    joins: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # Members that join from the run's start (ZeRO-3's first weight gather of a device: no op before it), one per
    # member: (flow, ns after the start: its shard's copy from the host under parameter offload, else 0)
    start_joins: list[tuple[int, int]] = field(default_factory=list)
    # Members that join when another flow ends (HSDP's all-reduce of a shard after its group's reduce-scatter): per
    # flow, the flows it makes one member join
    flow_joins: dict[int, list[int]] = field(default_factory=dict)
    # Collectives that start with fewer members than their group (replicas folded into one, simulator.fold): per
    # flow, the members that join it in this program
    joiners: dict[int, int] = field(default_factory=dict)
    # Ops run unit by unit (ZeRO-3's gathers, docs/parallelism.md, "Units"): per compute entry, its segments' ns (their
    # sum is its duration); before segment j > 0 it waits for ``segment_waits[i, j]``, and as segment j starts its
    # device's members join ``segment_joins[i, j]`` (flow, ns after that start), as ``joins`` do at the entry's start
    segments: dict[int, list[int]] = field(default_factory=dict)
    segment_waits: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    segment_joins: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def num_entries(self) -> int:
        return len(self.actions)

    @property
    def num_flows(self) -> int:
        return len(self.flow_src)


@dataclass(frozen=True)
class Columns:
    """Per entry, as numpy arrays: stage, kind code (into ``KINDS``), microbatch, device and role."""

    stage: np.ndarray
    kind: np.ndarray
    microbatch: np.ndarray
    device: np.ndarray
    role: np.ndarray

    @classmethod
    def of(cls, actions: list[ProgramAction], device: np.ndarray) -> Columns:
        """Read the columns off the actions (C-level loops: ``map`` over ``itemgetter``)."""
        n = len(actions)
        kind = np.fromiter(map(KIND_CODE.__getitem__, map(itemgetter(1), actions)), dtype=np.int64, count=n)
        stage = np.fromiter(map(itemgetter(0), actions), dtype=np.int64, count=n)
        microbatch = np.fromiter(map(itemgetter(2), actions), dtype=np.int64, count=n)
        if n and (abs(microbatch).max() > MAX_INDEX or abs(stage).max() > MAX_INDEX):
            raise ScheduleError([f"a stage or microbatch index beyond {MAX_INDEX}; expected a pipeline's sizes"])
        return cls(stage, kind, microbatch, device, ROLE_CODE[kind])


MAX_INDEX = 1 << 30  # keeps (stage, kind, microbatch) keys inside int64


def op_durations(stage_costs: Sequence[StageCost], recompute: bool) -> dict[tuple[int, ActionKind], int]:
    """ns of every (stage, compute kind): F, I, W from the stage's costs, B its fused time (else I + W), recompute
    before backwards, the stage's optimizer step, and the vocabulary S and T passes of the stage's device."""
    table = {}
    for stage, c in enumerate(stage_costs):
        extra = c.recompute_ns if recompute else 0
        table[stage, K.F] = c.forward_ns
        table[stage, K.I] = c.input_grad_ns + extra
        table[stage, K.W] = c.weight_grad_ns
        fused = c.backward_ns if c.backward_ns is not None else c.input_grad_ns + c.weight_grad_ns
        table[stage, K.B] = fused + extra
        table[stage, K.OPT] = c.optimizer_ns
        table[stage, K.S] = c.vocab_s_ns
        table[stage, K.T] = c.vocab_t_ns
    return table


def rescaled_parts(parts: list[int], total: int) -> list[int]:
    """``parts`` (ns, >= 0) scaled to add up to ``total``, each in proportion (the last takes what rounding leaves;
    all zero: the last takes all): an op run unit by unit whose whole time is set apart from its units'."""
    whole = sum(parts)
    if not whole:
        return [0] * (len(parts) - 1) + [total]
    head = [part * total // whole for part in parts[:-1]]
    return head + [total - sum(head)]


def unit_durations(num_stages: int) -> dict[tuple[int, ActionKind], int]:
    """Every compute op one time unit: the lockstep step count of ``simulator.check``."""
    return {(stage, kind): 1 for stage in range(num_stages) for kind in COMPUTE_KINDS}


def compile_program(program: Schedule, durations: Mapping[tuple[int, ActionKind], int],
                    stage_bytes: Sequence[int]) -> Program:
    """Resolve every entry's duration, inputs and flow once, before replaying (vectorised: one numpy pass per
    concern, so compiling costs little next to the replay).

    Args:
        program: a lowered schedule (``simulator.lowering.lower``).
        durations: ns per (stage, compute kind).
        stage_bytes: bytes a stage sends on (its output, or the gradient of its input).

    Raises:
        ScheduleError: an action twice, an input the program never produces, a RECV without its SEND, or a consumer
            placed before its RECV (it could never run).
    """
    lists = [[a for a in acts if a is not None] for acts in program.device_actions]
    actions = [a for acts in lists for a in acts]
    n = len(actions)
    device = np.repeat(np.arange(len(lists)), [len(acts) for acts in lists])
    cols = Columns.of(actions, device)
    out = Program(actions, device.tolist(), list(map(ROLES.__getitem__, cols.role.tolist())), [], [()] * n,
                  [0] * n, [[]] * n, [-1] * n, cols)
    keys = _index(cols)
    flow_of = _add_flows(out, program, keys, stage_bytes)
    _add_steps(out, lists, flow_of)
    _add_inputs(out, program, keys, flow_of, durations)
    return out


class ActionIndex:
    """Rows by (stage, kind code, microbatch), as one sorted int64 key array: "which row is this action" becomes a
    vectorised binary search instead of a dict lookup per row. The compile step and the memory ledger both use it.

    ``span`` must exceed every microbatch that will be looked up (pass the largest in the program, plus 2).
    """

    def __init__(self, stage: np.ndarray, kind: np.ndarray, microbatch: np.ndarray, rows: np.ndarray, span: int):
        self.span = span
        keys = self.key(stage, kind, microbatch)
        order = np.argsort(keys, kind="stable")
        self.sorted, self.rows = keys[order], rows[order]

    def key(self, stage: np.ndarray | int, kind: np.ndarray | int, microbatch: np.ndarray) -> np.ndarray:
        return (np.asarray(stage) * len(KINDS) + kind) * self.span + (microbatch + 1)

    def duplicate(self) -> int | None:
        """A row whose action is also another row's, or None."""
        twice = np.flatnonzero(self.sorted[1:] == self.sorted[:-1])
        return int(self.rows[twice[0]]) if len(twice) else None

    def find(self, stage: np.ndarray | int, kind: np.ndarray | int, microbatch: np.ndarray) -> np.ndarray:
        """The row of each (stage, kind, microbatch), or -1."""
        wanted = self.key(stage, kind, microbatch)
        if not len(self.sorted):
            return np.full(len(wanted), -1)
        at = np.minimum(np.searchsorted(self.sorted, wanted), len(self.sorted) - 1)
        return np.where(self.sorted[at] == wanted, self.rows[at], -1)

    def compute_op(self, stage: np.ndarray, microbatch: np.ndarray, backward: np.ndarray) -> np.ndarray:
        """Per row, the F of (stage, microbatch), or where ``backward`` its I, else its B: the op a SEND carries the
        output of, and the op a RECV feeds (``SENT_BY``). -1 where there is none."""
        found = np.where(backward, self.find(stage, KIND_CODE[K.I], microbatch),
                         self.find(stage, KIND_CODE[K.F], microbatch))
        return np.where(backward & (found < 0), self.find(stage, KIND_CODE[K.B], microbatch), found)


def _index(cols: Columns) -> ActionIndex:
    """The index of every data entry (compute, SEND, RECV); ScheduleError if an action appears twice."""
    data = np.flatnonzero(cols.role < Role.STAGE)
    index = ActionIndex(cols.stage[data], cols.kind[data], cols.microbatch[data], data,
                        int(cols.microbatch.max(initial=0)) + 2)
    twice = index.duplicate()
    if twice is not None:
        raise ScheduleError([f"{_action(cols, twice)} appears twice; run the checker for details"])
    return index


def _action(cols: Columns, i: int) -> Action:
    return Action(int(cols.stage[i]), KINDS[cols.kind[i]], int(cols.microbatch[i]))


def _add_flows(out: Program, program: Schedule, keys: ActionIndex, stage_bytes: Sequence[int]) -> np.ndarray:
    """One flow per SEND (its RECV shares it), then one per distinct collective. Returns the flow of each entry."""
    cols, home = out.columns, np.asarray(program.stage_to_device)
    flow_of = np.full(out.num_entries, -1)
    sends = np.flatnonzero(cols.role == Role.SEND)
    stage, mb, forward = cols.stage[sends], cols.microbatch[sends], cols.kind[sends] == KIND_CODE[K.SEND_F]
    producer = keys.compute_op(stage, mb, ~forward)
    peer = stage + np.where(forward, 1, -1)
    bad = (producer < 0) | (producer > sends) | (peer < 0) | (peer >= len(home))
    if bad.any():
        i = sends[np.argmax(bad)]
        producers = " or ".join(kind.value for kind in SENT_BY[out.actions[i].kind])  # SEND_B: an I or a B
        raise ScheduleError([f"device {out.device[i]}: {out.actions[i]} has no {producers} before it to send"])
    flow_of[sends] = np.arange(len(sends))
    out.flow_src, out.flow_dst = cols.device[sends].tolist(), home[peer].tolist()
    out.flow_bytes, out.flow_producer = np.asarray(stage_bytes, dtype=np.int64)[stage].tolist(), producer.tolist()
    out.flow_collective = [None] * len(sends)
    _add_collectives(out, flow_of)
    recvs = np.flatnonzero(cols.role == Role.RECV)
    backward = cols.kind[recvs] == KIND_CODE[K.RECV_B]
    send_kind = np.where(backward, KIND_CODE[K.SEND_B], KIND_CODE[K.SEND_F])
    sender = keys.find(cols.stage[recvs] + np.where(backward, 1, -1), send_kind, cols.microbatch[recvs])
    if (sender < 0).any():
        i = recvs[np.argmax(sender < 0)]
        s, kind, mb = out.actions[i]
        offset, send = RECEIVED_FROM[kind]
        missing = Action(s + offset, send, mb)
        raise ScheduleError([f"device {out.device[i]}: {out.actions[i]} has no matching {missing}"])
    flow_of[recvs] = flow_of[sender]
    out.flow_of = flow_of.tolist()
    return flow_of


def _add_collectives(out: Program, flow_of: np.ndarray) -> None:
    """One flow per distinct collective, shared by its members' entries."""
    known: dict[Collective, int] = {}
    for i in np.flatnonzero(out.columns.role == Role.COLLECTIVE).tolist():
        collective = out.actions[i]
        if collective not in known:
            known[collective] = len(out.flow_src)
            out.flow_src.append(-1)
            out.flow_dst.append(-1)
            out.flow_bytes.append(collective.nbytes)
            out.flow_producer.append(-1)
            out.flow_collective.append(collective)
        flow_of[i] = known[collective]


def _add_steps(out: Program, lists: list[list[ProgramAction]], flow_of: np.ndarray) -> None:
    """Per device, the entries that take stream time; each SEND launched by the nearest one before it."""
    cols = out.columns
    blocking = (cols.role == Role.COMPUTE) | (cols.role == Role.COLLECTIVE)
    steps, bounds = np.flatnonzero(blocking), np.cumsum([len(acts) for acts in lists])[:-1]
    out.device_steps = [part.tolist() for part in np.split(steps, np.searchsorted(steps, bounds))] if lists else []
    sends = np.flatnonzero(cols.role == Role.SEND)
    launcher = np.maximum.accumulate(np.where(blocking, np.arange(out.num_entries), -1))[sends]
    bad = (launcher < 0) | (cols.device[np.maximum(launcher, 0)] != cols.device[sends])
    if bad.any():
        i = sends[np.argmax(bad)]
        raise ScheduleError([f"device {out.device[i]}: {out.actions[i]} comes before anything it could send"])
    launches = out.launches
    for i, f in zip(launcher.tolist(), flow_of[sends].tolist()):
        launches[i] += (f,)


def _add_inputs(out: Program, program: Schedule, keys: ActionIndex, flow_of: np.ndarray,
                durations: Mapping[tuple[int, ActionKind], int]) -> None:
    """Duration and input signals of every compute entry.

    The inputs are ``program_inputs`` (the one dependency rule), which depends on the microbatch only through it and
    on which ops exist only through whether stage s+1 splits its backward: so it is resolved once per
    (stage, kind, split) and applied to all that group's microbatches at once.
    """
    cols = out.columns
    compute = np.flatnonzero(cols.role == Role.COMPUTE)
    stage, kind, mb = cols.stage[compute], cols.kind[compute], cols.microbatch[compute]
    table = np.zeros((max(program.num_stages, int(stage.max(initial=0)) + 1), len(KINDS)), dtype=np.int64)
    for (s, k), ns in durations.items():
        table[s, KIND_CODE[k]] = ns
    for i, ns in zip(compute.tolist(), table[stage, kind].tolist()):
        out.duration[i] = ns
    backward = (kind == KIND_CODE[K.I]) | (kind == KIND_CODE[K.B])
    split = backward & (keys.find(stage + 1, KIND_CODE[K.I], mb) >= 0)
    group = (stage * len(KINDS) + kind) * 2 + split
    order = np.argsort(group, kind="stable")  # each group's rows in entry order, without a pass per group
    codes, starts = np.unique(group[order], return_index=True)
    for code, rows in zip(codes.tolist(), np.split(order, starts[1:])):
        _group_inputs(out, program, keys, flow_of, compute[rows], mb[rows], code)


def _group_inputs(out: Program, program: Schedule, keys: ActionIndex, flow_of: np.ndarray, entries: np.ndarray,
                  mb: np.ndarray, code: int) -> None:
    """Input signals of the compute entries of one (stage, kind, split) group."""
    stage, kind, split = code // 2 // len(KINDS), KINDS[code // 2 % len(KINDS)], bool(code % 2)
    present = frozenset({Action(stage + 1, K.I, 0)} if split else ())
    signals = []
    for needed in program_inputs(Action(stage, kind, 0), program.stage_to_device, program.num_stages, present,
                                 program.pipeline_stages):
        j = keys.find(needed.stage, KIND_CODE[needed.kind], mb)
        through_recv = needed.kind in RECEIVED_FROM
        bad = (j < 0) | (through_recv & ((out.columns.device[j] != out.columns.device[entries]) | (j > entries)))
        if bad.any():
            at = int(np.argmax(bad))
            raise _input_error(out, int(entries[at]), (needed.stage, needed.kind, int(mb[at])), int(j[at]))
        signals.append((out.num_entries + flow_of[j] if through_recv else j).tolist())
    waits = list(map(list, zip(*signals))) if signals else [[] for _ in range(len(entries))]
    for i, w in zip(entries.tolist(), waits):
        out.waits[i] = w


def _input_error(out: Program, consumer: int, needed: tuple, j: int) -> ScheduleError:
    needed = Action(*needed)
    if j < 0:
        return ScheduleError([f"{out.actions[consumer]} needs {needed}, which the program never runs"])
    return ScheduleError([f"deadlock: device {out.device[consumer]}: {out.actions[consumer]} waits for {needed}, "
                          f"which device {out.device[j]} only posts after it"])
