"""Schedule IR: actions, schedules and their dependencies.

Standard library only, so the real executor in ``executor/`` can import it on a
GPU machine that has torch but none of the simulator's dependencies.

Stage numbering is torch's: with ``v`` chunks per device there are ``p * v`` stages,
and ``stage_to_device`` says where each one lives (looped: stage ``s`` on device
``s % p``; V-shape: stages ``0..p-1`` on ``0..p-1``, then ``p..2p-1`` on ``p-1..0``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import NamedTuple

from pipescope.simulator.readers.units import short_repr


class ActionKind(StrEnum):
    """What an action does, spelled with torch's letters so ``2F0`` and torch's CSV round-trip.

    F forward, I input-grad, W weight-grad, B fused backward (I + W); SEND_*/RECV_* the p2p transfers lowering adds;
    torch's per-stage UNSHARD/RESHARD/REDUCE_GRAD (kept, no work here); collectives over a group of devices; OPT a
    stage's optimizer step, once per iteration, or per backward under PipeDream (``lowering.add_optimizer_steps``;
    ``3OPT7`` is stage 3's step after the iteration whose last microbatch is 7, or under PipeDream after 7's backward);
    S and T a device's passes over its vocabulary shard of the output layer (vocabulary parallelism,
    ``simulator.vocab``; torch's CSV has no letters for them).
    """

    F = "F"
    I = "I"  # noqa: E741 (torch's letter)
    W = "W"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    ALL_REDUCE = "ALL_REDUCE"
    ALL_GATHER = "ALL_GATHER"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    BROADCAST = "BROADCAST"
    OPT = "OPT"
    S = "S"
    T = "T"


class Role(IntEnum):
    """How the engine treats an action kind. An int so numpy columns can hold it and the replay loops compare it
    cheaply; the roles data flows through (compute, send, recv) come before the others."""

    COMPUTE = 0  # takes time on the device's compute stream
    SEND = 1  # starts a transfer to the peer stage's device
    RECV = 2  # posts the matching receive; the consuming op waits for the arrival
    STAGE = 3  # torch's per-stage bookkeeping: kept in place, no work
    COLLECTIVE = 4  # every member joins; each resumes when the network says it ended


class KindFacts(NamedTuple):
    """What pipescope knows of one action kind besides its letters: one row of ``KINDS``."""

    role: Role
    name: str  # what a Chrome trace's category and a report call it
    label: str = ""  # a figure's legend; transfers by what they carry ("" where a figure draws it by its lane)
    colour: str = ""  # its colour in every figure (an op's bar, a transfer's lane)
    odd_colour: str = ""  # an odd chunk's op: darker, readable at any size


K = ActionKind
# One row per kind, in the order figures list them (docs/architecture.md, "Action kinds"). The optimizer step is
# pink: brown sat beside the odd chunk's dark orange backward and read as the same colour. Transfers are coloured by
# what they carry: activations go down the pipeline, gradients come back up.
KINDS: dict[ActionKind, KindFacts] = {
    K.F: KindFacts(Role.COMPUTE, "forward", "forward", "#4C72B0", "#27406B"),
    K.B: KindFacts(Role.COMPUTE, "backward", "backward (I+W)", "#DD8452", "#9A5424"),
    K.I: KindFacts(Role.COMPUTE, "input-grad", "input-grad", "#C44E52", "#7E2A2D"),
    K.W: KindFacts(Role.COMPUTE, "weight-grad", "weight-grad", "#55A868", "#2F6B3D"),
    K.OPT: KindFacts(Role.COMPUTE, "optimizer step", "optimizer step", "#E377C2", "#9C3D86"),
    K.S: KindFacts(Role.COMPUTE, "vocabulary S", "vocabulary S pass", "#CCB974", "#8A7B3E"),
    K.T: KindFacts(Role.COMPUTE, "vocabulary T", "vocabulary T pass", "#64B5CD", "#2E7A90"),
    K.SEND_F: KindFacts(Role.SEND, "send activation", "activation transfer", "#8DB0D9"),
    K.RECV_F: KindFacts(Role.RECV, "receive activation", "activation transfer", "#8DB0D9"),
    K.SEND_B: KindFacts(Role.SEND, "send gradient", "gradient transfer", "#E8A3A5"),
    K.RECV_B: KindFacts(Role.RECV, "receive gradient", "gradient transfer", "#E8A3A5"),
    K.UNSHARD: KindFacts(Role.STAGE, "UNSHARD"),  # torch's per-stage bookkeeping, named as torch names it
    K.RESHARD: KindFacts(Role.STAGE, "RESHARD"),
    K.REDUCE_GRAD: KindFacts(Role.STAGE, "REDUCE_GRAD"),
    K.ALL_REDUCE: KindFacts(Role.COLLECTIVE, "all-reduce"),
    K.ALL_GATHER: KindFacts(Role.COLLECTIVE, "all-gather"),
    K.REDUCE_SCATTER: KindFacts(Role.COLLECTIVE, "reduce-scatter"),
    K.BROADCAST: KindFacts(Role.COLLECTIVE, "broadcast"),
}
ROLE: dict[ActionKind, Role] = {kind: facts.role for kind, facts in KINDS.items()}
# The per-microbatch ops schedules are made of. OPT takes compute time too, but no schedule or CSV holds it: the
# simulator adds it to the program it runs.
COMPUTE_KINDS = frozenset(k for k, r in ROLE.items() if r is Role.COMPUTE) - {ActionKind.OPT}
COMM_KINDS = frozenset(k for k, r in ROLE.items() if r in (Role.SEND, Role.RECV))
STAGE_KINDS = frozenset(k for k, r in ROLE.items() if r is Role.STAGE)
COLLECTIVE_KINDS = frozenset(k for k, r in ROLE.items() if r is Role.COLLECTIVE)
# Vocabulary-parallel passes (docs/schedules.md section 7): compute ops of the simulator's own, not torch's, so the
# text and CSV forms of torch's letters neither parse nor write them.
VOCAB_KINDS = frozenset({ActionKind.S, ActionKind.T})

_POINT_KINDS = "|".join(k.value for k in sorted((COMPUTE_KINDS - VOCAB_KINDS) | COMM_KINDS, key=len, reverse=True))
_ACTION_RE = re.compile(rf"^([0-9]+)({_POINT_KINDS})([0-9]+)$")
_STAGE_ACTION_RE = re.compile(rf"^([0-9]+)({'|'.join(k.value for k in STAGE_KINDS)})$")
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")


class Action(NamedTuple):
    """One op of one stage on one microbatch, e.g. ``2F0`` (stage 2, forward, microbatch 0).

    A NamedTuple because schedules hold hundreds of thousands of them as dict keys: tuple hashing is done in C
    (``ActionKind`` is a ``str`` enum, so it hashes as its letters).
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        if self.kind in STAGE_KINDS:
            return f"{self.stage}{self.kind}"
        return f"{self.stage}{self.kind}{self.microbatch}"


