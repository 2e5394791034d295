"""The timeline: each action's device, stream, start and end. A replay and a measured run both produce one.

Rows are compute ops (stream ``compute``), transfers as seen by the sender (``send->D``: from the moment the bytes
start to move until they arrive) and by the receiver (``recv<-S``: the same span), and collectives (``collective``,
one row per member). ``SimResult`` is built from a timeline, so a real run's timeline gives a result of the same kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from pipescope.simulator.engine import RunTimes
from pipescope.simulator.ir import ROLE, ProgramAction, Role
from pipescope.simulator.program import Program, Step

COLUMNS = ("device", "stream", "action", "kind", "stage", "chunk", "microbatch", "start_ns", "end_ns", "bytes")


@dataclass(frozen=True)
class Timeline:
    """Columnar rows; ``peer`` is the other device of a transfer (-1 otherwise), ``nbytes`` what it moved."""

    actions: list[ProgramAction]
    device: np.ndarray
    start: np.ndarray
    end: np.ndarray
    peer: np.ndarray
    nbytes: np.ndarray
    num_devices: int

    def __len__(self) -> int:
        return len(self.actions)

    def roles(self) -> list[Role]:
        return [ROLE[a.kind] for a in self.actions]

    def mask(self, role: Role) -> np.ndarray:
        return np.fromiter((ROLE[a.kind] is role for a in self.actions), dtype=bool, count=len(self.actions))

    def stage(self) -> np.ndarray:
        return np.fromiter((a.stage for a in self.actions), dtype=np.int64, count=len(self.actions))

    def microbatch(self) -> np.ndarray:
        return np.fromiter((a.microbatch for a in self.actions), dtype=np.int64, count=len(self.actions))

    def to_frame(self) -> pd.DataFrame:
        """One row per action: device, stream, action, kind, stage, chunk, microbatch, start_ns, end_ns, bytes."""
        stage = self.stage()
        return pd.DataFrame({
            "device": self.device,
            "stream": [_stream(role, int(peer)) for role, peer in zip(self.roles(), self.peer)],
            "action": [str(a) for a in self.actions],
            "kind": [str(a.kind) for a in self.actions],
            "stage": stage,
            "chunk": stage // max(1, self.num_devices),
            "microbatch": self.microbatch(),
            "start_ns": self.start,
            "end_ns": self.end,
            "bytes": self.nbytes,
        }, columns=list(COLUMNS))


def _stream(role: Role, peer: int) -> str:
    if role is Role.SEND:
        return f"send->{peer}"
    if role is Role.RECV:
        return f"recv<-{peer}"
    return role.value


def replay_timeline(program: Program, times: RunTimes, num_devices: int) -> Timeline:
    """The timeline of a replay: compute entries with their own times; SEND, RECV and collectives with their flow's."""
    step = np.fromiter(program.step, dtype=np.int8, count=program.num_entries)
    keep = np.flatnonzero(step != Step.STAGE)
    step, flow = step[keep], np.asarray(program.flow_of, dtype=np.int64)[keep]

    def per_flow(values: list[int]) -> np.ndarray:  # a flow's value per row; the pad at -1 serves compute rows
        return np.append(np.asarray(values, dtype=np.int64), -1)[flow]

    compute = step == Step.COMPUTE
    start = np.where(compute, np.asarray(times.entry_start, dtype=np.int64)[keep], per_flow(times.flow_start))
    end = np.where(compute, np.asarray(times.entry_end, dtype=np.int64)[keep], per_flow(times.flow_end))
    peer = np.where(step == Step.SEND, per_flow(program.flow_dst),
                    np.where(step == Step.RECV, per_flow(program.flow_src), -1))
    nbytes = np.where(compute, 0, per_flow(program.flow_bytes))
    actions = program.actions
    return Timeline([actions[i] for i in keep.tolist()], np.asarray(program.device, dtype=np.int64)[keep], start,
                    end, peer, nbytes, num_devices)
