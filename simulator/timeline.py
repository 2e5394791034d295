"""The timeline: each action's device, stream, start and end. A replay and a measured run both produce one.

Rows are compute ops (stream ``compute``), transfers as seen by the sender (``send->D``: from the moment the bytes
start to move until they arrive) and by the receiver (``recv<-S``: the same span), and collectives (``collective``,
one row per member). ``SimResult`` is built from a timeline, so a real run's timeline gives a result of the same kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from pipescope.simulator.costs import CostError
from pipescope.simulator.engine import RunTimes
from pipescope.simulator.ir import ActionKind, ProgramAction, Role
from pipescope.simulator.program import KIND_CODE, KINDS, ROLE_CODE, ROLES, Columns, Program

COLUMNS = ("device", "stream", "action", "kind", "stage", "chunk", "microbatch", "start_ns", "end_ns", "bytes")


@dataclass(frozen=True)
class Timeline:
    """Columnar rows; ``peer`` is the other device of a transfer (-1 otherwise), ``nbytes`` what it moved.

    ``kind`` holds codes into ``KINDS``; ``stage`` and ``microbatch`` are the actions' own, as arrays.
    """

    actions: list[ProgramAction]
    device: np.ndarray
    start: np.ndarray
    end: np.ndarray
    peer: np.ndarray
    nbytes: np.ndarray
    num_devices: int
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    pipeline_devices: int = 0  # devices of one pipeline replica (0: all of them), for the chunk of a stage
    # (device, from, to) of each wait inside an op run unit by unit (``RunTimes.stalls``): in its row's span, not work
    stalls: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))

    @classmethod
    def of(cls, actions: list[ProgramAction], device: np.ndarray, start: np.ndarray, end: np.ndarray,
           peer: np.ndarray, nbytes: np.ndarray, num_devices: int, columns: Columns | None = None) -> Timeline:
        """A timeline of these rows; the per-action columns are read off the actions unless given."""
        cols = columns if columns is not None else Columns.of(actions, device)
        return cls(actions, device, start, end, peer, nbytes, num_devices, cols.kind, cols.stage, cols.microbatch)

    def __len__(self) -> int:
        return len(self.actions)

    def subset(self, rows: np.ndarray, num_devices: int) -> Timeline:
        """The rows where ``rows`` (a boolean mask) is true, on ``num_devices`` devices."""
        keep = np.flatnonzero(rows)
        actions = [self.actions[i] for i in keep.tolist()]
        return Timeline(actions, self.device[keep], self.start[keep], self.end[keep], self.peer[keep],
                        self.nbytes[keep], num_devices, self.kind[keep], self.stage[keep], self.microbatch[keep],
                        self.pipeline_devices, self.stalls[self.stalls[:, 0] < num_devices])

    def mask(self, role: Role) -> np.ndarray:
        return ROLE_CODE[self.kind] == role

    def is_kind(self, *kinds: ActionKind) -> np.ndarray:
        return np.isin(self.kind, [KIND_CODE[k] for k in kinds])

    def to_frame(self) -> pd.DataFrame:
        """One row per action: device, stream, action, kind, stage, chunk, microbatch, start_ns, end_ns, bytes."""
        return pd.DataFrame({
            "device": self.device,
            "stream": [_stream(ROLES[r], int(peer)) for r, peer in zip(ROLE_CODE[self.kind], self.peer)],
            "action": [str(a) for a in self.actions],
            "kind": [KINDS[k].value for k in self.kind],
            "stage": self.stage,
            "chunk": self.stage // max(1, self.pipeline_devices or self.num_devices),
            "microbatch": self.microbatch,
            "start_ns": self.start,
            "end_ns": self.end,
            "bytes": self.nbytes,
        }, columns=list(COLUMNS))


FIELD_BITS = 20  # a device runs fewer than 2**20 spans of one kind at once: each kind's count fits its field


def uncovered_ns(records: Timeline, masks: Sequence[np.ndarray], cover: np.ndarray) -> list[np.ndarray]:
    """Per mask, per device: the ns during which one of the device's rows in the mask runs and none of its ``cover``
    rows does (e.g. transfers not hidden behind compute); an op's stalls (``Timeline.stalls``) do not cover. One
    sweep over the sorted span edges of every device and mask at once: each mask counts its open spans in its own
    bit field of one int64 level, and a stall closes its op's span in the cover's field while it lasts."""
    parts = []
    spans = [(records.device[m], records.start[m], records.end[m], 1) for m in masks]
    spans += [(records.device[cover], records.start[cover], records.end[cover], 1), (*records.stalls.T, -1)]
    for field_index, (device, start, end, sign) in enumerate(spans):
        weight = sign << (FIELD_BITS * min(field_index, len(masks)))
        parts.append((np.concatenate([device, device]), np.concatenate([start, end]),
                      np.concatenate([np.full(len(start), weight), np.full(len(end), -weight)])))
    device, time, delta = (np.concatenate([p[i] for p in parts]) for i in range(3))
    order = np.lexsort((delta, time, device))  # ends before starts at one instant: touching spans do not overlap
    device, time, level = device[order], time[order], np.cumsum(delta[order])
    length = np.append(np.diff(time), 0)  # until the next edge; the last edge of a device closes its spans
    uncovered = (level >> (FIELD_BITS * len(masks)) == 0) & np.append(device[1:] == device[:-1], False)
    field_mask = (1 << FIELD_BITS) - 1
    return [np.bincount(device[hit], length[hit], minlength=records.num_devices).astype(np.int64)
            for hit in (uncovered & ((level >> (FIELD_BITS * i)) & field_mask > 0) for i in range(len(masks)))]


def _stream(role: Role, peer: int) -> str:
    if role is Role.SEND:
        return f"send->{peer}"
    if role is Role.RECV:
        return f"recv<-{peer}"
    return role.name.lower()


MAX_RUN_NS = 1 << 53  # 104 days: beyond it float64 seconds lose nanoseconds, and int64 sums of spans could overflow


def _checked_times(times: RunTimes) -> tuple[np.ndarray, ...]:
    """The replay's four time lists as int64 arrays; CostError if the run lasts beyond MAX_RUN_NS."""
    lists = (times.entry_start, times.entry_end, times.flow_start, times.flow_end)
    try:
        arrays = tuple(np.asarray(values, dtype=np.int64) for values in lists)
    except OverflowError:
        arrays = ()
    if not arrays or max(int(a.max(initial=0)) for a in arrays) > MAX_RUN_NS:
        raise CostError(f"the run would last beyond {MAX_RUN_NS:,} ns (104 days); expected op times, bandwidths "
                        f"and latencies of a real cluster")
    return arrays