class Collective(NamedTuple):
    """A collective over a group of devices, e.g. a stage's gradient all-reduce between replicas.

    The same value sits in the list of every device of ``group``; the engine starts it when the last member reaches
    it and each member resumes when the network says it ended. ``stage``/``microbatch`` say what it belongs to
    (-1 when nothing); ``bucket`` numbers the gradient buckets of one stage and iteration.
    """

    stage: int
    kind: ActionKind
    microbatch: int
    group: tuple[int, ...]
    nbytes: int
    bucket: int = 0

    def __str__(self) -> str:
        members = "+".join(map(str, self.group)) if len(self.group) <= 8 else f"{self.group[0]}+...({len(self.group)})"
        bucket = f".b{self.bucket}" if self.bucket else ""
        return f"{self.stage}{self.kind}{self.microbatch}{bucket}[{members}:{self.nbytes}B]"


ProgramAction = Action | Collective


MAX_LISTED_PROBLEMS = 12  # findings a report lists before "... and N more" (a hostile file can hold millions)


def capped(lines: Iterable[str], limit: int = MAX_LISTED_PROBLEMS, unit: str = "") -> list[str]:
    """All of ``lines`` if there are at most ``limit + 1``, else the first ``limit`` and ``... and N more`` (with
    ``unit`` after it: " lines" where some lines are notes, not findings, so N is not a count of problems).

    The rest is counted, not kept, so a generator of millions of findings costs no memory; and capping a capped
    list changes nothing (``ScheduleError`` caps what ``check.structure_problems`` already capped).
    """
    rest = iter(lines)
    shown = list(itertools.islice(rest, limit + 1))
    if len(shown) <= limit:
        return shown
    more = 1 + sum(1 for _ in rest)  # the extra line islice took, and the others
    return shown[:limit] + ([shown[limit]] if more == 1 else [f"... and {more} more{unit}"])


