"""Schedule IR: actions, schedules and their dependencies.

Standard library only, so the real executor in ``calibration/`` can import it on a
GPU machine that has torch but none of the simulator's dependencies.

Stage numbering is torch's: with ``v`` chunks per device there are ``p * v`` stages,
and ``stage_to_device`` says where each one lives (looped: stage ``s`` on device
``s % p``; V-shape: stages ``0..p-1`` on ``0..p-1``, then ``p..2p-1`` on ``p-1..0``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

COMPUTE_KINDS = ("F", "I", "W", "B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
STAGE_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")  # torch's per-stage actions, no microbatch

_ACTION_RE = re.compile(r"^([0-9]+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)([0-9]+)$")
_STAGE_ACTION_RE = re.compile(r"^([0-9]+)(UNSHARD|RESHARD|REDUCE_GRAD)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")


class Action(NamedTuple):
    """One op of one stage on one microbatch, e.g. ``2F0`` (stage 2, forward, microbatch 0).

    Kinds: F forward, I input-grad, W weight-grad, B fused backward (I + W), plus
    torch's communication kinds after lowering. A NamedTuple because schedules hold
    hundreds of thousands of them as dict keys: tuple hashing is done in C.
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        if self.kind in STAGE_KINDS:
            return f"{self.stage}{self.kind}"
        return f"{self.stage}{self.kind}{self.microbatch}"


def parse_action(text: str) -> Action:
    """Parse torch's text form (``2F0``, ``0I3``, ``3SEND_F1``, ``0UNSHARD``; microbatch -1 for the last)."""
    match = _ACTION_RE.match(text.strip())
    if match is not None:
        stage, kind, microbatch = match.groups()
        return Action(int(stage), kind, int(microbatch))
    match = _STAGE_ACTION_RE.match(text.strip())
    if match is not None:
        return Action(int(match.group(1)), match.group(2), -1)
    raise ValueError(f"action {text!r} is not of the form <stage><F|I|W|B|SEND_F|RECV_F|SEND_B|RECV_B><microbatch> "
                     f"or <stage><UNSHARD|RESHARD|REDUCE_GRAD>")


def parse_cell(text: str) -> list[Action]:
    """One CSV cell: empty, one action, or torch's ``(0F5;1B3)OVERLAP_F_B`` expanded to its actions in order."""
    text = text.strip()
    if not text:
        return []
    overlap = _OVERLAP_RE.match(text)
    if overlap is not None:
        return [parse_action(part) for part in overlap.group(1).split(";") if part.strip()]
    return [parse_action(text)]


@dataclass(frozen=True)
class Schedule:
    """Per-device ordered action lists plus the stage-to-device map.

    Attributes:
        name: generator name, e.g. ``1f1b``.
        num_devices: pipeline devices ``p``.
        num_microbatches: microbatches per optimizer step ``m``.
        stage_to_device: ``stage_to_device[s]`` is the device holding stage ``s``.
        device_actions: per device, its ops in order; ``None`` is an idle step (CSV).
        weight_update: ``flush`` (one synchronous step per iteration), ``async-stash``
            (PipeDream: per-stage updates, stashed weight versions) or ``2bw``.
        iterations: how many optimizer steps the lists span (microbatches are numbered
            ``0 .. iterations*m - 1``; iteration of microbatch k is ``k // m``).
        recompute: forward activations are recomputed before each backward.
        weight_versions: per device, how many weight versions it must hold.
    """

    name: str
    num_devices: int
    num_microbatches: int
    stage_to_device: tuple[int, ...]
    device_actions: tuple[tuple[Action | None, ...], ...]
    weight_update: str = "flush"
    iterations: int = 1
    recompute: bool = False
    weight_versions: tuple[int, ...] = field(default=())

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_device)

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
        return any(a is not None and a.kind == "I" for acts in self.device_actions for a in acts)

    def versions(self, device: int) -> int:
        return self.weight_versions[device] if self.weight_versions else 1

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


def producers(action: Action, num_stages: int, present: set[Action] | frozenset[Action]) -> list[Action]:
    """The ops whose results ``action`` needs (SCHEDULES.md section 0).

    F(s) needs F(s-1); I/B(s) needs its own F(s) and the backward of stage s+1
    (its I if the schedule has one, else its B); W(s) needs I(s).
    """
    s, mb = action.stage, action.microbatch
    if action.kind == "F":
        return [Action(s - 1, "F", mb)] if s > 0 else []
    if action.kind == "W":
        return [Action(s, "I", mb)]
    if action.kind in ("I", "B"):
        deps = [Action(s, "F", mb)]
        if s + 1 < num_stages:
            split = Action(s + 1, "I", mb)
            deps.append(split if split in present else Action(s + 1, "B", mb))
        return deps
    return []