def replay_timeline(program: Program, times: RunTimes, num_devices: int, pipeline_devices: int = 0) -> Timeline:
    """The timeline of a replay: compute entries with their own times; SEND, RECV and collectives with their flow's."""
    cols = program.columns
    keep = np.flatnonzero(cols.role != Role.STAGE)
    role, flow = cols.role[keep], np.asarray(program.flow_of, dtype=np.int64)[keep]

    def per_flow(values: list[int] | np.ndarray) -> np.ndarray:  # a flow's value per row; -1 pads compute rows
        return np.append(np.asarray(values, dtype=np.int64), -1)[flow]

    entry_start, entry_end, flow_start, flow_end = _checked_times(times)
    compute = role == Role.COMPUTE
    start = np.where(compute, entry_start[keep], per_flow(flow_start))
    end = np.where(compute, entry_end[keep], per_flow(flow_end))
    peer = np.where(role == Role.SEND, per_flow(program.flow_dst),
                    np.where(role == Role.RECV, per_flow(program.flow_src), -1))
    nbytes = np.where(compute, 0, per_flow(program.flow_bytes))
    everything = len(keep) == program.num_entries
    actions = program.actions if everything else [program.actions[i] for i in keep.tolist()]
    kept = Columns(cols.stage[keep], cols.kind[keep], cols.microbatch[keep], cols.device[keep], role)
    timeline = Timeline.of(actions, kept.device, start, end, peer, nbytes, num_devices, kept)
    if times.stalls:
        stalls = np.array([(program.device[i], a, b) for i, spans in times.stalls.items() for a, b in spans],
                          dtype=np.int64)
        timeline = dataclasses.replace(timeline, stalls=stalls)
    return dataclasses.replace(timeline, pipeline_devices=pipeline_devices) if pipeline_devices else timeline