class ScheduleError(ValueError):
    """A malformed or deadlocking schedule; ``problems`` holds one line per finding, at most
    ``MAX_LISTED_PROBLEMS`` and a last ``... and N more`` (``capped``): the CLI prints them all."""

    def __init__(self, problems: list[str]):
        self.problems = capped(problems)
        super().__init__("; ".join(self.problems))


MAX_ACTION_INDEX = 10**9 - 1  # the largest stage or microbatch index parse_action takes (no pipeline is that big)


def _action_index(text: str, what: str, digits: str) -> int:
    """A stage or microbatch index of an action's text, ValueError beyond ``MAX_ACTION_INDEX`` (checked on the digits,
    before ``int``: a 10,000-digit number is refused, not converted)."""
    if len(digits) <= 9:  # fast path: at most 999,999,999
        return int(digits)
    digits = digits.lstrip("0") or "0"  # 5,000 leading zeros are still a small number, and int() refuses them
    if len(digits) > len(str(MAX_ACTION_INDEX)) or int(digits) > MAX_ACTION_INDEX:
        shown = digits if len(digits) <= 20 else f"{digits[:12]}... ({len(digits)} digits)"
        raise ValueError(f"action {short_repr(text, 40)} has {what} {shown}, expected at most {MAX_ACTION_INDEX}")
    return int(digits)


def parse_action(text: str) -> Action:
    """Parse torch's text form (``2F0``, ``0I3``, ``3SEND_F1``, ``0UNSHARD``; microbatch -1 for the last).

    ValueError (one line, the text cut short) when it is not an action or an index is over ``MAX_ACTION_INDEX``.
    """
    match = _ACTION_RE.match(text.strip())
    if match is not None:
        stage, kind, microbatch = match.groups()
        return Action(_action_index(text, "stage", stage), ActionKind(kind),
                      _action_index(text, "microbatch", microbatch))
    match = _STAGE_ACTION_RE.match(text.strip())
    if match is not None:
        return Action(_action_index(text, "stage", match.group(1)), ActionKind(match.group(2)), -1)
    raise ValueError(f"action {short_repr(text, 40)} is not of the form <stage><F|I|W|B|SEND_F|RECV_F|SEND_B|RECV_B>"
                     f"<microbatch> or <stage><UNSHARD|RESHARD|REDUCE_GRAD>")


def parse_cell(text: str) -> list[Action]:
    """One CSV cell: empty, one action, or torch's ``(0F5;1B3)OVERLAP_F_B`` expanded to its actions in order."""
    text = text.strip()
    if not text:
        return []
    overlap = _OVERLAP_RE.match(text)
    if overlap is not None:
        return [parse_action(part) for part in overlap.group(1).split(";") if part.strip()]
    return [parse_action(text)]


class WeightUpdate(StrEnum):
    """When weights change: one synchronous step per iteration, PipeDream's per-stage stashed updates, or 2BW's."""

    FLUSH = "flush"
    ASYNC_STASH = "async-stash"
    TWO_BW = "2bw"


@dataclass(frozen=True)
class Schedule:
    """Per-device ordered action lists plus the stage-to-device map.

    Attributes:
        name: generator name, e.g. ``1f1b``.
        num_devices: pipeline devices ``p``.
        num_microbatches: microbatches per optimizer step ``m``.
        stage_to_device: ``stage_to_device[s]`` is the device holding stage ``s``.
        device_actions: per device, its actions in order; ``None`` is an idle step (CSV). Compute-only as generators
            build it; lowering adds SEND/RECV (and collectives) to make the program the engine runs.
        weight_update: see ``WeightUpdate``.
        iterations: how many optimizer steps the lists span (microbatches are numbered
            ``0 .. iterations*m - 1``; iteration of microbatch k is ``k // m``).
        recompute: forward activations are recomputed before each backward.
        weight_versions: per device, how many weight versions it must hold.
        overlapped: (forward, backward) pairs that run as one F&B, consecutive on their device (DualPipeV's; torch
            writes each as one ``(F;B)OVERLAP_F_B`` cell). The simulator runs a pair as its forward then its
            backward; the pairs say how the order is written.
        pipelines: how many pipelines the stages form, each a copy of the whole model over
            ``num_stages // pipelines`` consecutive stages (``pipeline_stages``): 1, or 2 for the bidirectional
            schedules (DualPipe: stages ``0..p-1`` fed from the first device, ``p..2p-1`` from the last). A
            microbatch runs through one pipeline; stage ``s`` is the model's stage ``s % pipeline_stages``.
    """

    name: str
    num_devices: int
    num_microbatches: int
    stage_to_device: tuple[int, ...]
    device_actions: tuple[tuple[ProgramAction | None, ...], ...]
    weight_update: WeightUpdate = WeightUpdate.FLUSH
    iterations: int = 1
    recompute: bool = False
    weight_versions: tuple[int, ...] = field(default=())
    overlapped: frozenset[tuple[Action, Action]] = field(default=frozenset())
    pipelines: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_device)

    @property
    def pipeline_stages(self) -> int:
        """Stages of one pipeline: the model's stages."""
        return self.num_stages // self.pipelines

    def model_stage(self, stage: int) -> int:
        """The model's stage that schedule stage ``stage`` runs (its place in its pipeline)."""
        return stage % self.pipeline_stages

    def pipeline_of(self, microbatch: int) -> int:
        """The pipeline a microbatch runs through: each iteration's first ``m / pipelines`` the first, and so on."""
        return microbatch % self.num_microbatches * self.pipelines // self.num_microbatches

    def microbatches_of(self, pipeline: int) -> range:
        """Each iteration's microbatches (of ``0..m-1``) that run through ``pipeline`` (``pipeline_of``)."""
        m, n = self.num_microbatches, self.pipelines
        return range(-(-pipeline * m // n), -(-(pipeline + 1) * m // n))

    def runs(self, stage: int, microbatch: int) -> bool:
        """Whether ``stage`` runs ``microbatch`` (every stage does, but where the stages form several pipelines)."""
        return self.pipelines == 1 or self.pipeline_of(microbatch) == stage // self.pipeline_stages

    @property
    def chunks(self) -> int:
        """Stages (model chunks) per device, ``v``."""
        return max(1, self.num_stages // max(1, self.num_devices))

    @property
    def total_microbatches(self) -> int:
        return self.num_microbatches * self.iterations

    @property
    def splits_backward(self) -> bool:
        """True when backward runs as separate I and W ops."""
        return any(a is not None and a.kind is ActionKind.I for acts in self.device_actions for a in acts)

    def versions(self, device: int) -> int:
        return self.weight_versions[device] if self.weight_versions else 1

    @property
    def is_lowered(self) -> bool:
        """True when the lists hold SEND/RECV actions (lowered, or a torch "compute_comms" CSV)."""
        return any(a is not None and a.kind in COMM_KINDS for acts in self.device_actions for a in acts)

    def compute_actions(self, device: int) -> list[Action]:
        return [a for a in self.device_actions[device] if a is not None and a.kind in COMPUTE_KINDS]

    def num_compute_ops(self) -> int:
        return sum(len(self.compute_actions(d)) for d in range(self.num_devices))


def looped_placement(num_devices: int, chunks: int) -> tuple[int, ...]:
    """Stage ``s`` on device ``s % p`` (GPipe, 1F1B, interleaved 1F1B)."""
    return tuple(s % num_devices for s in range(num_devices * chunks))


def v_placement(num_devices: int) -> tuple[int, ...]:
    """V shape: stages ``0..p-1`` on devices ``0..p-1``, then ``p..2p-1`` on ``p-1..0``."""
    return tuple(range(num_devices)) + tuple(reversed(range(num_devices)))


def producers(action: Action, num_stages: int, present: Container[Action],
              pipeline_stages: int | None = None) -> list[Action]:
    """The compute ops whose results ``action`` needs (docs/schedules.md section 0): the one dependency rule.

    F(s) needs F(s-1); I/B(s) needs its own F(s) and the backward of stage s+1 (its I if the schedule has one,
    else its B); W(s) needs I(s). A pipeline's first stage has no F before it and its last no backward after it
    (``pipeline_stages``: a pipeline's length, ``Schedule.pipelines``; None: one pipeline of ``num_stages``).
    Lowering turns a producer on another device into the RECV of its transfer (``simulator.lowering.program_inputs``).
    """
    s, mb, kind = action.stage, action.microbatch, action.kind
    length = pipeline_stages or num_stages
    if kind is ActionKind.F:
        return [Action(s - 1, ActionKind.F, mb)] if s % length else []
    if kind is ActionKind.W:
        return [Action(s, ActionKind.I, mb)]
    if kind is ActionKind.I or kind is ActionKind.B:
        deps = [Action(s, ActionKind.F, mb)]
        if s + 1 < num_stages and (s + 1) % length:
            split = Action(s + 1, ActionKind.I, mb)
            deps.append(split if split in present else Action(s + 1, ActionKind.B, mb))
        return deps
    return []
